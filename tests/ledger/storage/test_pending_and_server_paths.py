"""Pending spend on accounts, the server-side commit, the policy cache and migration 0002.

Everything here reads the stored rows directly (SQLAlchemy on the ledger's own URL), so
the checks do not depend on the ledger's own reading code. Expected costs come from
``RDPAccountant``, never from the ledger's pricing.

An account stores the summed cost of its open reservations as ``pending_rho``,
``pending_residual``, ``pending_mu2`` (NOT NULL: mu^2 summed over the open reservations
whose cost is Gaussian-only) and ``pending_others`` (how many open reservations are not
Gaussian-only: Laplace, pure DP, zCDP, subsampled Gaussian). The check treats the
pending spend as Gaussian-only exactly while ``pending_others`` is 0.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from dp_budget_provider.accounting import (
    DEFAULT_ORDERS,
    AccountantState,
    GaussianMechanism,
    LaplaceMechanism,
    Mechanism,
    PoissonSubsampledGaussianMechanism,
    PureDPMechanism,
    RDPAccountant,
    ZCDPMechanism,
)
from dp_budget_provider.ledger import (
    BudgetCap,
    BudgetExhausted,
    LedgerCorrupt,
    LedgerKey,
    Policy,
    PrivacyBudgetLedger,
    Reservation,
    ReservationStateError,
    key_for,
)
from dp_budget_provider.ledger.storage import database, history
from tests.admin import ADMIN
from tests.ledger import concurrency_workers as workers
from tests.ledger.memberships_sql import MEMBERS
from tests.ledger.releases.test_concurrency import run_workers

# Over 20 s in all: scheduled before the light files (tests/conftest.py).
pytestmark = pytest.mark.heavy

DELTA = 1e-5
WINDOW = "2026-w45"
LEDGER_WINDOWS = (WINDOW,)
UTC = timezone.utc
# The ledger's sums are rounded up at each addition and subtraction (rounding.ROUND_UP): a
# few ulps above the plain float sums these tests compute (proven >= exact in test_sums_up).
REL = 1e-13
PENDING_SLACK = 1e-15
ORDERS = np.asarray(DEFAULT_ORDERS, dtype=np.float64)
GAUSS = GaussianMechanism(3.0)
GAUSS_B = GaussianMechanism(3.5)
LAPLACE = LaplaceMechanism(0.2)
LAPLACE_B = LaplaceMechanism(0.25)
ACCOUNT_VALUES = (
    "rho",
    "residual",
    "gaussian_mu2",
    "releases",
    "open_reservations",
    "pending_rho",
    "pending_residual",
    "pending_mu2",
    "pending_others",
)

Cost = tuple[float, np.ndarray | None, float | None]
# What an account row must hold for its open reservations: (pending_rho, pending_residual
# or None, pending_mu2, pending_others).
PendingCost = tuple[float, np.ndarray | None, float, int]


# ---------------------------------------------------------------------------- helpers


def cost_of(mechanism: Mechanism, count: int = 1) -> Cost:
    """(rho, residual or None, mu^2 or None) of a release, as RDPAccountant composes it."""
    accountant = RDPAccountant(ORDERS)
    accountant.compose(mechanism, count)
    state = accountant.state()
    residual = np.array(state.residual, dtype=np.float64)
    return state.rho, (residual if residual.any() else None), state.gaussian_mu_squared


def total(*costs: Cost) -> Cost:
    """The sum of several costs (mu^2 is None as soon as one is non-Gaussian)."""
    rho, residual, mu2 = 0.0, None, 0.0
    for c_rho, c_residual, c_mu2 in costs:
        rho += c_rho
        if c_residual is not None:
            residual = c_residual.copy() if residual is None else residual + c_residual
        mu2 = None if mu2 is None or c_mu2 is None else mu2 + c_mu2
    return rho, residual, mu2


def pending_of(*costs: Cost) -> PendingCost:
    """The pending columns of an account whose open reservations cost ``costs``: rho and
    residual summed, mu^2 summed over the Gaussian-only costs, the others counted.
    """
    rho, residual, _ = total(*costs)
    mu2 = sum((c_mu2 for _, _, c_mu2 in costs if c_mu2 is not None), 0.0)
    others = sum(1 for _, _, c_mu2 in costs if c_mu2 is None)
    return rho, residual, mu2, others


def epsilon_of_releases(*releases: tuple[Mechanism, int]) -> float:
    accountant = RDPAccountant(ORDERS)
    for mechanism, count in releases:
        accountant.compose(mechanism, count)
    return accountant.get_epsilon(DELTA)[0]


def _parts(key: LedgerKey) -> tuple[str, str, str, str]:
    return key.tenant, key.subject, key.query_type, key.window


def accounts(url: str) -> dict[tuple[str, str, str, str], dict[str, Any]]:
    """Every subject's account row as stored (its class's), by subject key."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            rows = (
                connection.execute(
                    sa.text(
                        'SELECT m.tenant, m.subject, m.query_type, m."window", '
                        + ", ".join(f"a.{column}" for column in ACCOUNT_VALUES)
                        + f" FROM {MEMBERS} m JOIN dp_accounts a ON a.tenant = m.tenant "
                        'AND a.query_type = m.query_type AND a."window" = m."window" '
                        "AND a.subject = m.account"
                    )
                )
                .mappings()
                .all()
            )
    finally:
        engine.dispose()
    return {
        (r["tenant"], r["subject"], r["query_type"], r["window"]): {c: r[c] for c in ACCOUNT_VALUES}
        for r in rows
    }


def account(url: str, key: LedgerKey) -> dict[str, Any]:
    return accounts(url)[_parts(key)]


def execute(url: str, statement: str, **params: Any) -> None:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(sa.text(statement), params)
    finally:
        engine.dispose()


def scalar(url: str, statement: str, **params: Any) -> Any:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            return connection.execute(sa.text(statement), params).scalar()
    finally:
        engine.dispose()


def snapshot(url: str) -> dict[str, list[tuple]]:
    """Every row of every ledger table (dp_*), to prove that a refusal wrote nothing."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            tables = [t for t in sa.inspect(connection).get_table_names() if t.startswith("dp_")]
            return {
                table: sorted(
                    map(tuple, connection.execute(sa.text(f"SELECT * FROM {table}"))), key=repr
                )
                for table in tables
            }
    finally:
        engine.dispose()


def stored_residual(text: str | None) -> np.ndarray:
    return np.zeros(ORDERS.size) if text is None else np.array(json.loads(text))


def assert_pending(row: dict[str, Any], expected: PendingCost) -> None:
    """The row's pending columns equal ``expected`` (floats within REL, a zero residual may
    be NULL, the count of non-Gaussian reservations exactly). A closed reservation leaves
    its rounded-up share behind (ulps of what was pending: ``PENDING_SLACK`` absolute),
    until the account's last open reservation closes and everything pending is zero.
    """
    rho, residual, mu2, others = expected
    assert row["pending_rho"] == pytest.approx(rho, rel=REL, abs=PENDING_SLACK)
    assert row["pending_rho"] >= rho * (1 - 1e-15)
    want = np.zeros(ORDERS.size) if residual is None else residual
    stored = stored_residual(row["pending_residual"])
    np.testing.assert_allclose(stored, want, rtol=REL, atol=PENDING_SLACK)
    assert row["pending_mu2"] is not None, "pending_mu2 is NOT NULL: the Gaussian-only sum"
    assert row["pending_mu2"] == pytest.approx(mu2, rel=REL, abs=PENDING_SLACK), (
        "pending_mu2 must sum mu^2 over the open Gaussian-only reservations"
    )
    assert row["pending_others"] == others, (
        "pending_others must count the open reservations that are not Gaussian-only"
    )


def assert_nothing_pending(row: dict[str, Any]) -> None:
    """Exactly zero pending spend (not merely close to it) and no open reservation."""
    assert row["open_reservations"] == 0
    assert row["pending_rho"] == 0.0
    assert row["pending_residual"] is None
    assert row["pending_mu2"] is not None and row["pending_mu2"] == 0.0
    assert row["pending_others"] == 0


def created(reservation: Reservation) -> datetime:
    return datetime.strptime(reservation.created_at, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)


def close(ledger: PrivacyBudgetLedger, reservation: Reservation, how: str) -> None:
    """Close one open reservation the way ``how`` says (the others stay open)."""
    if how == "commit":
        ledger.commit(reservation)
    elif how == "release":
        ledger.release(reservation, reason="test: data never touched")
    else:
        # cutoff = this reservation's creation: the later ones are not old enough
        assert ledger.reap(timedelta(0), now=created(reservation)) == [reservation.id]


def spy_on_general_path(ledger: PrivacyBudgetLedger, monkeypatch: Any) -> list[str]:
    """Record the reservation ids charged through the Python general path (``_charge``)."""
    charged: list[str] = []
    original: Callable[..., Any] = ledger._reservations._charge

    def charge(connection: Any, row: Any, **kwargs: Any) -> Any:
        charged.append(row.id)
        return original(connection, row, **kwargs)

    monkeypatch.setattr(ledger._reservations, "_charge", charge)
    return charged


# ---------------------------------------------------------------- 1. pending bookkeeping

ZCDP = ZCDPMechanism(0.01)  # no residual curve and no mu^2: closes on the SQL-only path
SUBSAMPLED = PoissonSubsampledGaussianMechanism(1.1, 0.01)  # residual curve, no mu^2
PAIRS = {
    "gaussian": (GAUSS, GAUSS_B),
    "laplace": (LAPLACE, LAPLACE_B),
    "mixed-gaussian-closes-first": (GAUSS, LAPLACE),
    "mixed-laplace-closes-first": (LAPLACE, GAUSS),
    "mixed-zcdp-closes-first": (ZCDP, GAUSS_B),
    "mixed-subsampled-closes-first": (SUBSAMPLED, GAUSS_B),
}
CLOSERS = ["commit", "release", "reap"]


@pytest.mark.parametrize("how", CLOSERS)
@pytest.mark.parametrize("pair", PAIRS)
def test_pending_columns_follow_the_open_reservations(ledger_url, make_ledger, pair, how):
    """pending_* is the summed cost of exactly the open reservations at every step.

    One reservation: its cost. Two overlapping: the sum, with pending_mu2 summing the
    Gaussian-only costs and pending_others counting the rest. One closed (commit, commit
    by id, release or reap): the other's cost (a closed non-Gaussian one takes its count
    off and leaves mu^2 alone). Both closed: exactly 0.0 / NULL / 0.0 / 0 and no open
    reservation; committed spend only grows when the closing charges. At every step the
    prospective epsilon of one more Gaussian release is what RDPAccountant reports for the
    committed and open releases plus it (so the analytic-Gaussian bound is back once
    only Gaussian reservations are open and nothing else was committed).
    """
    first, second = PAIRS[pair]
    ledger = make_ledger(BudgetCap(50.0, DELTA), url=ledger_url)
    key = key_for("alice", "heatmap", WINDOW)
    c1, c2 = cost_of(first), cost_of(second)
    charges = how != "release"

    def check_prospective(*held: Mechanism) -> None:
        expected = epsilon_of_releases(*((m, 1) for m in held), (GAUSS, 1))
        assert ledger.prospective_epsilon(key, GAUSS) == pytest.approx(expected, rel=1e-12)

    r1 = ledger.reserve(key, first)
    row = account(ledger_url, key)
    assert row["open_reservations"] == 1
    assert_pending(row, pending_of(c1))
    assert (row["rho"], row["residual"], row["releases"]) == (0.0, None, 0)
    check_prospective(first)

    time.sleep(0.002)  # distinct creation stamps (reap cuts off by time)
    r2 = ledger.reserve(key, second)
    row = account(ledger_url, key)
    assert row["open_reservations"] == 2
    assert_pending(row, pending_of(c1, c2))
    assert row["pending_others"] == sum(c[2] is None for c in (c1, c2))
    check_prospective(first, second)

    close(ledger, r1, how)
    row = account(ledger_url, key)
    assert row["open_reservations"] == 1
    assert_pending(row, pending_of(c2))
    assert row["releases"] == (1 if charges else 0)
    assert row["rho"] == pytest.approx(c1[0] if charges else 0.0, rel=REL, abs=0)
    check_prospective(*((first, second) if charges else (second,)))

    close(ledger, r2, how)
    row = account(ledger_url, key)
    assert_nothing_pending(row)
    assert row["releases"] == (2 if charges else 0)
    assert row["rho"] == pytest.approx(total(c1, c2)[0] if charges else 0.0, rel=REL, abs=0)
    check_prospective(*((first, second) if charges else ()))
    assert ledger.verify().ok, ledger.verify().problems


@pytest.mark.parametrize(
    ("mechanism", "second"), [(GAUSS, GAUSS_B), (LAPLACE, LAPLACE_B)], ids=["gaussian", "laplace"]
)
def test_retried_calls_neither_add_nor_remove_pending_twice(
    ledger_url, make_ledger, mechanism, second
):
    """A second reserve with the same attempt is refused and adds no pending spend;
    committing an already committed reservation again and releasing a released one again
    take nothing more off the pending spend the other reservation holds.
    """
    ledger = make_ledger(BudgetCap(50.0, DELTA), url=ledger_url)
    key = key_for("alice", "heatmap", WINDOW)
    cost = cost_of(mechanism)

    first = ledger.reserve(key, mechanism, attempt="task-1")
    with pytest.raises(ReservationStateError, match="already reserved"):
        ledger.reserve(key, mechanism, attempt="task-1")
    row = account(ledger_url, key)
    assert row["open_reservations"] == 1
    assert_pending(row, pending_of(cost))

    other = ledger.reserve(key, second, attempt="task-2")
    ledger.commit(first)
    for _ in range(3):
        ledger.commit(first)
    row = account(ledger_url, key)
    assert (row["open_reservations"], row["releases"]) == (1, 1)
    assert_pending(row, pending_of(cost_of(second)))

    ledger.release(other, reason="test: data never touched")
    ledger.release(other, reason="test: again")
    assert_nothing_pending(account(ledger_url, key))
    assert ledger.verify().ok


NON_GAUSSIAN = {
    "laplace": LaplaceMechanism(0.01),
    "pure-dp": PureDPMechanism(0.01),
    "zcdp": ZCDPMechanism(1e-4),
    "subsampled-gaussian": PoissonSubsampledGaussianMechanism(1.1, 0.01),
}


@pytest.mark.parametrize("kind", NON_GAUSSIAN)
def test_a_closed_laplace_reservation_leaves_no_trace_on_the_gaussian_check(
    ledger_url, make_ledger, kind
):
    """Once a Laplace (or any other non-Gaussian) reservation is released while a Gaussian
    one stays open, the key is checked exactly like a key that never saw it: the
    analytic-Gaussian bound of the Gaussian releases alone.

    The cap lies between the analytic-Gaussian epsilon of two Gaussian releases and the
    generic RDP conversion of the same curve. While the non-Gaussian reservation is open
    a second Gaussian reserve is refused (the generic bound applies, and is above the
    cap); once it is released the prospective epsilon is the exact Gaussian value and
    the same reserve fits. A trace of the closed reservation (a stale count or NULL mu^2)
    would refuse it.
    """
    other = NON_GAUSSIAN[kind]
    key = key_for("alice", "heatmap", WINDOW)
    exact = epsilon_of_releases((GAUSS, 2))
    rho, _, mu2 = cost_of(GAUSS, 2)
    generic = RDPAccountant(ORDERS)
    generic.compose(ZCDPMechanism(rho), 1)  # the same curve without the Gaussian marker
    assert mu2 is not None and exact < generic.get_epsilon(DELTA)[0]
    cap = (exact + generic.get_epsilon(DELTA)[0]) / 2
    # The exact Gaussian bound decides only under the reported-epsilon rule.
    ledger = make_ledger(BudgetCap(cap, DELTA, filter_order="reported"), url=ledger_url)
    one = cost_of(GAUSS)

    ledger.reserve(key, GAUSS)
    held = ledger.reserve(key, other)
    assert_pending(account(ledger_url, key), pending_of(one, cost_of(other)))
    assert ledger.prospective_epsilon(key, GAUSS) == pytest.approx(
        epsilon_of_releases((GAUSS, 2), (other, 1)), rel=1e-12
    )
    before = snapshot(ledger_url)
    with pytest.raises(BudgetExhausted):
        ledger.reserve(key, GAUSS)
    assert snapshot(ledger_url) == before

    ledger.release(held, reason="test: data never touched")
    row = account(ledger_url, key)
    assert row["open_reservations"] == 1
    assert_pending(row, pending_of(one))
    assert row["pending_others"] == 0

    assert ledger.prospective_epsilon(key, GAUSS) == pytest.approx(exact, rel=1e-12)
    ledger.reserve(key, GAUSS)  # fits: only two Gaussian releases are held
    assert_pending(account(ledger_url, key), pending_of(one, one))
    assert ledger.verify().ok


# ---------------------------------------------------------------- 2. the check counts pending


@pytest.mark.parametrize("mechanism", [GAUSS, LAPLACE], ids=["gaussian", "laplace"])
def test_two_open_reservations_refuse_a_third_and_write_nothing(ledger_url, make_ledger, mechanism):
    """With a cap between the epsilon of two and of three releases, two *open*
    reservations (nothing committed) make a third reserve raise BudgetExhausted, on its
    own or in a multi-key release with an untouched key, and every dp_* table stays as it
    was; releasing one of the two lets the third through.
    """
    ledger = make_ledger(BudgetCap(100.0, DELTA), url=ledger_url, admin=ADMIN)
    key = key_for("alice", "heatmap", WINDOW)
    two = ledger.prospective_epsilon(key, mechanism, count=2)
    three = ledger.prospective_epsilon(key, mechanism, count=3)
    assert two == pytest.approx(epsilon_of_releases((mechanism, 2)), rel=1e-12)
    assert three == pytest.approx(epsilon_of_releases((mechanism, 3)), rel=1e-12)
    ledger.set_policy(Policy(cap_epsilon=(two + three) / 2, filter_order="reported"))

    first = ledger.reserve(key, mechanism)
    ledger.reserve(key, mechanism)
    before = snapshot(ledger_url)
    with pytest.raises(BudgetExhausted) as refusal:
        ledger.reserve(key, mechanism)
    assert refusal.value.would_be_epsilon == pytest.approx(three, rel=1e-12)
    with pytest.raises(BudgetExhausted):
        ledger.reserve([key_for("untouched", "heatmap", WINDOW), key], mechanism)
    assert snapshot(ledger_url) == before

    ledger.release(first, reason="test: data never touched")
    ledger.reserve(key, mechanism)
    assert ledger.verify().ok


# ---------------------------------------------------------------- 3. server path == general path


def scripted_releases(
    ledger: PrivacyBudgetLedger,
) -> tuple[list[tuple[LedgerKey, int, float]], dict[str, str]]:
    """One fixed sequence of every kind of write; returns the receipts and reservation ids.

    A receipt is recorded as (its class's least subject, the class's size, its epsilon),
    a release's receipts sorted: they come in the order of their accounts' random labels.
    """
    alice = key_for("alice", "heatmap", WINDOW)
    bob = key_for("bob", "heatmap", WINDOW)
    carol = key_for("carol", "heatmap", WINDOW)
    crowd = [key_for(f"subject-{i:02d}", "heatmap", WINDOW) for i in range(50)]
    gauss_b = GaussianMechanism(4.5)
    epsilons: list[tuple[LedgerKey, int, float]] = []
    ids: dict[str, str] = {}

    def record(receipts: Any) -> None:
        epsilons.extend(sorted((ledger.subject_of(r.key), r.subjects, r.epsilon) for r in receipts))

    # Gaussian single key, two overlapping reservations, the first committed as an object.
    r1 = ledger.reserve(alice, GAUSS)
    r2 = ledger.reserve(alice, gauss_b, count=2)
    record(ledger.commit(r1))
    # Gaussian over 50 keys plus one holding r2.
    r3 = ledger.reserve([*crowd, alice], GAUSS)
    record(ledger.commit(r3))
    # Laplace (residual curve) while r2 is still open.
    r4 = ledger.reserve([alice, crowd[0]], LAPLACE)
    record(ledger.commit(r4))
    # The other Gaussian reservation, then both committed again (charging nothing).
    record(ledger.commit(r2))
    record(ledger.commit(r1))
    record(ledger.commit(r2))
    # Released, reaped (zCDP: no mu^2, no residual), corrected, re-scoped.
    r5 = ledger.reserve([bob, crowd[1]], GAUSS)
    ledger.release(r5, reason="test: data never touched")
    r6 = ledger.reserve([bob, crowd[2]], ZCDPMechanism(0.01), count=3)
    assert ledger.reap(timedelta(0)) == [r6.id]
    record([ledger.correct(bob, LAPLACE, reason="test: a missed release")])
    record([ledger.rescope(bob, key_for("bob", "trajectory", WINDOW), reason="test")])
    # A subsampled Gaussian (residual curve) in one step.
    record([ledger.spend(carol, PoissonSubsampledGaussianMechanism(1.1, 0.01))])
    # Left with pending spend: Gaussian and Laplace overlapping, one Gaussian committed.
    r7 = ledger.reserve([crowd[3], crowd[4]], GAUSS)
    ledger.reserve([crowd[3]], LAPLACE)
    ledger.reserve([crowd[3], crowd[4]], gauss_b)
    record(ledger.commit(r7))
    ids.update(r1=r1.id, r2=r2.id, r3=r3.id, r4=r4.id, r6=r6.id, r7=r7.id)
    return epsilons, ids


def ledger_record(url: str) -> tuple[list[tuple], list[tuple]]:
    """History and reservations without what differs between runs (ids, stamps, attempts,
    tokens, the reap reason and lease, which name times, and account labels).

    Reservations are numbered in the order the history first names them. A reservation
    decided by the server (``dp_reserve``) records its prospective spend, not its epsilon;
    it is converted here, independently of the ledger, with ``RDPAccountant``, so both
    backends must record the same epsilon.

    An account made by a charge is a spend class labelled at random, so it is named here
    by how the history made it: ``new@<entry>`` (the subjects a charge's cohort brought
    to the scope) or ``<parent's name>/<entry>`` (a split's new part); a legacy account
    keeps its subject. Digests over labels are random as well: each backend's verify()
    proves them, and the keys they cover are compared here by name instead (the entries'
    cohorts, and every reservation's key rows).
    """

    def converted(rho: Any, mu2: Any) -> float:
        accountant = RDPAccountant.from_state(
            AccountantState(
                tuple(float(a) for a in ORDERS),
                float(rho),
                (0.0,) * ORDERS.size,
                None if mu2 is None else float(mu2),
            )
        )
        return accountant.get_epsilon(DELTA)[0]

    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            entries = connection.execute(
                sa.text(
                    'SELECT action, reservation_id, tenant, subject, query_type, "window", '
                    "payload FROM dp_history ORDER BY seq"
                )
            ).all()
            reservations = {
                row[0]: (
                    *row[1:8],
                    row[8] if row[8] is not None else converted(row[9], row[10]),
                )
                for row in connection.execute(
                    sa.text(
                        "SELECT id, state, mechanism, count, cost_rho, cost_residual, "
                        "cost_gaussian_mu2, key_count, prospective_epsilon, "
                        "prospective_rho, prospective_mu2 FROM dp_reservations"
                    )
                )
            }
            held: dict[str, list[tuple[str, str, str, str]]] = {}
            for rid, *key in connection.execute(
                sa.text(
                    'SELECT reservation_id, tenant, subject, query_type, "window" '
                    "FROM dp_reservation_keys"
                )
            ):
                held.setdefault(rid, []).append(tuple(key))
    finally:
        engine.dispose()
    number: dict[str, int] = {}
    names: dict[tuple[str, str, str, str], str] = {}  # (tenant, query type, window, label)

    def name(tenant: str, label: str, query_type: str, window: str) -> str:
        return names.get((tenant, query_type, window, label), label)

    def named_cohort(cohort: dict[str, Any], step: int) -> dict[str, Any]:
        """A charge's cohort with its accounts named, naming first what it made."""
        scope = (cohort["tenant"], cohort["query_type"], cohort["window"])
        refined = cohort["refined"]
        for parent, child, *_ in refined["split"] if refined else ():
            names[(*scope, child)] = f"{names.get((*scope, parent), parent)}/{step}"
        if refined and refined["new"]:
            names[(*scope, refined["new"][0])] = f"new@{step}"

        def of(labels: list[str]) -> list[str]:
            return sorted(names.get((*scope, label), label) for label in labels)

        if refined is not None:
            refined = {
                "kept": of(refined["kept"]),
                "split": sorted(
                    [*of([parent]), *of([child]), moved, sorted(number[rid] for rid in carried)]
                    for parent, child, moved, carried in refined["split"]
                ),
                "new": refined["new"] and [*of(refined["new"][:1]), refined["new"][1]],
            }
        return {**cohort, "accounts": of(cohort["accounts"]), "refined": refined}

    steps = []
    for step, (action, reservation_id, *key, payload) in enumerate(entries):
        if reservation_id is not None:
            number.setdefault(reservation_id, len(number))
        reaping = {"reason", "lease_expires_at"} if action == "reap" else set()
        varying = {"attempt_id", "token_hash", "keys_digest"} | reaping
        content = {k: v for k, v in json.loads(payload).items() if k not in varying}
        if "cohorts" in content:
            content["cohorts"] = [named_cohort(cohort, step) for cohort in content["cohorts"]]
        if "from" in content:
            moved = content["from"]
            label = name(moved["tenant"], moved["subject"], moved["query_type"], moved["window"])
            content["from"] = {**moved, "subject": label}
        if "prospective" in content:
            spend = content.pop("prospective")
            content["prospective_epsilon"] = converted(spend["rho"], spend["gaussian_mu2"])
        if key[0] is not None:
            key[1] = name(*key)
        steps.append((action, number.get(reservation_id), *key, content))
    assert set(number) == set(reservations)
    in_order = sorted(number, key=number.__getitem__)
    keys = {rid: sorted((k[0], name(*k), *k[2:]) for k in held[rid]) for rid in in_order}
    return steps, [(*reservations[rid], keys[rid]) for rid in in_order]


def test_postgres_and_sqlite_store_identical_accounts(
    postgres_url, sqlite_url, make_ledger, monkeypatch
):
    """The same script on PostgreSQL and SQLite leaves account tables equal value for
    value, floats and residual texts exactly, identical receipt epsilons, the same history
    payloads and reservation rows, and a clean verify on both; every charge on both goes
    through the one commit path (``_charge``).
    """
    results = {}
    records = {}
    for name, url in (("postgresql", postgres_url), ("sqlite", sqlite_url)):
        ledger = make_ledger(BudgetCap(100.0, DELTA), url=url)
        charged = spy_on_general_path(ledger, monkeypatch)
        epsilons, ids = scripted_releases(ledger)
        report = ledger.verify()
        assert report.ok, (name, report.problems)
        results[name] = (epsilons, ids, set(charged), accounts(url))
        records[name] = ledger_record(url)

    pg_eps, pg_ids, pg_charged, pg_rows = results["postgresql"]
    lite_eps, lite_ids, lite_charged, lite_rows = results["sqlite"]
    for ids, charged in ((pg_ids, pg_charged), (lite_ids, lite_charged)):
        assert {ids[name] for name in ("r1", "r2", "r3", "r4", "r6", "r7")} <= charged

    assert pg_eps == lite_eps
    assert set(pg_rows) == set(lite_rows)
    for key in sorted(pg_rows):
        assert pg_rows[key] == lite_rows[key], key
    # The same history (payloads: costs, digests, prospective epsilons) and reservations.
    assert records["postgresql"] == records["sqlite"]
    # Not vacuous: spend of every kind, and pending spend left over: a Laplace and a
    # Gaussian reservation open on subject-03 (counted / summed), the Gaussian alone on 04.
    left = pg_rows[("default", "subject-03", "heatmap", WINDOW)]
    assert left["open_reservations"] == 2
    assert_pending(left, pending_of(cost_of(LAPLACE), cost_of(GaussianMechanism(4.5))))
    assert left["pending_others"] == 1 and left["pending_mu2"] > 0
    assert left["pending_residual"] is not None
    left = pg_rows[("default", "subject-04", "heatmap", WINDOW)]
    assert left["open_reservations"] == 1
    assert_pending(left, pending_of(cost_of(GaussianMechanism(4.5))))


# ---------------------------------------------------------------- 4. tampering with pending

TAMPERING = {
    "pending_rho lowered": (GAUSS, "UPDATE dp_accounts SET pending_rho = pending_rho / 2"),
    "pending_mu2 lowered": (GAUSS, "UPDATE dp_accounts SET pending_mu2 = pending_mu2 / 2"),
    "pending_residual dropped": (LAPLACE, "UPDATE dp_accounts SET pending_residual = NULL"),
    # Zero open non-Gaussian reservations: the check would use the Gaussian bound.
    "pending_others zeroed": (LAPLACE, "UPDATE dp_accounts SET pending_others = 0"),
    "pending_others raised": (GAUSS, "UPDATE dp_accounts SET pending_others = 1"),
    "pending_mu2 given to a Laplace": (LAPLACE, "UPDATE dp_accounts SET pending_mu2 = 0.5"),
}


@pytest.mark.parametrize("tampering", TAMPERING)
def test_verify_reports_pending_spend_edited_in_sql(ledger_url, make_ledger, tampering):
    """Changing an open reservation's pending spend directly in SQL (lowering it would
    let the prospective check pass releases it must refuse; zeroing pending_others would
    make it use the Gaussian bound for a Laplace cost) is a problem verify() reports.
    """
    mechanism, statement = TAMPERING[tampering]
    ledger = make_ledger(BudgetCap(10.0, DELTA), url=ledger_url)
    key = key_for("alice", "heatmap", WINDOW)
    ledger.commit(ledger.reserve(key, mechanism))
    ledger.reserve(key, mechanism)
    assert ledger.verify().ok
    before = account(ledger_url, key)

    execute(ledger_url, statement)

    assert account(ledger_url, key) != before
    report = ledger.verify()
    assert not report.ok
    # The problem names the account edited: the subject's class (of one).
    account_key = ledger.account_of(key)
    assert any(str(account_key) in problem for problem in report.problems), report.problems


@pytest.mark.parametrize("column", ["pending_mu2", "pending_others"])
def test_the_database_refuses_a_null_pending_column(ledger_url, make_ledger, column):
    """pending_mu2 and pending_others are NOT NULL (a NULL mu^2 no longer means anything):
    an UPDATE setting either to NULL is refused and changes nothing.
    """
    ledger = make_ledger(BudgetCap(10.0, DELTA), url=ledger_url)
    ledger.reserve(key_for("alice", "heatmap", WINDOW), LAPLACE)
    before = snapshot(ledger_url)
    with pytest.raises(sa.exc.IntegrityError):
        execute(ledger_url, f"UPDATE dp_accounts SET {column} = NULL")
    assert snapshot(ledger_url) == before


def test_a_negative_pending_count_fails_closed(ledger_url, make_ledger):
    """A negative pending_others (edited in SQL) is refused as corrupt by the check, which
    then writes nothing, rather than read as "no non-Gaussian reservation open".
    """
    ledger = make_ledger(BudgetCap(10.0, DELTA), url=ledger_url)
    key = key_for("alice", "heatmap", WINDOW)
    ledger.reserve(key, LAPLACE)
    execute(ledger_url, "UPDATE dp_accounts SET pending_others = -1")
    before = snapshot(ledger_url)
    with pytest.raises(LedgerCorrupt):
        ledger.reserve(key, GAUSS)
    with pytest.raises(LedgerCorrupt):
        ledger.prospective_epsilon(key, GAUSS)
    assert snapshot(ledger_url) == before


# ---------------------------------------------------------------- 5. policy cache


def test_policy_changes_reach_a_ledger_that_holds_policies(ledger_url, make_ledger):
    """Ledger A keeps policies between releases; a change by ledger B (set_policy) or by
    plain SQL on dp_policies (no ledger API; on PostgreSQL the trigger bumps
    policy_version) applies to A's very next reserve and to A's commit receipts.
    """
    a = make_ledger(BudgetCap(10.0, DELTA), url=ledger_url, admin=ADMIN)
    b = make_ledger(url=ledger_url, admin=ADMIN)
    key = key_for("alice", "heatmap", WINDOW)
    postgresql = ledger_url.startswith("postgresql")

    def version() -> int:
        return scalar(ledger_url, "SELECT policy_version FROM dp_ledger_config WHERE id = 1")

    first = a.commit(a.reserve(key, GAUSS))[0]
    assert first.cap_epsilon == 10.0
    held = a.reserve(key, GAUSS)  # A has read (and cached) the policies again
    b.set_policy(Policy(cap_epsilon=20.0))
    assert a.commit(held)[0].cap_epsilon == 20.0

    # B lowers the cap so that A's next release would pass it.
    next_epsilon = a.prospective_epsilon(key, GAUSS)
    seen = version()
    b.set_policy(Policy(cap_epsilon=(a.epsilon_of(key) + next_epsilon) / 2))
    if postgresql:
        assert version() > seen
    with pytest.raises(BudgetExhausted):
        a.reserve(key, GAUSS)

    # Raised again in plain SQL: A sees the change, and refuses the unsigned row (it does
    # not fall back to the policies it read before either).
    seen = version()
    execute(
        ledger_url,
        "UPDATE dp_policies SET cap_epsilon = 10.0 WHERE tenant = '*' AND query_type = '*'",
    )
    if postgresql:
        assert version() > seen
    with pytest.raises(LedgerCorrupt, match="not signed by the ledger's administrator"):
        a.reserve(key, GAUSS)

    # The administrator raises it: A uses the new cap.
    b.set_policy(Policy(cap_epsilon=10.0))
    receipt = a.commit(a.reserve(key, GAUSS))[0]
    assert receipt.cap_epsilon == 10.0


# ---------------------------------------------------------------- 6. migration 0001 -> 0002


def migrate(url: str, action: str, revision: str) -> None:
    """Run alembic ``upgrade``/``downgrade`` on the ledger's own kind of connection."""
    engine = database.make_engine(url)
    try:
        with database.migrating(engine) as connection:
            config = Config()
            config.set_main_option("script_location", str(database.MIGRATIONS))
            config.attributes["connection"] = connection
            getattr(command, action)(config, revision)
    finally:
        engine.dispose()


def columns_of(url: str, table: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            return {c["name"] for c in sa.inspect(connection).get_columns(table)}
    finally:
        engine.dispose()


def server_functions(url: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            return set(
                connection.execute(
                    sa.text(
                        "SELECT proname FROM pg_proc WHERE proname IN "
                        "('dp_append', 'dp_commit', 'dp_bump_policy_version')"
                    )
                ).scalars()
            )
    finally:
        engine.dispose()


def seed_revision_0001(url: str) -> dict[str, tuple[list[LedgerKey], Cost]]:
    """A ledger at 0001 written in raw SQL: two accounts, open and closed reservations."""
    stamp = "2026-11-02T00:00:00.000000Z"
    alice = key_for("alice", "heatmap", WINDOW)
    bob = key_for("bob", "heatmap", WINDOW)
    reservations = {
        # id: (state, mechanism, count, keys)
        "r-gauss-open": ("open", GAUSS, 2, [alice, bob]),
        "r-laplace-open": ("open", LAPLACE, 1, [alice]),
        "r-gauss-committed": ("committed", GAUSS_B, 1, [bob]),
        "r-laplace-released": ("released", LAPLACE_B, 1, [bob]),
    }
    committed = cost_of(GAUSS_B)
    engine = sa.create_engine(url)
    try:
        with engine.begin() as connection:
            run = connection.execute
            run(
                sa.text(
                    "INSERT INTO dp_ledger_config (id, delta, orders, conversion, created_at) "
                    "VALUES (1, :delta, :orders, 'improved', :at)"
                ),
                {"delta": DELTA, "orders": json.dumps(ORDERS.tolist()), "at": stamp},
            )
            run(
                sa.text("INSERT INTO dp_chain_head (id, seq, hash) VALUES (1, 0, :genesis)"),
                {"genesis": history.GENESIS},
            )
            run(
                sa.text(
                    "INSERT INTO dp_policies (tenant, query_type, cap_epsilon, warn_fraction, "
                    "calendar, calendar_length_seconds, min_window_seconds, compliance_clause, "
                    "updated_at) VALUES ('*', '*', 10.0, 0.8, 'iso_week', NULL, 86400, '', :at)"
                ),
                {"at": stamp},
            )
            for key, spend, releases, open_count in (
                (alice, (0.0, None, 0.0), 0, 2),
                (bob, committed, 1, 1),
            ):
                run(
                    sa.text(
                        'INSERT INTO dp_accounts (tenant, subject, query_type, "window", rho, '
                        "residual, gaussian_mu2, releases, open_reservations, updated_at) "
                        "VALUES (:tenant, :subject, :query_type, :window, :rho, NULL, :mu2, "
                        ":releases, :open, :at)"
                    ),
                    {
                        **key.as_dict(),
                        "rho": spend[0],
                        "mu2": spend[2],
                        "releases": releases,
                        "open": open_count,
                        "at": stamp,
                    },
                )
            for rid, (state, mechanism, count, keys) in reservations.items():
                rho, residual, mu2 = cost_of(mechanism, count)
                run(
                    sa.text(
                        "INSERT INTO dp_reservations (id, attempt_id, state, mechanism, count, "
                        "cost_rho, cost_residual, cost_gaussian_mu2, key_count, keys_digest, "
                        "prospective_epsilon, actor, created_at, resolved_at) VALUES (:id, "
                        ":attempt, :state, :mechanism, :count, :rho, :residual, :mu2, "
                        ":key_count, :digest, 0.5, 'test', :at, :resolved)"
                    ),
                    {
                        "id": rid,
                        "attempt": f"attempt-{rid}",
                        "state": state,
                        "mechanism": history.canonical_json(mechanism.to_spec()),
                        "count": count,
                        "rho": rho,
                        "residual": None if residual is None else json.dumps(residual.tolist()),
                        "mu2": mu2,
                        "key_count": len(keys),
                        "digest": history.keys_digest(keys),
                        "at": stamp,
                        "resolved": None if state == "open" else stamp,
                    },
                )
                for position, key in enumerate(keys):
                    run(
                        sa.text(
                            "INSERT INTO dp_reservation_keys (reservation_id, position, tenant, "
                            'subject, query_type, "window") VALUES (:rid, :position, :tenant, '
                            ":subject, :query_type, :window)"
                        ),
                        {"rid": rid, "position": position, **key.as_dict()},
                    )
    finally:
        engine.dispose()
    return {
        rid: (keys, cost_of(mechanism, count))
        for rid, (state, mechanism, count, keys) in reservations.items()
        if state == "open"
    }


def test_migration_0002_backfills_pending_and_round_trips(blank_ledger_url, make_ledger):
    """Upgrading a 0001 ledger with open reservations sums their costs (not those of closed
    ones) into each account's pending columns (mu^2 of the Gaussian ones, a count of the
    others) and starts policy_version at 0; on PostgreSQL only the policy version's trigger
    function remains (0005 and 0006 removed the server-side commit and append).
    Downgrading to 0001 removes all of it and upgrading again backfills the same values;
    the upgraded ledger then counts them and clears them as the reservations close.
    Reservations made before revision 0005 carry no token: nobody can release them, so
    they are charged (reaped), never refunded.
    """
    ledger_url = blank_ledger_url
    postgresql = ledger_url.startswith("postgresql")
    migrate(ledger_url, "upgrade", "0001")
    assert "pending_rho" not in columns_of(ledger_url, "dp_accounts")
    open_costs = seed_revision_0001(ledger_url)
    (alice, bob), gauss = open_costs["r-gauss-open"]
    _, laplace = open_costs["r-laplace-open"]

    def check_backfill() -> None:
        """The backfilled pending spend; the one server function left (links are made in
        the client since revision 0006) is the policy version's trigger."""
        rows = accounts(ledger_url)
        # alice: the Gaussian's mu^2 summed and the Laplace counted; bob: the Gaussian only
        # (its committed and released reservations are not pending).
        assert_pending(rows[_parts(alice)], pending_of(gauss, laplace))
        assert rows[_parts(alice)]["pending_others"] == 1
        assert rows[_parts(alice)]["pending_mu2"] == gauss[2]
        assert_pending(rows[_parts(bob)], pending_of(gauss))
        assert rows[_parts(bob)]["pending_residual"] is None
        assert scalar(ledger_url, "SELECT policy_version FROM dp_ledger_config") == 0
        if postgresql:
            assert server_functions(ledger_url) == {"dp_bump_policy_version"}

    migrate(ledger_url, "upgrade", "head")
    check_backfill()

    migrate(ledger_url, "downgrade", "0001")
    assert {"pending_rho", "pending_residual", "pending_mu2", "pending_others"}.isdisjoint(
        columns_of(ledger_url, "dp_accounts")
    )
    assert "policy_version" not in columns_of(ledger_url, "dp_ledger_config")
    if postgresql:
        assert server_functions(ledger_url) == set()

    migrate(ledger_url, "upgrade", "head")
    check_backfill()

    ledger = make_ledger(url=ledger_url)
    assert ledger.prospective_epsilon(alice, GAUSS) == pytest.approx(
        epsilon_of_releases((GAUSS, 2), (LAPLACE, 1), (GAUSS, 1)), rel=1e-12
    )
    # Neither an id nor a Reservation read back (no token) releases a pre-0005 reservation.
    (legacy,) = [r for r in ledger.open_reservations() if r.id == "r-laplace-open"]
    with pytest.raises(ReservationStateError, match="only the attempt that reserved"):
        ledger.release(legacy, reason="test: data never touched")
    # Reaped, the open ones are charged and leave the pending columns exactly empty.
    assert sorted(ledger.reap(timedelta(0))) == ["r-gauss-open", "r-laplace-open"]
    # Held spend became committed spend: the prospective check is unchanged.
    assert ledger.prospective_epsilon(alice, GAUSS) == pytest.approx(
        epsilon_of_releases((GAUSS, 2), (LAPLACE, 1), (GAUSS, 1)), rel=1e-12
    )
    assert ledger.epsilon_of(alice) == pytest.approx(
        epsilon_of_releases((GAUSS, 2), (LAPLACE, 1)), rel=1e-12
    )
    assert_nothing_pending(account(ledger_url, alice))
    assert_nothing_pending(account(ledger_url, bob))
    if postgresql:  # the trigger bumps the version on any change to a policy row
        execute(ledger_url, "UPDATE dp_policies SET compliance_clause = 'changed'")
        assert scalar(ledger_url, "SELECT policy_version FROM dp_ledger_config") > 0


# ---------------------------------------------------------------- 7. concurrency smoke


def test_processes_on_overlapping_key_sets_stay_under_the_cap_and_clear_pending(
    postgres_url, make_ledger
):
    """Six OS processes reserving and committing (or releasing) random overlapping
    multi-key sets on PostgreSQL until the cap refuses them: afterwards no account is past
    its cap, every pending column is exactly zero, nothing is open, and verify() is ok.
    """
    cap = 2.0
    ledger = make_ledger(BudgetCap(cap, DELTA), url=postgres_url)
    subjects = [f"subject-{i:02d}" for i in range(12)]  # multi_key draws up to 12 keys
    reports = run_workers(
        workers.multi_key, [(postgres_url, subjects, seed, 15) for seed in range(6)], timeout=60
    )

    assert [r["error"] for r in reports if r["error"]] == []
    assert any(r["refused"] for r in reports), "the cap was meant to stop the workers"
    outcomes = [i["outcome"] for r in reports for i in r["reserved"].values()]
    assert "commit" in outcomes and set(outcomes) <= {"commit", "release"}

    rows = accounts(postgres_url)
    assert rows
    for (tenant, subject, query_type, window), row in rows.items():
        assert_nothing_pending(row)
        epsilon = ledger.epsilon_of(key_for(subject, query_type, window, tenant=tenant))
        assert epsilon <= cap
    assert ledger.open_reservations() == []
    report = ledger.verify()
    assert report.ok, report.problems
