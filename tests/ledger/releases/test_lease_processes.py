"""Leases across real OS processes (SQLite and PostgreSQL): a worker SIGKILLed while it
works on the data is charged by the first reap after its lease runs out; a worker that
keeps renewing is never reaped, however long it works.

Workers are spawned processes (``concurrency_workers.reserve_and_keep_alive``) renewing
from a daemon thread, as the release operator does while its callable runs.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest

from dp_budget_provider.accounting import GaussianMechanism, RDPAccountant
from dp_budget_provider.ledger import BudgetCap, key_for
from tests.ledger import concurrency_workers as workers
from tests.ledger.releases.test_concurrency import _stop, kill, start_worker
from tests.ledger_time import this_week

CAP = BudgetCap(epsilon=3.0, delta=1e-5)
DYING_LEASE = 1.5  # seconds: renewed every 0.5 s
LIVING_LEASE = 3.0  # renewed every second; reaped only if it missed two renewals running
REAP_DEADLINE = 20.0


def cost_epsilon(z: float) -> float:
    accountant = RDPAccountant()
    accountant.compose(GaussianMechanism(z))
    return accountant.get_epsilon(CAP.delta)[0]


def test_a_killed_worker_is_reaped_after_its_lease_and_a_renewing_one_never(
    ledger_url, make_ledger
):
    ledger = make_ledger(CAP, url=ledger_url)
    week = this_week()  # the workers' (real) clock
    dying_key = key_for("dying", "heatmap", week)
    living_key = key_for("living", "heatmap", week)
    dying, dying_said = start_worker(
        workers.reserve_and_keep_alive, (ledger_url, [dying_key], 4.0, DYING_LEASE)
    )
    living, living_said = start_worker(
        workers.reserve_and_keep_alive, (ledger_url, [living_key], 4.0, LIVING_LEASE)
    )
    try:
        reports = [dying_said.get(timeout=120), living_said.get(timeout=120)]
        assert [r["error"] for r in reports] == [None, None], reports
        dying_id, living_id = (r["reservation_id"] for r in reports)
        first = {r.id: r.lease_expires_at for r in ledger.open_reservations()}
        started = time.monotonic()

        time.sleep(LIVING_LEASE + 0.3)  # past both first leases: alive, so renewed
        assert ledger.reap() == []
        renewed = {r.id: r.lease_expires_at for r in ledger.open_reservations()}
        assert all(renewed[rid] > first[rid] for rid in (dying_id, living_id)), (first, renewed)

        kill(dying)  # mid-task: no finally, no commit
        killed = time.monotonic()
        reaped: list[str] = []
        while not reaped:
            assert time.monotonic() - killed < REAP_DEADLINE, "the dead worker was never reaped"
            time.sleep(0.2)
            reaped = ledger.reap()
        assert reaped == [dying_id]
        assert time.monotonic() - killed >= DYING_LEASE / 3  # not before its last renewal ran out
        assert ledger.epsilon_of(dying_key) == pytest.approx(cost_epsilon(4.0), rel=1e-9)
        payload = ledger.history()[-1]["payload"]
        assert "its lease ran out at" in payload["reason"]

        # The living worker outlived its lease twice over and is still open, renewing.
        while time.monotonic() - started < 2 * LIVING_LEASE:
            time.sleep(0.2)
        assert ledger.reap() == []
        assert [r.id for r in ledger.open_reservations()] == [living_id]
        assert ledger.epsilon_of(living_key) == 0.0

        kill(living)  # then reap as of one lease later, without waiting for it
        later = datetime.now(timezone.utc) + timedelta(seconds=LIVING_LEASE + 0.1)
        assert ledger.reap(now=later) == [living_id]
        assert ledger.epsilon_of(living_key) == pytest.approx(cost_epsilon(4.0), rel=1e-9)
        assert ledger.open_reservations() == []
        report = ledger.verify()
        assert report.ok, report.problems
    finally:
        for process in (dying, living):
            if process.is_alive():
                process.kill()
        _stop([dying, living])
