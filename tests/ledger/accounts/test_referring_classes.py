"""Classes that refer to their cohort: a cohort new to its window writes no member rows.

The class a cohort makes when it covers none of its window's classes holds exactly the
cohort's subjects, so its members are read through the cohort (``dp_accounts.cohort_id``)
until a later cohort splits it, which lists them in ``dp_members`` first. Every read of
membership sees both, and ``verify`` proves both: an edited reference, a member listed
twice, or a cohort the class was wrongly kept apart from is caught, on either backend.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import (
    BudgetCap,
    LedgerCorrupt,
    PrivacyBudgetLedger,
    key_for,
    keys_for,
)
from dp_budget_provider.ledger.storage import dialects
from dp_budget_provider.ledger.views.pages import AccountFilter
from dp_budget_provider.ledger.views.queries import find_accounts
from tests.ledger.audit.test_tamper import KEY, assert_caught, fetch
from tests.ledger.memberships_sql import MEMBERS
from tests.ledger.storage.test_pending_and_server_paths import execute

CAP = BudgetCap(epsilon=50.0, delta=1e-5)
W = "2026-w44"
LEDGER_WINDOWS = (W, "2026-w45")
RELEASE = GaussianMechanism(6.0)
POPULATION = [f"p{i:03d}" for i in range(40)]


@pytest.fixture
def ledger(ledger_url) -> Iterator[PrivacyBudgetLedger]:
    made = PrivacyBudgetLedger(CAP, url=ledger_url, chain_key=KEY)
    yield made
    made.close()


def members_of(url: str, account: str) -> list[str]:
    rows = fetch(url, f"SELECT subject FROM {MEMBERS} m WHERE account = :a ORDER BY 1", a=account)
    return [row[0] for row in rows]


def referring(url: str) -> list[tuple[str, int, int]]:
    """(label, size, cohort size) of each class that refers to its cohort."""
    return [
        tuple(row)
        for row in fetch(
            url,
            "SELECT a.subject, a.size, c.size FROM dp_accounts a JOIN dp_cohorts c "
            "ON c.id = a.cohort_id ORDER BY a.subject",
        )
    ]


def test_a_new_cohort_makes_one_class_that_refers_to_it(ledger, ledger_url):
    keys = keys_for(POPULATION, "heatmap", [W])
    ledger.commit(ledger.reserve(keys, RELEASE))
    ((label, size, cohort_size),) = referring(ledger_url)
    assert size == cohort_size == len(POPULATION)
    assert fetch(ledger_url, "SELECT count(*) FROM dp_members") == [(0,)]
    assert members_of(ledger_url, label) == POPULATION
    # Every read of one subject finds the class: receipts, its account, the per-subject
    # view, the grouped check, the class's members page.
    one = key_for("p007", "heatmap", W)
    assert ledger.account_of(one).subject == label
    assert ledger.epsilon_of(one) == ledger.receipt(one).epsilon > 0
    assert ledger.subject_of(ledger.account_of(one)) == key_for("p000", "heatmap", W)
    check = ledger.budget_check(keys, RELEASE)
    assert check.states == 1 and not check.exceeds
    found = find_accounts(ledger, AccountFilter(subject="p007")).items
    assert [(s.key.subject, s.epsilon) for s in found] == [("p007", ledger.epsilon_of(one))]
    page = find_accounts(ledger, AccountFilter(window=W), limit=5, offset=10).items
    assert [s.key.subject for s in page] == POPULATION[10:15]
    assert [s.key.subject for s in ledger.accounts(window=W)] == POPULATION
    # The same release again, by keys or by the cohort's handle: the same one class.
    handle = ledger.cohort(POPULATION)
    ledger.commit(ledger.reserve(handle.in_window("heatmap", W), RELEASE))
    ledger.commit(ledger.reserve(keys, RELEASE))
    assert [row[0] for row in referring(ledger_url)] == [label]
    assert ledger.verify().ok, ledger.verify().problems


def test_a_cohort_that_splits_the_class_lists_its_members_first(ledger, ledger_url):
    ledger.commit(ledger.reserve(keys_for(POPULATION, "heatmap", [W]), RELEASE))
    ((label, _, _),) = referring(ledger_url)
    overlap = POPULATION[30:] + ["q1", "q2"]
    ledger.commit(ledger.reserve(keys_for(overlap, "heatmap", [W]), RELEASE))
    assert referring(ledger_url) == []  # the parent is listed, its parts are no cohort's
    assert members_of(ledger_url, label) == POPULATION[:30]
    once, twice = (
        ledger.epsilon_of(key_for("p000", "heatmap", W)),
        ledger.epsilon_of(key_for("p035", "heatmap", W)),
    )
    assert 0 < once < twice
    assert ledger.epsilon_of(key_for("q1", "heatmap", W)) == once
    assert ledger.verify().ok, ledger.verify().problems
    # A cohort new to another window refers there, beside the listed classes here.
    ledger.commit(ledger.reserve(keys_for(overlap, "heatmap", ["2026-w45"]), RELEASE))
    assert [row[1] for row in referring(ledger_url)] == [len(overlap)]
    assert ledger.verify().ok, ledger.verify().problems


def _one_referring_class(ledger: PrivacyBudgetLedger, url: str) -> str:
    ledger.commit(ledger.reserve(keys_for(POPULATION, "heatmap", [W]), RELEASE))
    ledger.cohort([f"x{i:03d}" for i in range(40)])  # another cohort of the same size
    ledger.close()
    return referring(url)[0][0]


def test_a_reference_dropped_is_caught(ledger, ledger_url):
    label = _one_referring_class(ledger, ledger_url)
    execute(ledger_url, "UPDATE dp_accounts SET cohort_id = NULL WHERE subject = :a", a=label)
    assert_caught(ledger_url, f"{label}/heatmap/{W}: cohort_id")  # (it holds no subject now)


def test_a_reference_moved_to_another_cohort_of_the_same_size_is_caught(ledger, ledger_url):
    label = _one_referring_class(ledger, ledger_url)
    execute(
        ledger_url,
        "UPDATE dp_accounts SET cohort_id = (SELECT max(id) FROM dp_cohorts) WHERE subject = :a",
        a=label,
    )
    assert_caught(ledger_url, f"{label}/heatmap/{W} (holding default/x000/heatmap/{W}): cohort_id")


def test_a_member_listed_beside_its_cohort_is_caught(ledger, ledger_url):
    """A dp_members row for a class that refers to its cohort names a subject twice (or
    one that is no member): the class's dp_members count must be nought."""
    label = _one_referring_class(ledger, ledger_url)
    execute(
        ledger_url,
        'INSERT INTO dp_members (tenant, query_type, "window", subject, account) '
        "VALUES ('default', 'heatmap', :w, 'p003', :a)",
        w=W,
        a=label,
    )
    assert_caught(ledger_url, f"account default/{label}/heatmap/{W}: 1 members in dp_members")


def test_a_member_removed_from_the_referred_cohort_is_caught(ledger, ledger_url):
    label = _one_referring_class(ledger, ledger_url)
    execute(ledger_url, "DELETE FROM dp_cohort_members WHERE subject = 'p003'")
    assert_caught(ledger_url, "its digest is not that of its 39 members")
    assert "p003" not in members_of(ledger_url, label)


def test_a_class_kept_apart_from_a_cohort_that_holds_its_subjects_is_caught(ledger, ledger_url):
    """An insider hides a class (drops its reference) while a release over some of its
    subjects is made: the release finds no class of theirs and makes a new one, so those
    subjects escape the spend they hold. With the reference put back, every stored row
    agrees with the history, but the class overlaps a cohort the history keeps apart."""
    ledger.commit(ledger.reserve(keys_for(POPULATION, "heatmap", [W]), RELEASE))
    ((label, _, _),) = referring(ledger_url)
    (cohort,) = fetch(ledger_url, "SELECT cohort_id FROM dp_accounts WHERE subject = :a", a=label)
    execute(ledger_url, "UPDATE dp_accounts SET cohort_id = NULL WHERE subject = :a", a=label)
    ledger.commit(ledger.reserve(keys_for(POPULATION[:5], "heatmap", [W]), RELEASE))
    ledger.close()
    execute(
        ledger_url, "UPDATE dp_accounts SET cohort_id = :c WHERE subject = :a", c=cohort[0], a=label
    )
    assert_caught(ledger_url, f"{label}/heatmap/{W}: 5 of its 40 members")


def test_statistics_refreshed_inside_the_release_change_no_result(ledger, ledger_url, monkeypatch):
    """A release that writes many rows refreshes their tables' statistics before its next
    join (PostgreSQL's ANALYZE, inside the transaction): with every write past the mark,
    splits, new classes and cohorts read and verify the same."""
    statements: list[str] = []
    monkeypatch.setattr(dialects, "ANALYZE_AFTER", 1)
    for dialect in (dialects.PostgreSQLWrites, dialects.SQLiteWrites):
        monkeypatch.setattr(dialect, "written", _recording(dialect.written, statements))
    test_a_cohort_that_splits_the_class_lists_its_members_first(ledger, ledger_url)
    assert {"dp_cohort_members", "dp_members"} <= set(statements)


def _recording(analyze, statements):
    def record(dialect, pipe, table, written):
        statements.append(table)
        return analyze(dialect, pipe, table, written)

    return record


def test_a_subject_listed_in_two_classes_is_refused_by_reads_and_caught(ledger, ledger_url):
    """A dp_members row renamed onto a subject of a class that refers to its cohort puts
    that subject in two classes: its reads refuse (neither class holds all its spend),
    and verify names the class that lost its member."""
    ledger.commit(ledger.reserve(keys_for(POPULATION, "heatmap", [W]), RELEASE))
    extra = [f"x{i:03d}" for i in range(10)]
    ledger.commit(ledger.reserve(keys_for(POPULATION + extra, "heatmap", [W]), RELEASE))
    execute(ledger_url, "UPDATE dp_members SET subject = 'p003' WHERE subject = 'x005'")
    with pytest.raises(LedgerCorrupt, match="held by two accounts"):
        ledger.receipt(key_for("p003", "heatmap", W))
    ledger.close()
    assert_caught(ledger_url, "member default/p003/heatmap/")


def test_many_small_classes_of_new_subjects_verify_in_one_count_per_window(ledger, ledger_url):
    """Releases over one new subject each make one class each, all referring to their
    cohort: verify counts them against each other in one statement per window (a count
    per class would grow with their square), and finds one made to overlap another."""
    for subject in POPULATION[:30]:
        ledger.commit(ledger.reserve(keys_for([subject], "heatmap", [W]), RELEASE))
    assert len(referring(ledger_url)) == 30
    statements: list[str] = []
    engine = ledger._database.engine

    def record(conn, cursor, statement, parameters, context, executemany):
        if "theirs" in statement:
            statements.append(statement)

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        assert ledger.verify().ok, ledger.verify().problems
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)
    assert len(statements) == 1
    # p000's class hidden while a release over p000 and a new subject is made, then put
    # back: p000 is in two classes, and its own one overlaps the new cohort.
    ((label, cohort),) = fetch(
        ledger_url,
        "SELECT a.subject, a.cohort_id FROM dp_accounts a JOIN dp_cohort_members r "
        "ON r.cohort_id = a.cohort_id WHERE r.subject = 'p000'",
    )
    execute(ledger_url, "UPDATE dp_accounts SET cohort_id = NULL WHERE subject = :a", a=label)
    ledger.commit(ledger.reserve(keys_for(["p000", "q9"], "heatmap", [W]), RELEASE))
    ledger.close()
    execute(
        ledger_url, "UPDATE dp_accounts SET cohort_id = :c WHERE subject = :a", c=cohort, a=label
    )
    assert_caught(ledger_url, f"{label}/heatmap/{W}: 1 of its 1 members")
