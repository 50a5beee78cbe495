"""Individual filtering (``reserve(..., filtering=True)``) on both backends: the subjects
that cannot afford a release are left out and charged nothing, the others are charged,
the grant and its receipt read as they would had nobody been left out, a release that
leaves everyone out is still reserved and committed, and ``verify`` proves the history.
A cap checked on the reported epsilon (no privacy filter) refuses filtering."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import (
    BudgetCap,
    PrivacyBudgetLedger,
    ReleaseGate,
    ReleaseRefused,
    key_for,
    window_bounds,
)
from dp_budget_provider.ledger.windows.policy import DEFAULT_GRACE, Policy
from tests.admin import ADMIN
from tests.ledger_time import ledger_time_at

DELTA = 1e-5
WINDOW = "2026-w28"
LEDGER_WINDOWS = (WINDOW,)
PEOPLE = [f"p{i}" for i in range(10)]
# z = 2 costs eps 1.99 at delta 1e-5: one fits a cap of 3, two do not.
BIG = GaussianMechanism(2.0)
SMALL = GaussianMechanism(50.0)


@pytest.fixture
def ledger(ledger_url):
    ledger = PrivacyBudgetLedger(BudgetCap(3.0, DELTA), url=ledger_url, admin=ADMIN)
    yield ledger
    ledger.close()


def release(gate: ReleaseGate, people, mechanism, attempt: str, *, query_type="heatmap"):
    """Reserve over ``people`` (filtered) and commit: the grant and the receipt."""
    cohort = gate.cohort(people)
    granted = gate.reserve(
        [cohort.in_window(query_type, WINDOW)], mechanism, attempt=attempt, filtering=True
    )
    return granted, gate.commit(granted)


def spent(ledger, person: str, query_type: str = "heatmap") -> float:
    return ledger.epsilon_of(key_for(person, query_type, WINDOW))


def test_subjects_without_budget_are_left_out_and_charged_nothing(ledger):
    gate = ReleaseGate(ledger)
    release(gate, PEOPLE[:3], BIG, "d/t/r/0/1/a")  # p0..p2 cannot afford another
    exhausted = spent(ledger, "p0")
    granted, receipt = release(gate, PEOPLE, BIG, "d/t/r/0/1/b")
    assert granted.left_out == {"p0", "p1", "p2"}
    assert [spent(ledger, p) for p in PEOPLE[:3]] == [exhausted] * 3
    assert all(spent(ledger, p) == pytest.approx(1.993, abs=1e-3) for p in PEOPLE[3:])
    assert receipt.subjects == 10 and receipt.windows == (WINDOW,)
    report = ledger.verify(quarantine=False)
    assert report.ok, report.problems


def test_the_grant_and_receipt_say_nothing_of_who_or_how_many(make_ledger, ledger_url, tmp_path):
    """The same release in a world where three of its subjects are exhausted by another
    DAG and in one where nobody is: the task is told the same (but the reservation id)."""

    def told(url: str, exhaust: bool) -> tuple[object, ...]:
        ledger = make_ledger(BudgetCap(3.0, DELTA), url=url, admin=ADMIN)
        if exhaust:
            release(ReleaseGate(ledger, dag="other"), PEOPLE[:3], BIG, "other/t/r/0/1/x")
        gate = ReleaseGate(ledger, dag="mine")
        granted, receipt = release(gate, PEOPLE, SMALL, "mine/t/r/0/1/y")
        seen = dataclasses.replace(receipt, reservation_id="-")
        return (granted.subjects, granted.windows, granted.mechanism, granted.count, seen)

    other = f"sqlite:///{tmp_path / 'other.db'}"
    assert told(ledger_url, True) == told(other, False)


def test_a_release_that_leaves_everyone_out_is_reserved_and_committed(ledger):
    gate = ReleaseGate(ledger)
    release(gate, PEOPLE, BIG, "d/t/r/0/1/a")
    before = {p: spent(ledger, p) for p in PEOPLE}
    granted, receipt = release(gate, PEOPLE, BIG, "d/t/r/0/1/b")
    assert granted.left_out == set(PEOPLE)
    assert receipt.subjects == 10 and receipt.epsilon == pytest.approx(1.993, abs=1e-3)
    assert {p: spent(ledger, p) for p in PEOPLE} == before
    assert ledger.verify(quarantine=False).ok


def test_a_subject_exhausted_at_a_wider_scope_is_left_out(ledger):
    ledger.set_policy(Policy(3.0, across="query_types"))
    gate = ReleaseGate(ledger)
    release(gate, PEOPLE[:2], BIG, "d/t/r/0/1/a", query_type="counts")
    # p0, p1 hold 1.99 across query types: another passes the cap of 3 there, not in heatmap.
    granted, _ = release(gate, PEOPLE, BIG, "d/t/r/0/1/b")
    assert granted.left_out == {"p0", "p1"}
    assert spent(ledger, "p0") == 0.0 and spent(ledger, "p2") > 0
    assert ledger.verify(quarantine=False).ok


def test_filtering_on_a_cap_checked_on_the_reported_epsilon_is_refused(make_ledger, ledger_url):
    ledger = make_ledger(
        BudgetCap(3.0, DELTA, filter_order="reported"), url=ledger_url, admin=ADMIN
    )
    gate = ReleaseGate(ledger)
    cohort = gate.cohort(PEOPLE)
    before = ledger.history()
    with pytest.raises(ValueError, match="fixed Renyi order"):
        gate.reserve(
            [cohort.in_window("heatmap", WINDOW)], SMALL, attempt="d/t/r/0/1/a", filtering=True
        )
    assert ledger.history() == before


def test_a_release_no_empty_account_affords_is_refused_before_anything_is_written(ledger):
    gate = ReleaseGate(ledger)
    cohort = gate.cohort(PEOPLE)
    before = ledger.history()
    with pytest.raises(ValueError, match="no subject could afford it"):
        gate.reserve(
            [cohort.in_window("heatmap", WINDOW)],
            GaussianMechanism(0.5),
            attempt="d/t/r/0/1/a",
            filtering=True,
        )
    assert ledger.history() == before


def test_only_a_registered_cohort_is_filtered(ledger):
    gate = ReleaseGate(ledger)
    with pytest.raises(ValueError, match="one registered cohort"):
        gate.reserve(
            [key_for("p0", "heatmap", WINDOW)], SMALL, attempt="d/t/r/0/1/a", filtering=True
        )


@pytest.mark.parametrize("exhausted", [PEOPLE[:3], PEOPLE], ids=["some-kept", "none-kept"])
def test_a_closed_window_refuses_whoever_would_be_kept(ledger, monkeypatch, exhausted):
    """A release past its window's grace period is refused whether the filter keeps some
    subjects or none: a release that keeps nobody charges no account, and must not be the
    one that slips through (its success would say that nobody was kept)."""
    gate = ReleaseGate(ledger)
    release(gate, exhausted, BIG, "d/t/r/0/1/a")
    ledger_time_at(monkeypatch, window_bounds(WINDOW)[1] + DEFAULT_GRACE + timedelta(hours=1))
    cohort = gate.cohort(PEOPLE)
    before = ledger.history()
    with pytest.raises(ReleaseRefused):
        gate.reserve(
            [cohort.in_window("heatmap", WINDOW)], BIG, attempt="d/t/r/0/1/b", filtering=True
        )
    assert ledger.history() == before
