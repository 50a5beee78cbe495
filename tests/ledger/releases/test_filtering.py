"""Individual filtering on both backends, through the release service (``make_release``
with a ``ContributionTable``): the subjects that cannot afford a release are left out of
its answer and charged nothing, the others are charged, the receipt reads as it would had
nobody been left out, a release that leaves everyone out is still reserved and committed,
and ``verify`` proves the history. Refused before anything is written: a cap checked on
the reported epsilon (no privacy filter), a release no empty account affords, a table
whose units move the answer by more than the declared sensitivity, a table of another
type, and a window no charge may take (whoever would be kept). A filtered reservation is
never given back."""

from __future__ import annotations

import dataclasses
import logging
from datetime import timedelta

import numpy as np
import pytest

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.accounting.answer_rule import AnswerRule
from dp_budget_provider.ledger import (
    BudgetCap,
    ContributionTable,
    DeclaredRelease,
    PrivacyBudgetLedger,
    ReleaseGate,
    ReleaseResult,
    key_for,
    make_release,
    unit_digest,
    window_bounds,
)
from dp_budget_provider.ledger.windows.policy import DEFAULT_GRACE, Policy
from tests.admin import ADMIN
from tests.ledger_time import ledger_time_at

DELTA = 1e-5
WINDOW = "2026-w28"
LEDGER_WINDOWS = (WINDOW,)
PEOPLE = [f"p{i}" for i in range(10)]
LOG = logging.getLogger("tests.filtering")
# A count on the lattice of integers: z = 2 is charged rho = 1/8 (eps 2.17 at delta 1e-5),
# one fits a cap of 3 on an empty account, two do not; z = 50 costs next to nothing.
BIG, SMALL = 2.0, 50.0


@pytest.fixture
def ledger(ledger_url):
    ledger = PrivacyBudgetLedger(BudgetCap(3.0, DELTA), url=ledger_url, admin=ADMIN)
    yield ledger
    ledger.close()


def table(people: list[str], amount: float = 1.0) -> ContributionTable:
    """Each person adds ``amount`` to the one value of a count."""
    units = np.array([unit_digest(person) for person in people], dtype="S16")
    count = len(people)
    return ContributionTable(
        units, np.arange(count), np.zeros(count, dtype=np.int64), np.full(count, amount), 1, True
    )


def release(gate: ReleaseGate, people, z: float, attempt: str, query_type="heatmap", **given):
    """A filtered count over ``people`` (each adds 1), as ``attempt``: the outcome."""
    cohort = gate.cohort(people)
    declared = DeclaredRelease(
        {"kind": "gaussian", "noise_multiplier": z},
        "default",
        query_type,
        l2_sensitivity=1.0,
        granularity=1.0,
        rule=AnswerRule(cells=1, integer=True),
    )
    keys = given.pop("keys", [cohort.in_window(query_type, WINDOW)])
    made = given.pop("table", table(people))
    log = given.pop("log", LOG)
    return make_release(gate, declared, keys, made, attempt=attempt, log=log, **given)


def spent(ledger, person: str, query_type: str = "heatmap") -> float:
    return ledger.epsilon_of(key_for(person, query_type, WINDOW))


def test_subjects_without_budget_are_left_out_and_charged_nothing(ledger, exact_answers):
    gate = ReleaseGate(ledger)
    release(gate, PEOPLE[:3], BIG, "d/t/r/0/1/a")  # p0..p2 cannot afford another
    exhausted = spent(ledger, "p0")
    outcome = release(gate, PEOPLE, BIG, "d/t/r/0/1/b")
    assert outcome.result is ReleaseResult.released
    assert exact_answers == [[3], [7]]  # the second counts p3..p9 alone
    assert [spent(ledger, p) for p in PEOPLE[:3]] == [exhausted] * 3
    assert {spent(ledger, p) for p in PEOPLE[3:]} == {gate.cost_alone(outcome.plan.charged)}
    assert outcome.receipt.subjects == 10 and outcome.receipt.windows == (WINDOW,)
    report = ledger.verify(quarantine=False)
    assert report.ok, report.problems


def test_the_receipt_says_nothing_of_who_or_how_many(make_ledger, ledger_url, tmp_path):
    """The same release in a world where three of its subjects are exhausted by another
    DAG and in one where nobody is: the task is told the same (but the reservation id)."""

    def told(url: str, exhaust: bool) -> object:
        ledger = make_ledger(BudgetCap(3.0, DELTA), url=url, admin=ADMIN)
        if exhaust:
            release(ReleaseGate(ledger, dag="other"), PEOPLE[:3], BIG, "other/t/r/0/1/x")
        outcome = release(ReleaseGate(ledger, dag="mine"), PEOPLE, SMALL, "mine/t/r/0/1/y")
        return outcome.result, dataclasses.replace(outcome.receipt, reservation_id="-")

    other = f"sqlite:///{tmp_path / 'other.db'}"
    assert told(ledger_url, True) == told(other, False)


def test_a_release_that_leaves_everyone_out_is_reserved_and_committed(ledger, exact_answers):
    gate = ReleaseGate(ledger)
    release(gate, PEOPLE, BIG, "d/t/r/0/1/a")
    before = {p: spent(ledger, p) for p in PEOPLE}
    outcome = release(gate, PEOPLE, BIG, "d/t/r/0/1/b")
    assert outcome.result is ReleaseResult.released and exact_answers[-1] == [0]
    assert outcome.receipt.subjects == 10
    assert {p: spent(ledger, p) for p in PEOPLE} == before
    assert ledger.verify(quarantine=False).ok


def test_a_subject_exhausted_at_a_wider_scope_is_left_out(ledger, exact_answers):
    ledger.set_policy(Policy(3.0, across="query_types"))
    gate = ReleaseGate(ledger)
    release(gate, PEOPLE[:2], BIG, "d/t/r/0/1/a", query_type="counts")
    # p0, p1 hold a release across query types: another passes the cap of 3 there, not
    # in heatmap, where they have none.
    release(gate, PEOPLE, BIG, "d/t/r/0/1/b")
    assert exact_answers[-1] == [8]
    assert spent(ledger, "p0") == 0.0 and spent(ledger, "p2") > 0
    assert ledger.verify(quarantine=False).ok


def invalid(ledger, outcome, before, match: str) -> None:
    assert outcome.result is ReleaseResult.invalid, outcome
    assert match in str(outcome.error)
    assert ledger.history() == before


def test_filtering_on_a_cap_checked_on_the_reported_epsilon_is_invalid(make_ledger, ledger_url):
    ledger = make_ledger(
        BudgetCap(3.0, DELTA, filter_order="reported"), url=ledger_url, admin=ADMIN
    )
    gate = ReleaseGate(ledger)
    gate.cohort(PEOPLE)
    before = ledger.history()
    invalid(ledger, release(gate, PEOPLE, SMALL, "d/t/r/0/1/a"), before, "fixed Renyi order")


def test_a_release_no_empty_account_affords_is_invalid(ledger):
    gate = ReleaseGate(ledger)
    gate.cohort(PEOPLE)
    before = ledger.history()
    invalid(ledger, release(gate, PEOPLE, 0.5, "d/t/r/0/1/a"), before, "no subject could afford")


def test_a_table_moving_more_than_declared_or_of_another_type_is_invalid(ledger):
    """A table made by hand charges what it releases: a unit adding 2 to a count declared
    at sensitivity 1 is refused, and so is a subclass, whose totals are not the
    service's own."""
    gate = ReleaseGate(ledger)
    gate.cohort(PEOPLE)
    before = ledger.history()
    invalid(
        ledger,
        release(gate, PEOPLE, SMALL, "d/t/r/0/1/a", table=table(PEOPLE, 2.0)),
        before,
        "more than the sensitivity declared",
    )

    class Sly(ContributionTable):
        pass

    plain = table(PEOPLE)
    sly = Sly(plain.units, plain.unit_of, plain.index, plain.amount, 1, True)
    invalid(ledger, release(gate, PEOPLE, SMALL, "d/t/r/0/1/b", table=sly), before, "itself")


def test_only_a_registered_cohort_is_filtered(ledger):
    gate = ReleaseGate(ledger)
    before = ledger.history()
    keys = [key_for(p, "heatmap", WINDOW) for p in PEOPLE]
    outcome = release(gate, PEOPLE, SMALL, "d/t/r/0/1/a", keys=keys)
    invalid(ledger, outcome, before, "one registered cohort")


def test_a_filtered_reservation_is_never_given_back(ledger):
    gate = ReleaseGate(ledger)
    cohort = gate.cohort(PEOPLE)
    granted = gate._reserve_filtering(
        [cohort.in_window("heatmap", WINDOW)],
        GaussianMechanism(SMALL),
        attempt="d/t/r/0/1/a",
    )
    with pytest.raises(ValueError, match="never given back"):
        gate.release(granted)
    assert len(ledger.open_reservations()) == 1


@pytest.mark.parametrize("exhausted", [PEOPLE[:3], PEOPLE], ids=["some-kept", "none-kept"])
def test_a_closed_window_refuses_whoever_would_be_kept(ledger, monkeypatch, exhausted):
    """A release past its window's grace period is refused whether the filter keeps some
    subjects or none: a release that keeps nobody charges no account, and must not be the
    one that slips through (its success would say that nobody was kept)."""
    gate = ReleaseGate(ledger)
    release(gate, exhausted, BIG, "d/t/r/0/1/a")
    ledger_time_at(monkeypatch, window_bounds(WINDOW)[1] + DEFAULT_GRACE + timedelta(hours=1))
    before = ledger.history()
    outcome = release(gate, PEOPLE, BIG, "d/t/r/0/1/b")
    assert outcome.result is ReleaseResult.refused
    assert ledger.history() == before


def test_what_was_checked_is_what_is_released(ledger, exact_answers):
    """The caller's arrays and table are not the service's: changing them between the
    sensitivity check and the totals (here from the log the caller hands in, which the
    service calls after reserving) changes nothing that is released."""
    gate = ReleaseGate(ledger)
    source = np.ones(len(PEOPLE))
    units = np.array([unit_digest(person) for person in PEOPLE], dtype="S16")
    made = ContributionTable(
        units, np.arange(len(PEOPLE)), np.zeros(len(PEOPLE), dtype=np.int64), source, 1, True
    )

    class Swapping(logging.LoggerAdapter):
        def info(self, message, *args, **kwargs):
            source[:] = 1e6  # the array the table was made from
            object.__setattr__(made, "amount", np.full(len(PEOPLE), 1e6))  # the table itself

    outcome = release(gate, PEOPLE, SMALL, "d/t/r/0/1/a", table=made, log=Swapping(LOG, {}))
    assert outcome.result is ReleaseResult.released
    assert exact_answers == [[10]]


@pytest.mark.parametrize(
    "broken",
    [
        {"unit_of": np.arange(3.0)},  # positions as floats
        {"index": [0, 0, 0]},  # not an array
        {"units": np.array([b"a", b"b", b"c"])},  # not 16-byte digests
        {"size": 0},
    ],
)
def test_a_malformed_table_is_refused_when_made(broken):
    arguments = {
        "units": np.array([unit_digest(p) for p in PEOPLE[:3]], dtype="S16"),
        "unit_of": np.arange(3),
        "index": np.zeros(3, dtype=np.int64),
        "amount": np.ones(3),
        "size": 1,
        **broken,
    }
    with pytest.raises(ValueError):
        ContributionTable(**arguments)


def float_table(people: list[str], unit_of: list[int], amount: list[float]) -> ContributionTable:
    """A one-value sum whose entries are given one by one."""
    units = np.array([unit_digest(person) for person in people], dtype="S16")
    return ContributionTable(
        units, np.array(unit_of), np.zeros(len(unit_of), dtype=np.int64), np.array(amount), 1
    )


def test_a_huge_entry_and_its_opposite_swallow_nothing(ledger, exact_answers):
    """p0 adds 2**60 before everyone's +1 and takes it back after: p0's exact move is 0,
    and the total is the others' count exactly, whether p0 is kept or left out (a
    running float sum would drop every +1 between p0's entries, and then show whether p0
    was left out); one unit whose entries 2**60, 100, -2**60 move it by 100 is refused at
    sensitivity 1 (its float move is 0)."""
    gate = ReleaseGate(ledger)
    people = PEOPLE
    entries = [0] + list(range(1, 10)) + [0]
    amounts = [2.0**60] + [1.0] * 9 + [-(2.0**60)]
    release(gate, people, SMALL, "d/t/r/0/1/a", table=float_table(people, entries, amounts))
    release(gate, people[:1], BIG, "d/t/r/0/1/b")  # p0 cannot afford another
    release(gate, people[:1], BIG, "d/t/r/0/1/c")
    release(gate, people, SMALL, "d/t/r/0/1/d", table=float_table(people, entries, amounts))
    assert exact_answers[0] == exact_answers[-1] == [9.0]
    before = ledger.history()
    swallowing = float_table(people[:1], [0, 0, 0], [2.0**60, 100.0, -(2.0**60)])
    outcome = release(gate, people[:1], SMALL, "d/t/r/0/1/e", table=swallowing)
    invalid(ledger, outcome, before, "more than the sensitivity declared")


def test_narrow_positions_and_a_unit_named_twice_are_refused(ledger):
    """Positions as int8 would wrap (unit 4 of 64 values is unit 0's key) and let two
    units' opposite moves cancel; a unit named twice would move the answer once per
    name. Both are refused before anything is written."""
    gate = ReleaseGate(ledger)
    gate.cohort(PEOPLE)
    before = ledger.history()
    units = np.array([unit_digest(person) for person in PEOPLE], dtype="S16")
    wrapping = ContributionTable(
        units,
        np.array([0, 4], dtype=np.int8),
        np.zeros(2, dtype=np.int8),
        np.array([5.0, -5.0]),
        64,
    )
    outcome = release(gate, PEOPLE, SMALL, "d/t/r/0/1/a", table=wrapping)
    invalid(ledger, outcome, before, "more than the sensitivity declared")
    twice = np.array([unit_digest("p0")] * 3, dtype="S16")
    named_twice = ContributionTable(
        twice, np.arange(3), np.zeros(3, dtype=np.int64), np.ones(3), 1, True
    )
    outcome = release(gate, PEOPLE, SMALL, "d/t/r/0/1/b", table=named_twice)
    invalid(ledger, outcome, before, "names a unit twice")
