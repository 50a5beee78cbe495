"""A release's publishable guarantee (``ReleaseGuarantee``), from real releases on a real
SQLite ledger: what it holds, the cohort's size bucket, and that it says no more than the
receipt (no subject; the account's eps only where the gate exposes budget state)."""

from __future__ import annotations

import json
import logging

import pytest

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.accounting.answer_rule import AnswerRule
from dp_budget_provider.ledger import (
    BudgetCap,
    CohortSizeBucket,
    DeclaredRelease,
    PrivacyBudgetLedger,
    ReleaseGate,
    ReleaseGuarantee,
    ReleaseResult,
    covered_by,
    key_for,
    make_release,
)
from dp_budget_provider.ledger.releases.guarantee import cohort_size
from tests.admin import ADMIN

WINDOWS = ("2026-w28", "2026-w29")
LEDGER_WINDOWS = WINDOWS
SUBJECTS = [f"person-{i:04d}" for i in range(120)]
LOG = logging.getLogger("tests.guarantee")


@pytest.fixture
def ledger(sqlite_url):
    ledger = PrivacyBudgetLedger(BudgetCap(3.0, 1e-5), url=sqlite_url, admin=ADMIN)
    yield ledger
    ledger.close()


def declared() -> DeclaredRelease:
    return DeclaredRelease(
        {"kind": "gaussian", "noise_multiplier": 4.0},
        "default",
        "heatmap",
        l2_sensitivity=1.0,
        rule=AnswerRule(cells=2, integer=True),
    )


def release(gate: ReleaseGate, subjects=SUBJECTS, query=lambda: [3, 4]):
    keys = covered_by(subjects, "heatmap", list(WINDOWS), "default")
    outcome = make_release(gate, declared(), keys, query, attempt=f"a-{id(query)}", log=LOG)
    return outcome, keys


@pytest.mark.parametrize(
    ("size", "bucket"),
    [
        (1, (1, 10)),
        (9, (1, 10)),
        (10, (10, 100)),
        (99, (10, 100)),
        (100, (100, 1000)),
        (999_999, (100_000, 1_000_000)),
        (1_000_000, (1_000_000, 10_000_000)),
    ],
)
def test_the_cohort_size_bucket_is_its_decade(size, bucket):
    assert CohortSizeBucket.of(size) == CohortSizeBucket(*bucket)


@pytest.mark.parametrize("size", [0, -3, 2.5, True, "12"])
def test_a_cohort_size_that_is_not_a_positive_integer_is_refused(size):
    with pytest.raises(ValueError, match="positive integer"):
        CohortSizeBucket.of(size)


def test_the_cohort_size_counts_subjects_once_whatever_the_windows(ledger):
    keys = covered_by(SUBJECTS, "heatmap", list(WINDOWS), "default")
    assert len(keys) == 240  # one key per subject and window
    assert cohort_size(keys) == 120
    cohort = ledger.cohort(SUBJECTS)
    assert cohort_size(covered_by(cohort, "heatmap", list(WINDOWS), "default")) == 120


def test_a_released_value_has_the_receipts_cost_its_noise_and_a_bucket_not_a_count(ledger):
    outcome, keys = release(ReleaseGate(ledger))
    assert outcome.result is ReleaseResult.released
    guarantee = ReleaseGuarantee.of(outcome, keys, ledger.delta)
    receipt = outcome.receipt
    assert guarantee.reservation_id == receipt.reservation_id
    assert guarantee.mechanism == receipt.mechanism
    assert guarantee.epsilon == receipt.epsilon
    assert guarantee.cap_epsilon == receipt.cap_epsilon == 3.0
    assert guarantee.delta == 1e-5
    assert guarantee.windows == WINDOWS
    assert guarantee.noise == "lattice"
    assert guarantee.noise_std == pytest.approx(4.0, rel=1e-9)  # sigma = 4 x sensitivity 1
    assert guarantee.cohort_size == CohortSizeBucket(100, 1000)  # 120 subjects
    # A gate that exposes no budget state tells no account's eps: the receipt has none.
    assert guarantee.epsilon_after is None and "epsilon_after" not in receipt.as_dict()
    document = json.dumps(guarantee.as_dict())
    assert json.loads(document) == guarantee.as_dict()  # plain JSON values
    assert not any(subject in document for subject in SUBJECTS)
    assert "120" not in document and "240" not in document  # neither count is told


def test_an_exposed_gate_adds_what_its_receipt_says_and_still_no_subject(ledger):
    ledger.spend(key_for(SUBJECTS[0], "heatmap", WINDOWS[0]), GaussianMechanism(3))
    outcome, keys = release(ReleaseGate(ledger, exposed=True))
    guarantee = ReleaseGuarantee.of(outcome, keys, ledger.delta)
    summary = outcome.receipt.as_dict()
    assert guarantee.epsilon_after == summary["epsilon_after"] > guarantee.epsilon
    document = json.dumps(guarantee.as_dict())
    assert summary["account"]["subject"] in SUBJECTS  # the receipt names it ...
    assert not any(subject in document for subject in SUBJECTS)  # ... the guarantee never


def test_a_charged_failure_has_a_guarantee(ledger):
    def broken():
        raise RuntimeError("the query failed after reading the data")

    failed, keys = release(ReleaseGate(ledger), query=broken)
    assert failed.result is ReleaseResult.failed
    assert ReleaseGuarantee.of(failed, keys, ledger.delta).epsilon == failed.receipt.epsilon


def test_a_refusal_has_no_guarantee(ledger):
    # 2.98 of 3.0 as the cap check counts it: nothing more fits.
    ledger.spend(key_for(SUBJECTS[7], "heatmap", WINDOWS[1]), GaussianMechanism(1.5))
    refused, keys = release(ReleaseGate(ledger))
    assert refused.result is ReleaseResult.refused
    assert ReleaseGuarantee.of(refused, keys, ledger.delta) is None
