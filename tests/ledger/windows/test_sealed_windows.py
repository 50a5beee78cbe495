"""A sealed window's final spend stays readable, per subject and per class, state SEALED.

A reset seals a closed window and moves its accounts out of the live ones
(``dp_sealed_accounts``, one row per class); its members stay where they were. Every read
(``epsilon_of``, ``receipt``, ``accounts``, the spend classes, an account's status, the
report) answers a sealed window's key with its final spend, never zero, and ``verify``
proves the sealed rows from the history. Both backends.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

import pytest
import sqlalchemy as sa

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import BudgetCap, LedgerError, WindowSealed, key_for
from dp_budget_provider.ledger.storage import clock as ledger_clock
from dp_budget_provider.ledger.views import queries, report, report_markdown
from dp_budget_provider.ledger.views.pages import AccountFilter
from dp_budget_provider.ledger.views.spend_classes import every_class
from tests.admin import AdminLedger

WEEK = "2026-w28"
DURING = datetime(2026, 7, 8, tzinfo=timezone.utc)
AFTER = datetime(2026, 8, 8, tzinfo=timezone.utc)  # past the week and its grace period


def key(subject: str, window: str = WEEK):
    return key_for(subject, "heatmap", window, tenant="acme")


@pytest.fixture
def sealed(ledger_url, monkeypatch):
    """A week with two classes (1,000 subjects of which 400 released over twice), read,
    then reset; and the epsilons read before the reset."""
    monkeypatch.setattr(ledger_clock, "now", lambda: DURING)
    ledger = AdminLedger(BudgetCap(3.0, 1e-5), url=ledger_url)
    everyone = ledger.cohort([f"u{i:04d}" for i in range(1000)], tenant="acme")
    north = ledger.cohort([f"u{i:04d}" for i in range(400)], tenant="acme")
    for cohort in (everyone, north):
        ledger.commit(ledger.reserve(cohort.in_window("heatmap", WEEK), GaussianMechanism(3.0)))
    before = {
        "u0001": ledger.epsilon_of(key("u0001")),
        "u0900": ledger.epsilon_of(key("u0900")),
    }
    classes_before = {c.subjects: c.status.epsilon for c in every_class(ledger, AccountFilter())}
    monkeypatch.setattr(ledger_clock, "now", lambda: AFTER)
    assert ledger.reset(WEEK) == 1000
    yield ledger, before, classes_before
    ledger.close()


def test_a_sealed_windows_final_spend_is_read_per_subject_and_per_class(sealed):
    ledger, before, classes_before = sealed
    assert before["u0001"] > before["u0900"] > 0
    # epsilon_of and receipt answer the final spend, never 0.0.
    for subject, epsilon in before.items():
        assert ledger.epsilon_of(key(subject)) == epsilon
        assert ledger.receipt(key(subject)).epsilon == epsilon
    assert ledger.epsilon_of(key("never-charged")) == 0.0
    # Live reads hold no sealed rows; a window named (or sealed=True) reads them, SEALED.
    assert ledger.accounts() == []
    listed = ledger.accounts(window=WEEK)
    assert len(listed) == 1000 and {s.state for s in listed} == {"SEALED"}
    assert {s.key.subject: s.epsilon for s in listed if s.key.subject in before} == before
    assert [s.key for s in ledger.accounts(sealed=True, limit=2, offset=399)] == [
        key("u0399"),
        key("u0400"),
    ]
    assert report.count_accounts(ledger, window=WEEK) == 1000
    assert report.count_accounts(ledger) == 0
    # Classes: one row each, with their size and final epsilon, state SEALED.
    assert every_class(ledger, AccountFilter()) == []
    sealed_classes = every_class(ledger, AccountFilter(window=WEEK))
    assert {c.subjects: c.status.epsilon for c in sealed_classes} == classes_before
    assert {c.status.state for c in sealed_classes} == {"SEALED"}
    members = AccountFilter(sealed=True)
    assert {c.subjects for c in every_class(ledger, members)} == {400, 600}
    # The account page's read (a subject, and its class by label).
    status = queries.account_status(ledger, key("u0900"))
    assert status is not None and status.state == "SEALED" and status.sealed_at is not None
    assert status.epsilon == before["u0900"] and status.subjects == 600
    label = ledger.account_of(key("u0900"))
    assert label is not None and queries.account_status(ledger, label).subjects == 600
    # The sealed window stays sealed, and the whole ledger verifies.
    with pytest.raises(LedgerError, match="sealed"):
        ledger.spend(key("u0001"), GaussianMechanism(3.0))
    assert ledger.verify().ok


def test_a_cohort_windows_seal_is_one_row_per_class(sealed, ledger_url):
    """The live tables hold no sealed window; the sealed one holds a row per class and
    writes no per-subject row for a class that refers to its cohort."""
    engine = sa.create_engine(ledger_url)
    with engine.connect() as connection:
        count = lambda table: connection.execute(  # noqa: E731
            sa.text(f"SELECT count(*) FROM {table}")
        ).scalar_one()
        assert count("dp_accounts") == 0
        assert count("dp_sealed_accounts") == 2
        # The split wrote the 1,000 subjects' membership (as before the reset); a release
        # over one new cohort writes none, sealed or not.
        assert count("dp_members") == 1000
    engine.dispose()


def test_a_cohort_new_to_its_window_seals_without_member_rows(ledger_url, monkeypatch):
    monkeypatch.setattr(ledger_clock, "now", lambda: DURING)
    ledger = AdminLedger(BudgetCap(3.0, 1e-5), url=ledger_url)
    cohort = ledger.cohort([f"u{i}" for i in range(5000)], tenant="acme")
    ledger.commit(ledger.reserve(cohort.in_window("heatmap", WEEK), GaussianMechanism(3.0)))
    epsilon = ledger.epsilon_of(key("u4999"))
    monkeypatch.setattr(ledger_clock, "now", lambda: AFTER)
    ledger.reset(WEEK)
    assert ledger.epsilon_of(key("u4999")) == epsilon > 0
    with ledger.reading() as connection:
        assert connection.execute(sa.text("SELECT count(*) FROM dp_members")).scalar_one() == 0
        rows = connection.execute(sa.text("SELECT size FROM dp_sealed_accounts")).all()
    assert [tuple(row) for row in rows] == [(5000,)]
    assert ledger.verify().ok
    ledger.close()


@pytest.mark.parametrize(
    "edit, named",
    [
        ("UPDATE dp_sealed_accounts SET rho = rho / 2", "committed spend differs"),
        ("UPDATE dp_sealed_accounts SET sealed_at = '2026-07-20T00:00:00.000000Z'", "sealed_at"),
        ("UPDATE dp_sealed_accounts SET size = size + 1", "size differs"),
        ("DELETE FROM dp_sealed_accounts WHERE size = 400", "sealed with its final spend"),
    ],
)
def test_an_insider_edit_of_a_sealed_final_spend_is_named_by_verify(
    sealed, ledger_url, edit, named
):
    ledger, before, _ = sealed
    engine = sa.create_engine(ledger_url)
    with engine.begin() as connection:
        connection.execute(sa.text(edit))
    engine.dispose()
    found = ledger.verify()
    assert not found.ok
    assert any(named in problem for problem in found.problems), found.problems


def test_an_edit_of_a_sealed_windows_members_is_named_by_verify(sealed, ledger_url):
    """Its members stay proven: a subject moved between the sealed classes is found."""
    ledger, _, _ = sealed
    engine = sa.create_engine(ledger_url)
    with engine.begin() as connection:
        smaller = connection.execute(
            sa.text("SELECT subject FROM dp_sealed_accounts WHERE size = 400")
        ).scalar_one()
        connection.execute(
            sa.text("UPDATE dp_members SET account = :label WHERE subject = 'u0900'"),
            {"label": smaller},
        )
    engine.dispose()
    assert not ledger.verify().ok


def test_a_window_sealed_before_final_spends_were_kept_is_refused_not_zero(sealed, ledger_url):
    """A reset of an earlier version deleted the accounts: reading its keys as untouched
    would answer 0.0 for keys that were charged."""
    ledger, _, _ = sealed
    engine = sa.create_engine(ledger_url)
    with engine.begin() as connection:
        connection.execute(sa.text("DELETE FROM dp_sealed_accounts"))
        connection.execute(sa.text("DELETE FROM dp_members"))
    engine.dispose()
    with pytest.raises(LedgerError, match="did not keep final spends"):
        ledger.epsilon_of(key("u0001"))


def test_the_report_is_by_class_and_its_subject_listing_opt_in_and_paged(ledger_url, monkeypatch):
    """200,000 subjects in a few classes: a report of a few kilobytes (one row per class),
    the per-subject listing one page at a time, saying which page of how many."""
    monkeypatch.setattr(ledger_clock, "now", lambda: DURING)
    ledger = AdminLedger(BudgetCap(3.0, 1e-5), url=ledger_url)
    everyone = ledger.cohort([f"user-{i:06d}" for i in range(200_000)], tenant="acme")
    ledger.commit(ledger.reserve(everyone.in_window("heatmap", WEEK), GaussianMechanism(3.0)))
    started = time.monotonic()
    document = report.build_report(ledger, window=WEEK)
    markdown = report_markdown.render_markdown(document)
    took = time.monotonic() - started
    assert [c["subjects"] for c in document["classes"]] == [200_000]
    assert document["accounts"] == []
    assert document["subjects"] == {
        "listed": False, "total": 200_000, "page": 1, "pages": 200, "page_size": 1000,
    }  # fmt: skip
    assert len(markdown.encode()) < 20_000 and len(json.dumps(document)) < 20_000
    assert "## Guarantee per spend class" in markdown and "200,000" in markdown
    paged = report.build_report(ledger, window=WEEK, subjects=True, page=3, page_size=500)
    assert [a["subject"] for a in paged["accounts"]][:2] == ["user-001000", "user-001001"]
    assert len(paged["accounts"]) == 500 and paged["subjects"]["pages"] == 400
    assert "Page 3 of 400" in report_markdown.render_markdown(paged)
    with pytest.raises(ValueError, match="page 401 does not exist"):
        report.build_report(ledger, subjects=True, page=401, page_size=500)
    # Sealed, the same report reads the final spend, state SEALED.
    monkeypatch.setattr(ledger_clock, "now", lambda: AFTER)
    ledger.reset(WEEK)
    sealed_report = report.build_report(ledger, window=WEEK, subjects=True, page_size=2)
    assert [(c["subjects"], c["state"]) for c in sealed_report["classes"]] == [(200_000, "SEALED")]
    assert [a["state"] for a in sealed_report["accounts"]] == ["SEALED", "SEALED"]
    assert "No accounts in scope" not in report_markdown.render_markdown(sealed_report)
    assert took < 30
    ledger.close()


def test_a_sealed_key_is_never_priced_as_untouched(sealed):
    """A price on a sealed window's key would start from nothing (its final spend is no
    live state): the read refuses, naming the seal, as the check of a release does."""
    ledger, before, _ = sealed
    with pytest.raises(WindowSealed, match="sealed"):
        ledger.prospective_epsilon(key("u0001"), GaussianMechanism(3.0))
    with pytest.raises(WindowSealed):
        ledger.budget_check([key("u0001")], GaussianMechanism(3.0))
    assert ledger.epsilon_of(key("u0001")) == before["u0001"]
