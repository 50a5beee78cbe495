"""Spend classes against brute force: every subject is charged exactly its releases.

Random overlapping cohorts (as lists of keys and as registered cohort handles), mixed
mechanisms, reservations left open across other releases (so splits carry them), some
released and some committed: after every step each subject's eps must equal that of an
accountant fed exactly the committed releases that covered it, and a reservation must be
refused exactly when some subject it covers would pass the cap (counting what is open).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dp_budget_provider.accounting import (
    GaussianMechanism,
    LaplaceMechanism,
    RDPAccountant,
)
from dp_budget_provider.ledger import (
    BudgetCap,
    BudgetExhausted,
    Cohort,
    CohortKeys,
    PrivacyBudgetLedger,
    key_for,
    keys_for,
)
from tests.ledger.checked import checked_epsilon

# Over 20 s in all: scheduled before the light files (tests/conftest.py).
pytestmark = pytest.mark.heavy

WINDOW = "2026-w20"
LEDGER_WINDOWS = (WINDOW,)
CAP = BudgetCap(3.0, 1e-6)
SUBJECTS = [f"p{i:02d}" for i in range(24)]
MECHANISMS = [GaussianMechanism(4.0), GaussianMechanism(2.5), LaplaceMechanism(0.4)]


class Brute:
    """The per-subject truth: committed and open releases of every subject."""

    def __init__(self, ledger: PrivacyBudgetLedger) -> None:
        self.ledger = ledger
        self.committed: dict[str, list] = {s: [] for s in SUBJECTS}
        self.open: dict[str, tuple[list[str], object]] = {}

    def epsilon(self, releases: list) -> float:
        accountant = RDPAccountant(self.ledger.orders)
        for mechanism in releases:
            accountant.compose(mechanism, 1)
        return accountant.get_epsilon(self.ledger.delta)[0] if releases else 0.0

    def checked(self, releases: list) -> float:
        """What the cap check counts of ``releases``: at the cap's own order."""
        return checked_epsilon(CAP.epsilon, CAP.delta, *((m, 1) for m in releases))

    def held(self, subject: str) -> list:
        return self.committed[subject] + [
            mechanism for members, mechanism in self.open.values() if subject in members
        ]


def run(ledger: PrivacyBudgetLedger, seed: int, steps: int) -> set[str]:
    rng = random.Random(seed)
    brute = Brute(ledger)
    handles: dict[frozenset[str], Cohort] = {}
    outcomes: set[str] = set()
    reservations = {}
    for step in range(steps):
        if reservations and rng.random() < 0.35:
            name = rng.choice(sorted(reservations))
            reservation = reservations.pop(name)
            members, mechanism = brute.open.pop(name)
            if rng.random() < 0.7:
                ledger.commit(reservation)
                for subject in members:
                    brute.committed[subject].append(mechanism)
                outcomes.add("commit")
            else:
                ledger.release(reservation, reason="not run")
                outcomes.add("release")
        else:
            members = sorted(rng.sample(SUBJECTS, rng.randint(1, len(SUBJECTS))))
            mechanism = rng.choice(MECHANISMS)
            if rng.random() < 0.5:
                cohort = handles.setdefault(frozenset(members), ledger.cohort(members))
                covered = cohort.in_window("heatmap", WINDOW)
            else:
                covered = keys_for(members, "heatmap", [WINDOW])
            checked = {s: brute.checked(brute.held(s) + [mechanism]) for s in members}
            worst = max(checked.values())
            name = f"r{step}"
            try:
                reservation = ledger.reserve(covered, mechanism, attempt=name)
            except BudgetExhausted as refusal:
                assert worst > CAP.epsilon * (1 - 1e-9), (worst, refusal)
                assert refusal.key.subject in members
                outcomes.add("refused")
            else:
                assert worst <= CAP.epsilon * (1 + 1e-9), worst
                # It records the highest epsilon it brings an account to.
                reported = max(brute.epsilon(brute.held(s) + [mechanism]) for s in members)
                assert reservation.prospective_epsilon == pytest.approx(reported, rel=1e-9)
                reservations[name] = reservation
                brute.open[name] = (members, mechanism)
                outcomes.add("granted")
        for subject in SUBJECTS:
            expected = brute.epsilon(brute.committed[subject])
            got = ledger.epsilon_of(key_for(subject, "heatmap", WINDOW))
            assert got == pytest.approx(expected, rel=1e-9, abs=1e-12), (step, subject)
            assert got >= expected * (1 - 1e-12)  # never below the true loss
    return outcomes


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_subject_is_charged_exactly_its_releases(ledger_url, make_ledger, seed):
    ledger = make_ledger(cap=CAP, url=ledger_url)
    outcomes = run(ledger, seed, 40)
    assert {"granted", "refused", "commit"} <= outcomes, outcomes
    assert ledger.verify().ok, ledger.verify().problems


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_overlapping_cohorts_on_sqlite(sqlite_url, make_ledger, tmp_path, seed):
    url = f"sqlite:///{tmp_path / f'{seed}.db'}"
    run(make_ledger(cap=CAP, url=url), seed, 25)


def test_known_cohorts_touch_one_row_per_class(ledger_url, make_ledger):
    """A cohort its window has seen is charged through its listed accounts: a repeated
    release writes the same few rows however many subjects it covers."""
    ledger = make_ledger(cap=CAP, url=ledger_url)
    everyone = ledger.cohort([f"u{i}" for i in range(500)])
    north = ledger.cohort([f"u{i}" for i in range(200)])
    covered = everyone.in_window("count", WINDOW)
    ledger.commit(ledger.reserve(north.in_window("count", WINDOW), GaussianMechanism(9.0)))
    first = ledger.reserve(covered, GaussianMechanism(9.0))
    assert len(first.keys) == 2  # north's class, and the 300 new subjects
    receipts = ledger.commit(first)
    assert sorted(r.subjects for r in receipts) == [200, 300]
    again = ledger.commit(ledger.reserve(covered, GaussianMechanism(9.0)))
    assert [r.key for r in again] == [r.key for r in receipts]
    check = ledger.budget_check(covered, GaussianMechanism(9.0))
    assert check.keys == 500 and check.states == 2
    assert ledger.verify().ok


def test_a_handle_must_name_a_registered_cohort(ledger_url, make_ledger):
    """A handle naming no stored cohort, or another size, is the caller's mistake (a
    ValueError: the operator fails without retrying), for the reserve and the check alike;
    nothing is written."""
    ledger = make_ledger(cap=CAP, url=ledger_url)
    real = ledger.cohort(["a", "b"])
    forged = Cohort(real.tenant, "0" * 64, 2)
    lying = Cohort(real.tenant, real.digest, 1)  # a handle that understates its size
    for handle in (forged, lying):
        covered = handle.in_window("count", WINDOW)
        with pytest.raises(ValueError, match="register"):
            ledger.reserve(covered, GaussianMechanism(5.0))
        with pytest.raises(ValueError, match="register"):
            ledger.budget_check(covered, GaussianMechanism(5.0))
    for digest in ("x", "z" * 64, "٣" * 64, 7):
        with pytest.raises(ValueError, match="64 hex digits"):
            Cohort.from_dict({"tenant": "default", "digest": digest, "size": 2})
    for size in (0, True, 2.0, "2"):
        with pytest.raises(ValueError, match="positive integer"):
            Cohort("default", real.digest, size)
    assert ledger.epsilon_of(key_for("a", "count", WINDOW)) == 0.0
    assert ledger.history()[-1]["action"] != "reserve"


def test_a_handle_built_by_hand_is_canonical(ledger_url, make_ledger):
    """However a caller spells the tenant, query type or window of a handle it builds, it
    names one budget: six spellings of one query type are six releases on one account,
    and the seventh that would pass the cap is refused."""
    ledger = make_ledger(cap=CAP, url=ledger_url)
    real = ledger.cohort(["alice", "bob"])
    spelled = Cohort(" DEFAULT ", real.digest.upper(), real.size)
    assert spelled == real
    mechanism = GaussianMechanism(20.0)
    for query_type in ("count", "COUNT", "Count", " count", "count ", "ＣＯＵＮＴ"):
        covered = CohortKeys(spelled, query_type, WINDOW)
        assert covered == real.in_window("count", WINDOW)
        ledger.commit(ledger.reserve(covered, mechanism))
    accountant = RDPAccountant(ledger.orders)
    accountant.compose(mechanism, 6)
    spent = ledger.epsilon_of(key_for("alice", "count", WINDOW))
    assert spent == pytest.approx(accountant.get_epsilon(ledger.delta)[0], rel=1e-9)
    assert [row.key.query_type for row in ledger.accounts()] == ["count", "count"]
    with pytest.raises(ValueError):
        CohortKeys(real.as_dict(), "count", WINDOW)  # a mapping is not a handle


def test_awkward_ids_round_trip_through_the_cohort_store(ledger_url, make_ledger):
    """Backslashes, quotes, COPY's NULL marker and non-ASCII ids are stored as they are."""
    ledger = make_ledger(cap=CAP, url=ledger_url)
    ids = ["a\\b", "q\"u,o'te", "\\N", "x\\\\y", "é ü", "tab-free\u00a0space"]
    cohort = ledger.cohort(ids)
    receipts = ledger.commit(ledger.reserve(cohort.in_window("q", WINDOW), GaussianMechanism(5.0)))
    assert [r.subjects for r in receipts] == [len(ids)]
    for subject in ids:
        assert ledger.epsilon_of(key_for(subject, "q", WINDOW)) == receipts[0].epsilon
    assert ledger.cohort(ids) == cohort  # the same set is the same cohort
    assert ledger.verify().ok
