"""Reservations decided by PostgreSQL (``dp_reserve``) against the client's exact check.

The server accepts a single-key release of a Gaussian or zCDP cost when the prospective
rho or mu^2 is within limits derived from the cap (``server_check``); everything else
comes back undecided and the client decides. These tests check that the two never
disagree: the same releases are accepted and refused as on SQLite (where the client
always decides), a refusal near the cap writes nothing, the recorded prospective spend
converts to the epsilon the client computes, and the limits themselves are sound.
Expected epsilons come from ``RDPAccountant``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from dp_budget_provider.accounting import (
    DEFAULT_ORDERS,
    GaussianMechanism,
    LaplaceMechanism,
    RDPAccountant,
    ZCDPMechanism,
    gaussian_epsilon,
)
from dp_budget_provider.ledger import (
    BudgetCap,
    BudgetExhausted,
    LedgerCorrupt,
    Policy,
    key_for,
    report,
)
from dp_budget_provider.ledger.server_check import MARGIN, CapLimits, largest_within
from dp_budget_provider.ledger.spend import Spend
from tests.ledger.test_pending_and_server_paths import execute, scalar, snapshot

DELTA = 1e-5
WINDOW = "2026-11"
ORDERS = np.asarray(DEFAULT_ORDERS, dtype=np.float64)
GAUSS = GaussianMechanism(3.0)


def epsilon_after(*releases: Any) -> float:
    accountant = RDPAccountant(ORDERS)
    for mechanism, count in releases:
        accountant.compose(mechanism, count)
    return accountant.get_epsilon(DELTA)[0]


def decided_by_server(url: str) -> int:
    return scalar(url, "SELECT count(*) FROM dp_reservations WHERE prospective_epsilon IS NULL")


@pytest.mark.parametrize("conversion", ["improved", "classic"])
@pytest.mark.parametrize("cap", [0.5, 1.0, 3.0, 10.0, 1e3, 1e9])
def test_limits_are_within_the_cap_and_tight(conversion, cap):
    limits = CapLimits(ORDERS, DELTA, conversion)
    rho_limit, mu2_limit = limits.of(cap)
    rdp = Spend(rho_limit, None, None).epsilon(ORDERS, DELTA, conversion).epsilon
    assert rdp <= cap * (1 - MARGIN)
    above = Spend(rho_limit * (1 + 1e-6), None, None).epsilon(ORDERS, DELTA, conversion).epsilon
    assert above > cap * (1 - MARGIN)  # the limit is the largest, up to bisection
    if conversion == "classic":
        assert mu2_limit is None
        return
    assert mu2_limit is not None
    assert gaussian_epsilon(mu2_limit**0.5, DELTA) <= cap * (1 - MARGIN)
    assert gaussian_epsilon((mu2_limit * (1 + 1e-6)) ** 0.5, DELTA) > cap * (1 - MARGIN)
    # A Gaussian-only account at either limit reports at most the cap (min of the two).
    for rho, mu2 in ((rho_limit, rho_limit * 2), (mu2_limit / 2, mu2_limit)):
        bound = Spend(rho, None, mu2).epsilon(ORDERS, DELTA, conversion).epsilon
        assert bound <= cap


def test_largest_within_errs_low_on_errors_and_tiny_targets_from_any_estimate():
    assert largest_within(lambda x: x, 0.0) == 0.0
    assert largest_within(lambda x: math.sqrt(-1.0) if x > 1.0 else x, 10.0) <= 1.0
    for target, estimate in ((1.0, 1.0), (1.0, 1e-9), (1.0, 1e9), (3e5, 0.1)):
        found = largest_within(lambda x: 2 * x, target, estimate)
        assert target / 2 * (1 - 1e-11) <= found <= target / 2


def test_single_gaussian_releases_are_decided_by_the_server_and_convert_exactly(
    postgres_url, make_ledger
):
    make_ledger(BudgetCap(10.0, DELTA), url=postgres_url)
    ledger = make_ledger(url=postgres_url)  # as a task opens it: the policies are known
    key = key_for("alice", "heatmap", WINDOW)
    other = ledger.reserve(key, GAUSS)
    reservation = ledger.reserve(key, GAUSS, count=2)
    assert decided_by_server(postgres_url) == 2
    assert reservation.prospective_epsilon == epsilon_after((GAUSS, 3))
    zcdp = ledger.reserve(key_for("bob", "heatmap", WINDOW), ZCDPMechanism(0.01))
    assert decided_by_server(postgres_url) == 3
    assert zcdp.prospective_epsilon == epsilon_after((ZCDPMechanism(0.01), 1))
    # Read back (listing, idempotent retry, report), the recorded spend converts the same.
    listed = {r.id: r.prospective_epsilon for r in ledger.open_reservations()}
    assert listed[reservation.id] == reservation.prospective_epsilon
    again = ledger.reserve(key, GAUSS, count=2, attempt=reservation.attempt_id)
    assert again.prospective_epsilon == reservation.prospective_epsilon
    schedule = report.build_report(ledger)["schedule"]
    reserved = {
        r["reservation_id"]: r["prospective_epsilon"] for r in schedule if r["action"] == "reserve"
    }
    assert reserved[reservation.id] == reservation.prospective_epsilon
    ledger.commit(reservation)
    ledger.commit(other)
    ledger.commit(zcdp)
    assert ledger.epsilon_of(key) == epsilon_after((GAUSS, 3))
    assert ledger.verify().ok


@pytest.mark.parametrize("mechanism", [GAUSS, ZCDPMechanism(0.2)], ids=["gaussian", "zcdp"])
def test_near_the_cap_the_client_decides_and_a_refusal_writes_nothing(
    postgres_url, make_ledger, mechanism
):
    """Caps placed exactly at, just above and just below the epsilon of three releases:
    the third is accepted exactly when the accountant says it fits, whoever decides."""
    ledger = make_ledger(BudgetCap(100.0, DELTA), url=postgres_url)
    three = epsilon_after((mechanism, 3))
    for index, (cap, fits) in enumerate(
        [(three, True), (three * (1 + 1e-12), True), (three * (1 - 1e-12), False)]
    ):
        key = key_for(f"subject-{index}", "heatmap", WINDOW)
        ledger.set_policy(Policy(cap_epsilon=cap, query_type="heatmap"))
        ledger.reserve(key, mechanism, count=2)
        before = snapshot(postgres_url)
        if fits:
            assert ledger.reserve(key, mechanism).prospective_epsilon == three
        else:
            with pytest.raises(BudgetExhausted):
                ledger.reserve(key, mechanism)
            assert snapshot(postgres_url) == before
    assert ledger.verify().ok


def test_a_policy_changed_behind_the_ledgers_back_is_honoured(postgres_url, make_ledger):
    """The cap is lowered in plain SQL: the server sees a new policy version, leaves the
    decision to the client, which reads the new cap and refuses."""
    make_ledger(BudgetCap(10.0, DELTA), url=postgres_url)
    ledger = make_ledger(url=postgres_url)
    key = key_for("alice", "heatmap", WINDOW)
    ledger.reserve(key, GAUSS)
    assert decided_by_server(postgres_url) == 1
    execute(postgres_url, "UPDATE dp_policies SET cap_epsilon = 0.01")
    before = snapshot(postgres_url)
    with pytest.raises(BudgetExhausted):
        ledger.reserve(key, GAUSS)
    assert snapshot(postgres_url) == before


def test_an_account_with_a_residual_curve_is_left_to_the_client(postgres_url, make_ledger):
    ledger = make_ledger(BudgetCap(10.0, DELTA), url=postgres_url)
    key = key_for("alice", "heatmap", WINDOW)
    ledger.spend(key, LaplaceMechanism(1.0))  # a residual curve: the client decides
    assert decided_by_server(postgres_url) == 0
    reservation = ledger.reserve(key, GAUSS)
    assert decided_by_server(postgres_url) == 0
    assert reservation.prospective_epsilon == epsilon_after((LaplaceMechanism(1.0), 1), (GAUSS, 1))
    ledger.reserve([key, key_for("bob", "heatmap", WINDOW)], GAUSS)  # many keys: client
    assert decided_by_server(postgres_url) == 0
    assert ledger.verify().ok


def test_only_the_commit_skips_waiting_for_the_disk(postgres_url, make_ledger):
    """dp_commit commits asynchronously (a lost commit leaves a counted, reapable
    reservation); the setting is local to its transaction, so the next reservation on the
    same pooled connection waits for the disk again."""
    make_ledger(BudgetCap(10.0, DELTA), url=postgres_url)
    ledger = make_ledger(url=postgres_url)
    key = key_for("alice", "heatmap", WINDOW)
    ledger.commit(ledger.reserve(key, GAUSS))
    with ledger._engine.connect() as connection:  # the pool's one connection
        assert connection.exec_driver_sql("SHOW synchronous_commit").scalar() == "on"
        connection.exec_driver_sql("BEGIN")
        connection.exec_driver_sql(
            "SELECT set_config('synchronous_commit', 'off', true)"
        )  # what dp_commit does, to show the probe sees a transaction-local change
        assert connection.exec_driver_sql("SHOW synchronous_commit").scalar() == "off"
        connection.exec_driver_sql("ROLLBACK")
        assert connection.exec_driver_sql("SHOW synchronous_commit").scalar() == "on"
    source = scalar(postgres_url, "SELECT prosrc FROM pg_proc WHERE proname = 'dp_commit'")
    assert "set_config('synchronous_commit', 'off', true)" in source
    reserve_source = scalar(postgres_url, "SELECT prosrc FROM pg_proc WHERE proname = 'dp_reserve'")
    assert "synchronous_commit" not in reserve_source


@pytest.mark.parametrize(
    "tampering",
    [
        "rho = -1",
        "rho = 'NaN'",
        "rho = 'Infinity'",
        "pending_rho = -0.5",
        "gaussian_mu2 = 'NaN'",
        "gaussian_mu2 = -1",
        "pending_mu2 = 'Infinity'",
        "pending_others = -1",
    ],
)
def test_a_corrupt_account_is_never_decided_by_the_server(postgres_url, make_ledger, tampering):
    """Values edited in SQL that the client refuses as corrupt (negative, NaN, infinite)
    must not pass the server's limits: the reservation fails closed, writing nothing."""
    make_ledger(BudgetCap(10.0, DELTA), url=postgres_url)
    ledger = make_ledger(url=postgres_url)
    key = key_for("alice", "heatmap", WINDOW)
    ledger.commit(ledger.reserve(key, GAUSS))
    assert decided_by_server(postgres_url) == 1
    execute(postgres_url, f"UPDATE dp_accounts SET {tampering}")
    before = snapshot(postgres_url)
    with pytest.raises(LedgerCorrupt):
        ledger.reserve(key, GAUSS)
    assert repr(snapshot(postgres_url)) == repr(before)  # repr: NaN != NaN
