"""One budget check over many keys: the same answer as the reservation it predicts.

``budget_check`` reads the keys' distinct held states in one grouped read per window and
converts each state once. Whatever history the keys have (overlapping cohorts, mixed
mechanisms, open reservations, untouched keys), a release it finds fitting is granted and
one it finds exceeding is refused, and the eps it reports is the reservation's own.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dp_budget_provider.accounting import (
    GaussianMechanism,
    LaplaceMechanism,
    PoissonSubsampledGaussianMechanism,
)
from dp_budget_provider.ledger import (
    BudgetCap,
    BudgetExhausted,
    LedgerKey,
    LedgerQuarantined,
    Policy,
    WindowSealed,
    key_for,
    keys_for,
    subject_ids,
)
from dp_budget_provider.ledger.accounts import held
from dp_budget_provider.ledger.windows.calendar import window_bounds
from dp_budget_provider.ledger.windows.policy import DEFAULT_GRACE
from tests.admin import AdminLedger
from tests.ledger_time import ledger_time_at

DELTA = 1e-5
SUBJECTS = [f"s{i}" for i in range(10)]
WINDOWS = ["2026-w10", "2026-w11"]
LEDGER_WINDOWS = tuple(WINDOWS)
MECHANISMS = [
    GaussianMechanism(1.2),
    GaussianMechanism(3.0),
    GaussianMechanism(7.5),
    LaplaceMechanism(0.3),
    LaplaceMechanism(1.0),
    PoissonSubsampledGaussianMechanism(1.5, 0.2),
]
COHORTS = st.lists(st.sampled_from(SUBJECTS), min_size=1, max_size=len(SUBJECTS), unique=True)
STEPS = st.lists(
    st.tuples(COHORTS, st.sampled_from(WINDOWS), st.sampled_from(MECHANISMS), st.booleans()),
    max_size=8,
)
_query_types = itertools.count()


@pytest.fixture
def ledger(ledger_url):
    ledger = AdminLedger(BudgetCap(3.0, DELTA), url=ledger_url)
    yield ledger
    ledger.close()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    steps=STEPS,
    cohort=COHORTS,
    windows=st.lists(st.sampled_from(WINDOWS), min_size=1, max_size=2, unique=True),
    mechanism=st.sampled_from(MECHANISMS),
    count=st.integers(1, 4),
)
def test_the_check_predicts_the_reservation_to_the_last_bit(
    ledger, steps, cohort, windows, mechanism, count
):
    query_type = f"q{next(_query_types)}"  # a fresh scope per example, on one ledger
    for subjects, window, step_mechanism, stays_open in steps:
        try:
            reservation = ledger.reserve(
                keys_for(subjects, query_type, [window]), step_mechanism, count=2
            )
        except BudgetExhausted:
            continue
        if not stays_open:
            ledger.commit(reservation)
    keys = keys_for(cohort, query_type, windows)
    check = ledger.budget_check(keys, mechanism, count)
    singles = {key: ledger.prospective_epsilon(key, mechanism, count) for key in keys}
    checked = {key: ledger.budget_check([key], mechanism, count).checked_epsilon for key in keys}
    assert check.keys == len(keys) and check.key in singles and check.cap_epsilon == 3.0
    # The worst key is the one the cap check counts highest; its epsilon is the reported one.
    assert check.checked_epsilon == max(checked.values()) == checked[check.key]
    assert check.epsilon == singles[check.key]
    assert 1 <= check.states <= len(keys)
    assert ledger.would_exceed(keys, mechanism, count) is check.exceeds
    try:
        reservation = ledger.reserve(keys, mechanism, count)
    except BudgetExhausted as refusal:
        event("refused")
        assert check.exceeds, "the check said it fits, the reservation refused"
        assert refusal.would_be_epsilon <= check.checked_epsilon
    else:
        event("granted")
        assert not check.exceeds, "the check said it exceeds, the reservation was granted"
        # The reservation records the highest epsilon it brings a key to (under a filter,
        # not always the worst key's by the cap check).
        assert reservation.prospective_epsilon == max(singles.values())


def test_the_worst_key_is_the_one_closest_to_its_own_cap(ledger):
    ledger.set_policy(Policy(1.0, tenant="strict"))
    loose = key_for("a", "count", WINDOWS[0], tenant="loose")
    strict = key_for("a", "count", WINDOWS[0], tenant="strict")
    ledger.spend(loose, GaussianMechanism(5.0), count=2)  # more eps, further from the cap of 3
    check = ledger.budget_check([loose, strict], GaussianMechanism(6.0))
    assert check.key == strict and check.cap_epsilon == 1.0
    assert check.epsilon < ledger.prospective_epsilon(loose, GaussianMechanism(6.0))
    assert check.states == 2 and not check.exceeds
    assert ledger.would_exceed([loose, strict], GaussianMechanism(1.0))


def test_untouched_keys_hold_the_zero_state_and_are_named_when_alone(ledger):
    fresh = keys_for(["x", "y"], "count", WINDOWS[:1])
    check = ledger.budget_check(fresh, GaussianMechanism(4.0))
    assert check.key == min(fresh) and check.states == 1
    assert check.epsilon == ledger.prospective_epsilon(fresh[0], GaussianMechanism(4.0))
    ledger.spend(fresh[1], GaussianMechanism(4.0))
    check = ledger.budget_check(fresh, GaussianMechanism(4.0))
    assert check.key == fresh[1] and check.states == 2


def test_many_keys_are_one_grouped_read_per_window_and_chunk(ledger, monkeypatch):
    """Few statements however many keys: the subjects travel as one list parameter."""
    monkeypatch.setattr(held, "CHUNK", 40)
    keys = keys_for([f"u{i}" for i in range(100)], "heatmap", WINDOWS)
    ledger.commit(ledger.reserve(keys[:30], GaussianMechanism(5.0)))
    ledger.reserve(keys[130:150], LaplaceMechanism(0.5))  # open, in the second window
    reads = []

    def count_reads(conn, cursor, statement, parameters, context, executemany):
        if "FROM dp_members" in statement and "GROUP BY" in statement:
            reads.append(statement)

    engine = ledger._database.engine
    sa.event.listen(engine, "before_cursor_execute", count_reads)
    try:
        check = ledger.budget_check(keys, GaussianMechanism(5.0))
    finally:
        sa.event.remove(engine, "before_cursor_execute", count_reads)
    assert len(reads) == 2 * 3  # two windows, 100 subjects in chunks of 40
    # Committed, open and untouched: equal states of different chunks and windows merge.
    assert check.keys == 200 and check.states == 3
    assert check.key in keys[130:150]  # the open Laplace costs more than the committed z=5
    assert check.epsilon == ledger.prospective_epsilon(keys[130], GaussianMechanism(5.0))
    assert check.epsilon > ledger.prospective_epsilon(keys[0], GaussianMechanism(5.0))


def test_subjects_come_from_any_collection():
    assert subject_ids(np.array(["Alice", "bob"])) == ["alice", "bob"]
    assert subject_ids(np.arange(3)) == ["0", "1", "2"]
    assert subject_ids(s for s in ["x", "X", " x "]) == ["x"]  # one subject
    assert subject_ids({"k"}) == ["k"]
    keys = keys_for(range(3), "count", ["2026-w10", "2026-W10", "2026-w11"], tenant="ACME")
    assert keys == [key_for(str(i), "count", w, tenant="acme") for w in WINDOWS for i in range(3)]


@pytest.mark.parametrize(
    ("subjects", "message"),
    [
        ("alice", "a template renders to a string"),
        ({"a": 1}, "not a mapping"),
        ([], "subjects is empty"),
        (lambda: ["a"], "got function"),
        ([True], "subject must be a string"),
        ([1.5], "subject must be a string"),
        (["ok", ""], "subject must not be empty"),
        (7, "got int"),
    ],
)
def test_bad_subjects_are_refused_before_any_database_work(subjects, message):
    with pytest.raises(ValueError, match=message):
        keys_for(subjects, "count", WINDOWS)


# ---------------------------------------------------------------- what reserve refuses anyway


def _sealed(ledger, monkeypatch):
    key = key_for("alice", "count", "2026-w10")
    ledger.spend(key, GaussianMechanism(5.0))
    ledger_time_at(monkeypatch, window_bounds("2026-w10")[1] + DEFAULT_GRACE)  # resettable
    ledger.reset("2026-w10")
    return [key]


def _rescoped(ledger, monkeypatch):
    old = key_for("bob", "snapshot", "2026-w11")
    ledger.spend(old, GaussianMechanism(5.0))
    ledger.rescope(old, key_for("bob", "trajectory", "2026-w11"))
    return keys_for(["alice", "bob", "carol"], "snapshot", ["2026-w11"])


def _not_begun(ledger, monkeypatch):
    return keys_for(["alice"], "count", ["2026-w11", "2099-w10"])


def _not_a_label(ledger, monkeypatch):
    return keys_for(["alice"], "count", ["campaign-q3"])


def _quarantined(ledger, monkeypatch):
    ledger.quarantine(reason="verify found a broken chain")
    return keys_for(["alice"], "count", ["2026-w11"])


@pytest.mark.parametrize(
    ("keys_of", "refusal"),
    [
        (_sealed, WindowSealed),
        (_rescoped, WindowSealed),
        (_not_begun, ValueError),
        (_not_a_label, ValueError),
        (_quarantined, LedgerQuarantined),
    ],
)
def test_the_check_refuses_what_the_reservation_refuses_whatever_the_budget(
    ledger, monkeypatch, keys_of, refusal
):
    """A sealed window, a re-scoped key, a window label that is not its calendar's or has
    not begun, a quarantined ledger: the reservation refuses them however much budget is
    left, so the check refuses them too (with the reservation's error), never "fits"."""
    keys = keys_of(ledger, monkeypatch)
    with pytest.raises(refusal) as reserved:
        ledger.reserve(keys, GaussianMechanism(5.0))
    with pytest.raises(refusal) as checked:
        ledger.budget_check(keys, GaussianMechanism(5.0))
    assert str(checked.value) == str(reserved.value)
    with pytest.raises(refusal):
        ledger.would_exceed(keys, GaussianMechanism(5.0))
    # What a key would reach stays a number to look at (no release is implied), except in
    # a sealed window: its final spend is no live state, and a price without it is too low.
    if keys_of is _sealed:
        with pytest.raises(WindowSealed):
            ledger.prospective_epsilon(keys[0], GaussianMechanism(5.0))
    else:
        assert ledger.prospective_epsilon(keys[0], GaussianMechanism(5.0)) > 0


def test_a_key_part_holding_a_newline_is_refused_not_split(postgres_url):
    """PostgreSQL receives the subjects newline-separated: a key that did not come through
    canonicalisation (from_canonical with raw text) is refused as the reservation refuses
    it, not read as the two subjects around its newline."""
    ledger = AdminLedger(BudgetCap(3.0, DELTA), url=postgres_url)
    ledger.spend(key_for("a", "count", "2026-w11"), GaussianMechanism(3.0))
    forged = LedgerKey.from_canonical("default", "a\nb", "count", "2026-w11")
    try:
        for attempt in (ledger.reserve, ledger.budget_check):
            with pytest.raises(ValueError, match="newline"):
                attempt([forged], GaussianMechanism(3.0))
    finally:
        ledger.close()


def test_windows_given_as_one_string_are_refused():
    with pytest.raises(ValueError, match="windows must be a collection"):
        keys_for(["a"], "count", "2026-w10")


class _Frame:
    """A two-dimensional table that iterates over its column labels, as a pandas DataFrame
    does (pandas is not a dependency): its labels must never become subjects."""

    ndim = 2

    def __iter__(self):
        return iter(["user_id", "value"])


@pytest.mark.parametrize(
    ("subjects", "message"),
    [
        (_Frame(), "one-dimensional"),
        (np.array([["a", "b"], ["c", "d"]]), "one-dimensional"),
        (np.array("alice"), "one-dimensional"),
        ([10**5000], "more than 256 digits"),
        ([np.bytes_(b"alice")], "subject must be a string, got bytes_"),
        ([np.True_], "subject must be a string, got bool_"),
        ([1.0], "subject must be a string, got float"),
        ([None], "subject must be a string, got NoneType"),
        ([["a"]], "subject must be a string, got list"),
    ],
)
def test_ids_that_are_not_a_column_of_ids_are_refused(subjects, message):
    with pytest.raises(ValueError, match=message):
        subject_ids(subjects)
