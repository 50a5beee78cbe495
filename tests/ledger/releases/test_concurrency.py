"""The ledger under real concurrency, crashes and database faults.

Every competing worker is a separate OS process (entry points in
``concurrency_workers.py``) with its own ledger object and connections, as Airflow
workers on different machines would be. They start from a fork server that imported
those entry points once and never opened a ledger: each worker is a fresh fork of it,
sharing nothing with the test or with the other workers. Threads would share one interpreter and
would not show what the ledger promises: that the prospective check and the
reservation are atomic across processes, that multi-key reservations lock in one
order (no deadlock) and are all-or-nothing, that a killed worker's reservation stays
counted until reaped, and that a connection killed mid-transaction leaves nothing
half-written (fail closed).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import queue
import signal
import sqlite3
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import numpy as np
import psycopg2
import pytest
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url

from dp_budget_provider.accounting import GaussianMechanism, RDPAccountant
from dp_budget_provider.ledger import (
    AttemptReused,
    BudgetCap,
    BudgetExhausted,
    LedgerError,
    LedgerUnavailable,
    Policy,
    PrivacyBudgetLedger,
    WindowCalendar,
    key_for,
)
from dp_budget_provider.ledger.windows.policy import ACROSS_QUERY_TYPES
from tests.admin import AdminLedger
from tests.ledger import concurrency_workers as workers
from tests.ledger.checked import checked_epsilon
from tests.ledger.memberships_sql import MEMBERS
from tests.ledger_time import inside, ledger_time_in, this_week
from tests.scratch_postgres import scratch_database

# Over 20 s in all: scheduled before the light files (tests/conftest.py).
pytestmark = pytest.mark.heavy

CAP = BudgetCap(epsilon=3.0, delta=1e-5)
PROCESSES = 8
WINDOW = this_week()  # the workers run on the real clock (tests/ledger_time.py)
FORKSERVER = multiprocessing.get_context("forkserver")
FORKSERVER.set_forkserver_preload([workers.__name__])
LEDGER_APP = "dp-budget-ledger"


# ---------------------------------------------------------------------------- helpers


@functools.cache
def reference_epsilon(z: float, releases: int) -> float:
    """What RDPAccountant reports for ``releases`` Gaussian(z) releases at the cap's delta."""
    if releases == 0:
        return 0.0
    accountant = RDPAccountant()
    accountant.compose(GaussianMechanism(z), releases)
    return accountant.get_epsilon(CAP.delta)[0]


@functools.cache
def checked(z: float, releases: int) -> float:
    """What the cap check counts for ``releases`` Gaussian(z) releases (tests/ledger/checked.py)."""
    return checked_epsilon(CAP.epsilon, CAP.delta, (GaussianMechanism(z), releases))


@functools.cache
def max_fit(z: float) -> int:
    """How many Gaussian(z) releases fit under the cap."""
    releases = 0
    while checked(z, releases + 1) <= CAP.epsilon:
        releases += 1
    return releases


def run_workers(target: Any, argument_lists: list[tuple], timeout: float) -> list[dict]:
    """Start one spawned process per argument tuple (plus a shared barrier and result queue).

    Fails the test if any worker has not reported within ``timeout`` seconds: with
    correct lock ordering nothing can wait forever.
    """
    results = FORKSERVER.Queue()
    barrier = FORKSERVER.Barrier(len(argument_lists))
    processes = [
        FORKSERVER.Process(target=target, args=(*arguments, barrier, results), daemon=True)
        for arguments in argument_lists
    ]
    for process in processes:
        process.start()
    reports: list[dict] = []
    deadline = time.monotonic() + timeout
    try:
        while len(reports) < len(processes):
            try:
                reports.append(results.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                pytest.fail(
                    f"only {len(reports)} of {len(processes)} workers finished within "
                    f"{timeout} s: a deadlock or a hang"
                )
    finally:
        _stop(processes)
    return reports


def start_worker(target: Any, arguments: tuple) -> tuple[Any, Any]:
    """Start one spawned worker reporting through its own queue."""
    results = FORKSERVER.Queue()
    process = FORKSERVER.Process(target=target, args=(*arguments, results), daemon=True)
    process.start()
    return process, results


def _stop(processes: list[Any]) -> None:
    for process in processes:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
            process.join()


_ACCOUNT_VALUES = "rho, residual, gaussian_mu2, releases, open_reservations, size"


def _rows(url: str, statement: str) -> list[Any]:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return list(connection.execute(text(statement)))
    finally:
        engine.dispose()


def raw_accounts(url: str) -> list[Any]:
    """The account rows exactly as stored (what verify() replays the history against):
    one per spend class, its ``subject`` the class's label."""
    return _rows(
        url, f'SELECT subject, {_ACCOUNT_VALUES} FROM dp_accounts ORDER BY subject, "window"'
    )


def subject_accounts(url: str) -> list[Any]:
    """Each subject's account row as stored, read through its membership (``subject`` is
    the subject, ``account`` its class's label), by subject."""
    return _rows(
        url,
        "SELECT m.subject, m.account, "
        + ", ".join(f"a.{column.strip()}" for column in _ACCOUNT_VALUES.split(","))
        + f" FROM {MEMBERS} m JOIN dp_accounts a ON a.tenant = m.tenant "
        'AND a.query_type = m.query_type AND a."window" = m."window" '
        'AND a.subject = m.account ORDER BY m.subject, m."window"',
    )


# Every table a charge writes: its accounts and their classes' memberships, the cohorts
# it registers and lists, the reservation and its keys, the history and its links.
CHARGED_TABLES = (
    "dp_accounts",
    "dp_members",
    "dp_cohorts",
    "dp_cohort_members",
    "dp_cohort_accounts",
    "dp_charge_cohorts",
    "dp_reservations",
    "dp_reservation_keys",
    "dp_history",
)


def table_counts(url: str) -> dict[str, int]:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return {
                table: connection.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
                for table in CHARGED_TABLES
            }
    finally:
        engine.dispose()


def assert_replay_within_cap(entries: list[dict], keys_of: dict[str, list[str]], z: float) -> None:
    """Replay the history in order: at every reserve, committed + open <= what fits.

    History entries are appended in commit order and accounts are locked until commit,
    so the replayed state at a reserve entry is exactly what the reservation saw: its
    recorded prospective epsilon must be the reference epsilon of that state (every
    reservation is decided in Python; no server-side reserve exists to record it otherwise).
    """
    fit = max_fit(z)
    committed: Counter[str] = Counter()
    holding: Counter[str] = Counter()
    for entry in entries:
        action, reservation_id = entry["action"], entry["reservation_id"]
        if action not in ("reserve", "commit", "release", "reap"):
            continue
        subjects = keys_of[reservation_id]
        if action == "reserve":
            for subject in subjects:
                holding[subject] += 1
            worst = max(committed[s] + holding[s] for s in subjects)
            assert worst <= fit, f"entry {entry['seq']}: {worst} releases held, only {fit} fit"
            payload = entry["payload"]
            assert payload["prospective_epsilon"] == pytest.approx(
                reference_epsilon(z, worst), rel=1e-9
            ), f"entry {entry['seq']}: the reservation did not see every other one"
        else:
            for subject in subjects:
                holding[subject] -= 1
                if action != "release":
                    committed[subject] += 1
                assert committed[subject] <= fit
    assert all(count == 0 for count in holding.values()), "reservations left open"


@contextlib.contextmanager
def pg_session(url: str, *, autocommit: bool = True) -> Iterator[Any]:
    """A plain psycopg2 session on the ledger's database (not the ledger's application name)."""
    parsed = make_url(url)
    connection = psycopg2.connect(
        host=parsed.host,
        port=parsed.port,
        user=parsed.username,
        dbname=parsed.database,
        application_name="dp-budget-test",
    )
    connection.autocommit = autocommit
    try:
        yield connection
    finally:
        connection.close()


def wait_for_backend(session: Any, database: str, condition: str, timeout: float = 30) -> int:
    """The pid of the one ledger backend of ``database`` matching ``condition``."""
    deadline = time.monotonic() + timeout
    with session.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = %s AND application_name = %s"
                f" AND ({condition})",
                (database, LEDGER_APP),
            )
            pids = [row[0] for row in cursor.fetchall()]
            if len(pids) == 1:
                return pids[0]
            assert len(pids) < 2, f"several ledger backends match {condition!r}: {pids}"
            time.sleep(0.002)
    pytest.fail(f"no ledger backend of {database} reached {condition!r} within {timeout} s")


def wait_for_lock_waiters(session: Any, database: str, count: int, timeout: float = 30) -> None:
    """Return once ``count`` ledger backends of ``database`` wait for a lock."""
    deadline = time.monotonic() + timeout
    with session.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
                " AND application_name = %s AND wait_event_type = 'Lock'",
                (database, LEDGER_APP),
            )
            if cursor.fetchone()[0] == count:
                return
            time.sleep(0.005)
    pytest.fail(f"{count} ledger backends of {database} did not all wait within {timeout} s")


def lock_waiters(session: Any, database: str) -> list[int]:
    """The pids of the ledger backends of ``database`` waiting for a lock."""
    with session.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND application_name = %s"
            " AND wait_event_type = 'Lock' ORDER BY pid",
            (database, LEDGER_APP),
        )
        return [row[0] for row in cursor.fetchall()]


def wait_until_no_ledger_backend(session: Any, database: str, timeout: float = 30) -> None:
    """Wait until the server has noticed every dead ledger client (and rolled it back)."""
    deadline = time.monotonic() + timeout
    with session.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = %s AND application_name = %s",
                (database, LEDGER_APP),
            )
            if cursor.fetchone()[0] == 0:
                return
            time.sleep(0.01)
    pytest.fail(f"ledger backends of {database} still alive after {timeout} s")


def queued_on(session: Any, pid: int) -> list[str]:
    """The tables whose rows backend ``pid`` queues for: PostgreSQL takes a tuple lock on
    a row it waits to lock (granted while it is first in line, else waiting for it)."""
    with session.cursor() as cursor:
        cursor.execute(
            "SELECT relation::regclass::text FROM pg_locks WHERE pid = %s AND locktype = 'tuple'",
            (pid,),
        )
        return [row[0] for row in cursor.fetchall()]


def waiting_statement(session: Any, pid: int) -> str:
    """The start of the statement (or pipelined batch) backend ``pid`` is running (the
    server keeps only its first ``track_activity_query_size`` bytes)."""
    with session.cursor() as cursor:
        cursor.execute("SELECT query FROM pg_stat_activity WHERE pid = %s", (pid,))
        return cursor.fetchone()[0]


def pg_snapshot(url: str) -> dict[str, list[tuple]]:
    """Every ledger table, row by row, in a fixed order."""
    order = {
        "dp_accounts": "id",
        "dp_members": 'tenant, query_type, "window", subject',
        "dp_cohorts": "id",
        "dp_cohort_members": "cohort_id, subject",
        "dp_cohort_accounts": 'cohort_id, query_type, "window", account',
        "dp_charge_cohorts": 'seq, cohort_id, query_type, "window"',
        "dp_windows": 'tenant, query_type, "window"',
        "dp_reservations": "id",
        "dp_reservation_keys": "reservation_id, position",
        "dp_history": "seq",
        "dp_chain_head": "id",
        "dp_policies": "id",
        "dp_ledger_config": "id",
    }
    with pg_session(url) as session, session.cursor() as cursor:
        snapshot = {}
        for table, columns in order.items():
            cursor.execute(f"SELECT * FROM {table} ORDER BY {columns}")
            snapshot[table] = cursor.fetchall()
        return snapshot


def expect_ready(results: Any, process: Any, timeout: float = 60) -> None:
    message = results.get(timeout=timeout)
    assert message.get("ready"), f"worker failed before its operation: {message}"
    assert process.is_alive()


def kill(process: Any) -> None:
    """SIGKILL: no atexit, no finally, no rollback from the client side."""
    os.kill(process.pid, signal.SIGKILL)
    process.join(timeout=30)
    assert process.exitcode == -signal.SIGKILL


# ---------------------------------------------------------------------------- races


@pytest.mark.parametrize(
    ("mode", "z"),
    [("spend", 4.0), ("reserve-commit", 12.0)],  # a few releases fit; many fit
    ids=["spend-z4-8fit", "reserve-commit-z12-75fit"],
)
def test_processes_racing_on_one_key_never_pass_the_cap(ledger_url, mode, z):
    ledger = PrivacyBudgetLedger(cap=CAP, url=ledger_url)
    key = key_for("alice", "count", WINDOW)
    fit = max_fit(z)

    reports = run_workers(workers.race, [(ledger_url, key, z, mode)] * PROCESSES, timeout=150)

    assert [r["error"] for r in reports if r["error"]] == []
    receipts = sorted(eps for report in reports for eps in report["receipts"])
    # Each worker stopped only when refused, and a refusal means the cap really was reached.
    assert all(report["refused"] > CAP.epsilon for report in reports)
    # Commits are serialised: the receipts are exactly eps(1), ..., eps(n), no repeats
    # (a lost update would show two receipts of the same epsilon).
    assert len(receipts) == fit
    assert receipts == pytest.approx([reference_epsilon(z, k) for k in range(1, fit + 1)], rel=1e-9)
    assert receipts[-1] <= CAP.epsilon

    entries = ledger.history()
    commits = [entry for entry in entries if entry["action"] == "commit"]
    assert len(commits) == len(receipts)
    assert ledger.epsilon_of(key) == pytest.approx(reference_epsilon(z, fit), rel=1e-9)
    assert_replay_within_cap(entries, {e["reservation_id"]: ["alice"] for e in entries}, z)

    report = ledger.verify()
    assert report.ok, report.problems
    # The history's costs, summed by hand, are the account's stored curve.
    (row,) = raw_accounts(ledger_url)
    costs = [entry["payload"]["cost"] for entry in commits]
    assert all(cost["residual"] is None for cost in costs)
    assert row.residual is None
    assert row.rho == pytest.approx(sum(cost["rho"] for cost in costs), rel=1e-12)
    assert row.gaussian_mu2 == pytest.approx(sum(c["gaussian_mu2"] for c in costs), rel=1e-12)
    assert (row.releases, row.open_reservations) == (fit, 0)
    reference = RDPAccountant(ledger.orders)
    reference.compose(GaussianMechanism(z), fit)
    np.testing.assert_allclose(row.rho * ledger.orders, reference.rdp, rtol=1e-9)
    assert row.gaussian_mu2 == pytest.approx(reference.gaussian_mu_squared, rel=1e-12)
    ledger.close()


def test_overlapping_multi_key_reservations_neither_deadlock_nor_leak(ledger_url):
    ledger = PrivacyBudgetLedger(cap=CAP, url=ledger_url)
    subjects = [f"subject-{i:02d}" for i in range(50)]
    rounds = 25

    reports = run_workers(
        functools.partial(workers.multi_key, window=WINDOW),
        [(ledger_url, subjects, seed, rounds) for seed in range(PROCESSES)],
        timeout=150,
    )

    assert [r["error"] for r in reports if r["error"]] == []
    reserved = {rid: info for report in reports for rid, info in report["reserved"].items()}
    refused = [refusal for report in reports for refusal in report["refused"]]
    assert len(reserved) + len(refused) == PROCESSES * rounds
    assert refused, "the scenario is meant to exhaust budgets"
    assert any(info["outcome"] == "commit" for info in reserved.values())
    assert all(info["outcome"] in ("commit", "release") for info in reserved.values())

    entries = ledger.history()
    by_action = {
        action: {e["reservation_id"] for e in entries if e["action"] == action}
        for action in ("reserve", "commit", "release", "reap")
    }
    # All or nothing: a refused reservation left no reserve entry, row or account behind.
    assert by_action["reserve"] == set(reserved)
    assert by_action["commit"] == {r for r, i in reserved.items() if i["outcome"] == "commit"}
    assert by_action["release"] == {r for r, i in reserved.items() if i["outcome"] == "release"}
    assert by_action["reap"] == set()
    assert ledger.open_reservations() == []
    assert table_counts(ledger_url)["dp_reservations"] == len(reserved)

    commits_per_subject = Counter(
        subject
        for info in reserved.values()
        if info["outcome"] == "commit"
        for subject in info["keys"]
    )
    ever_reserved = {subject for info in reserved.values() for subject in info["keys"]}
    # Each subject's class holds exactly the releases committed over it, however the
    # overlapping sets split the classes (and carried open reservations to the new parts).
    rows = subject_accounts(ledger_url)
    assert {row.subject for row in rows} == ever_reserved
    fit = max_fit(4.0)
    for row in rows:
        assert row.open_reservations == 0
        assert row.releases == commits_per_subject[row.subject] <= fit
        epsilon = ledger.epsilon_of(key_for(row.subject, "count", WINDOW))
        assert epsilon == pytest.approx(
            reference_epsilon(4.0, commits_per_subject[row.subject]), rel=1e-9
        )
        assert epsilon <= CAP.epsilon
    # The classes partition the subjects, and the overlaps did split them, carrying
    # open reservations to the new parts.
    members = Counter(row.account for row in rows)
    assert {row.subject: row.size for row in raw_accounts(ledger_url)} == members
    splits = [
        split
        for entry in entries
        if entry["action"] == "reserve"
        for cohort in entry["payload"]["cohorts"]
        if cohort["refined"] is not None
        for split in cohort["refined"]["split"]
    ]
    assert any(carried for *_, carried in splits), "no split carried an open reservation"
    assert any(info["accounts"] > 1 for info in reserved.values())
    # Every refusal named a subject of the refused set.
    assert all(refusal["key"] in refusal["keys"] for refusal in refused)

    assert_replay_within_cap(entries, {rid: info["keys"] for rid, info in reserved.items()}, 4.0)
    report = ledger.verify()
    assert report.ok, report.problems
    ledger.close()


@pytest.mark.parametrize("filtering", [False, True], ids=["refusing", "filtering"])
def test_processes_releasing_under_several_query_types_never_pass_the_cap_across_them(
    ledger_url, filtering
):
    """Eight processes release over overlapping sets of the same subjects under three query
    types; each query type's cap (10) never binds, the cap across them (3) does. No
    subject's total passes it, and each total is exactly its committed releases. With
    ``filtering``, half the releases leave out who cannot afford them instead of being
    refused: the subjects they keep are charged, the others are not."""
    setup = AdminLedger(BudgetCap(10.0, CAP.delta), url=ledger_url)
    setup.set_policy(Policy(CAP.epsilon, across="query_types"))
    setup.close()
    subjects = [f"subject-{i:02d}" for i in range(30)]
    query_types = ["heatmap", "count", "trajectory"]
    rounds = 20

    reports = run_workers(
        workers.across_types,
        [
            (ledger_url, subjects, query_types, WINDOW, seed, rounds, None, filtering)
            for seed in range(PROCESSES)
        ],
        timeout=150,
    )

    assert [r["error"] for r in reports if r["error"]] == []
    reserved = {rid: info for report in reports for rid, info in report["reserved"].items()}
    assert sum(report["refused"] for report in reports) > 0, "meant to exhaust the totals"
    if filtering:
        assert sum(report["left_out"] for report in reports) > 0, "meant to leave some out"
    assert len(reserved) + sum(r["refused"] for r in reports) == PROCESSES * rounds
    committed = Counter(
        subject
        for info in reserved.values()
        if info["outcome"] == "commit"
        for subject in info["keys"]
    )
    by_type = Counter(
        (subject, info["query_type"])
        for info in reserved.values()
        if info["outcome"] == "commit"
        for subject in info["keys"]
    )
    assert len({query_type for _, query_type in by_type}) == 3
    ledger = PrivacyBudgetLedger(url=ledger_url)
    fit = max_fit(4.0)
    for subject in subjects:
        total = ledger.epsilon_of(key_for(subject, ACROSS_QUERY_TYPES, WINDOW))
        assert committed[subject] <= fit
        assert total == pytest.approx(reference_epsilon(4.0, committed[subject]), rel=1e-9)
        assert total <= CAP.epsilon
        for query_type in query_types:
            own = ledger.epsilon_of(key_for(subject, query_type, WINDOW))
            assert own == pytest.approx(
                reference_epsilon(4.0, by_type[subject, query_type]), rel=1e-9
            )
    assert ledger.open_reservations() == []
    report = ledger.verify()
    assert report.ok, report.problems
    ledger.close()


def test_principals_racing_over_the_same_subjects_stay_within_their_shares(ledger_url):
    """Eight processes, four DAGs of each of two principals, release over overlapping
    subjects under three query types; the cap across them (3) is divided 0.6 / 0.4. No
    share account passes its share, no total passes the cap, and each share account is
    exactly its principal's committed releases."""
    from dp_budget_provider.ledger.windows.shares import Share, share_query_type
    from tests.ledger.windows.test_shares import improved_term

    shares = (Share("north", 0.6, ("dag_n",)), Share("south", 0.4, ("dag_s",)))
    setup = AdminLedger(BudgetCap(10.0, CAP.delta), url=ledger_url)
    setup.set_policy(Policy(CAP.epsilon, across="query_types", filter_order="auto", shares=shares))
    policy = setup.policy_for_scope("default", ACROSS_QUERY_TYPES)
    setup.close()
    subjects = [f"subject-{i:02d}" for i in range(12)]
    dags = ["dag_n", "dag_s"]
    reports = run_workers(
        workers.across_types,
        [
            (
                ledger_url,
                subjects,
                ["heatmap", "count", "trajectory"],
                WINDOW,
                seed,
                20,
                dags[seed % 2],
                False,
            )
            for seed in range(PROCESSES)
        ],
        timeout=150,
    )
    assert [r["error"] for r in reports if r["error"]] == []
    assert sum(report["refused"] for report in reports) > 0, "meant to exhaust the shares"
    committed = Counter(
        (subject, report["dag"])
        for report in reports
        for info in report["reserved"].values()
        if info["outcome"] == "commit"
        for subject in info["keys"]
    )
    ledger = PrivacyBudgetLedger(url=ledger_url)
    order = policy.filter_order
    one = order / (2 * 4.0**2)  # a Gaussian(4) release's curve at the filter's order
    for subject in subjects:
        for share, dag in zip(policy.shares, dags, strict=True):
            key = key_for(subject, share_query_type(share.principal, ACROSS_QUERY_TYPES), WINDOW)
            releases = committed[subject, dag]
            # Within its part of the budget: the cap less the conversion's term at the order.
            budget = policy.cap_epsilon - improved_term(order, CAP.delta)
            assert releases * one <= share.fraction * budget
            assert ledger.epsilon_of(key) == pytest.approx(
                reference_epsilon(4.0, releases), rel=1e-9
            )
        assert ledger.epsilon_of(key_for(subject, ACROSS_QUERY_TYPES, WINDOW)) <= CAP.epsilon
    assert ledger.open_reservations() == []
    report = ledger.verify()
    assert report.ok, report.problems
    ledger.close()


def test_a_policy_change_waits_for_a_scopes_first_charge_under_way(ledger_url):
    """A scope's first charge is in flight in another process when the administrator sets
    a filter order for it: the change waits for the charge and is refused (a charged scope
    keeps how its cap is checked), instead of fixing the filter after its first release."""
    admin = AdminLedger(BudgetCap(10.0, CAP.delta), url=ledger_url)
    key = key_for("ann", "heatmap", WINDOW, tenant="acme")
    inside = FORKSERVER.Event()
    process, results = start_worker(workers.slow_first_charge, (ledger_url, key, 3.0, inside))
    try:
        assert inside.wait(60)
        with pytest.raises(LedgerError, match="has been charged"):
            admin.set_policy(Policy(10.0, tenant="acme", query_type="heatmap", filter_order=4.0))
        assert results.get(timeout=60)["error"] is None
    finally:
        _stop([process])
    kept = admin.policy_for_scope("acme", "heatmap")
    assert kept.scope == ("*", "*") and kept.filter_order != 4.0  # the default's own order
    assert admin.verify().ok
    admin.close()


# ---------------------------------------------------------------------------- crashes


def test_reservation_of_a_killed_worker_stays_counted_until_reaped(ledger_url):
    ledger = PrivacyBudgetLedger(cap=CAP, url=ledger_url)
    key = key_for("bob", "count", WINDOW)
    gaussian = GaussianMechanism(4.0)
    fit = max_fit(4.0)
    for _ in range(fit - 1):
        ledger.spend(key, gaussian)
    attempt = f"dag/task/run/-1/1/{uuid.uuid4()}"

    process, results = start_worker(workers.reserve_then_hang, (ledger_url, [key], 4.0, attempt))
    message = results.get(timeout=60)
    assert message["error"] is None, message
    kill(process)

    # Still counted: the last release that fits is taken by the dead worker.
    (held,) = ledger.open_reservations()
    assert (held.id, held.attempt_id, held.keys, held.state) == (
        message["reservation_id"],
        attempt,
        (ledger.account_of(key),),  # bob's class: bob alone
        "open",
    )
    assert ledger.epsilon_of(key) == pytest.approx(reference_epsilon(4.0, fit - 1), rel=1e-9)
    assert ledger.prospective_epsilon(key, gaussian) == pytest.approx(
        reference_epsilon(4.0, fit + 1), rel=1e-9
    )
    assert checked(4.0, fit) <= CAP.epsilon  # it would fit without the reservation
    with pytest.raises(BudgetExhausted) as refusal:
        ledger.spend(key, gaussian)
    assert refusal.value.would_be_epsilon == pytest.approx(checked(4.0, fit + 1), rel=1e-9)
    assert ledger.reap(timedelta(hours=1)) == []  # too young to be presumed dead

    assert ledger.reap(timedelta(0)) == [held.id]

    assert ledger.epsilon_of(key) == pytest.approx(reference_epsilon(4.0, fit), rel=1e-9)
    last = ledger.history()[-1]
    assert (last["action"], last["reservation_id"]) == ("reap", held.id)
    assert "older than" in last["payload"]["reason"]
    assert last["payload"]["attempt_id"] == attempt
    assert ledger.open_reservations() == []
    (account,) = raw_accounts(ledger_url)
    assert (account.releases, account.open_reservations) == (fit, 0)
    report = ledger.verify()
    assert report.ok, report.problems
    with pytest.raises(BudgetExhausted):
        ledger.spend(key, gaussian)
    ledger.close()


def test_worker_killed_inside_a_large_reserve_leaves_all_or_nothing(ledger_url):
    """SIGKILL while the worker's 10^4-key reserve transaction is open."""
    ledger = PrivacyBudgetLedger(cap=CAP, url=ledger_url)
    keys = [key_for(f"s{i:05d}", "count", WINDOW) for i in range(10_000)]
    ledger.spend(keys[5000], GaussianMechanism(4.0))
    ledger.close()
    before = table_counts(ledger_url)
    postgres = make_url(ledger_url).get_backend_name() == "postgresql"

    process, results = start_worker(workers.operation, (ledger_url, "reserve", keys, 4.0, None))
    expect_ready(results, process)
    if postgres:
        with pg_session(ledger_url) as session:
            wait_for_backend(session, make_url(ledger_url).database, "backend_xid IS NOT NULL")
            kill(process)
            wait_until_no_ledger_backend(session, make_url(ledger_url).database)
    else:
        _wait_for_sqlite_writer(make_url(ledger_url).database)
        kill(process)

    ledger = PrivacyBudgetLedger(url=ledger_url)
    after = table_counts(ledger_url)
    held = ledger.open_reservations()
    if held:  # the kill came after COMMIT reached the database: everything is there
        # Two classes: the subject spent on before (kept), and the 9999 new ones.
        assert [set(r.keys) for r in held] == [
            {ledger.account_of(keys[0]), ledger.account_of(keys[5000])}
        ]
        assert after == {
            **before,
            "dp_accounts": before["dp_accounts"] + 1,
            "dp_members": before["dp_members"] + len(keys) - 1,
            "dp_cohorts": before["dp_cohorts"] + 1,
            "dp_cohort_members": before["dp_cohort_members"] + len(keys),
            "dp_cohort_accounts": before["dp_cohort_accounts"] + 2,
            "dp_charge_cohorts": before["dp_charge_cohorts"] + 1,
            "dp_reservations": before["dp_reservations"] + 1,
            "dp_reservation_keys": before["dp_reservation_keys"] + 2,
            "dp_history": before["dp_history"] + 1,
        }
    else:
        assert after == before
    report = ledger.verify()
    assert report.ok, report.problems
    # No lock or half-done row is left to block the next writer.
    assert ledger.spend(keys[0], GaussianMechanism(4.0)).epsilon > 0
    ledger.close()


def _wait_for_sqlite_writer(path: str, timeout: float = 30) -> None:
    """Return once another connection holds the SQLite write lock (its transaction is open)."""
    probe = sqlite3.connect(path, timeout=0, isolation_level=None)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                probe.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as error:
                if "locked" in str(error):
                    return
                raise
            probe.execute("ROLLBACK")
            time.sleep(0.002)
    finally:
        probe.close()
    pytest.fail(f"no writer took the SQLite write lock within {timeout} s")


def test_worker_killed_while_its_commit_waits_leaves_the_reservation_open(ledger_url):
    """The commit transaction is blocked (chain head / write lock held elsewhere) when killed.

    The worker holds the reservation with its token (the commit really runs there). On
    PostgreSQL the commit has locked the reservation and its accounts and written them,
    and waits in its last step, the append's lock of its chain head.
    """
    ledger = PrivacyBudgetLedger(cap=CAP, url=ledger_url)
    keys = [key_for(f"carol-{i}", "count", WINDOW) for i in range(3)]
    reservation = ledger.reserve(keys, GaussianMechanism(4.0))
    ledger.close()
    postgres = make_url(ledger_url).get_backend_name() == "postgresql"
    database = make_url(ledger_url).database
    before = table_counts(ledger_url)

    if postgres:
        with pg_session(ledger_url, autocommit=False) as locker:
            with locker.cursor() as cursor:
                cursor.execute("SELECT seq FROM dp_chain_head FOR UPDATE")  # every chain
            process, results = start_worker(
                workers.operation, (ledger_url, "commit", reservation, 4.0, None)
            )
            expect_ready(results, process)
            with pg_session(ledger_url) as session:
                pid = wait_for_backend(session, database, "wait_event_type = 'Lock'")
                assert queued_on(session, pid) == ["dp_chain_head"]
                assert waiting_statement(session, pid).startswith("WITH head AS (SELECT hash")
                kill(process)
                locker.rollback()
                wait_until_no_ledger_backend(session, database)
    else:
        go = FORKSERVER.Event()
        process, results = start_worker(
            workers.operation, (ledger_url, "commit", reservation, 4.0, go)
        )
        expect_ready(results, process)  # opening the ledger takes the write lock too
        locker = sqlite3.connect(database, isolation_level=None)
        locker.execute("BEGIN IMMEDIATE")
        go.set()
        time.sleep(0.5)  # the commit is now waiting in SQLite's busy handler
        kill(process)
        locker.execute("ROLLBACK")
        locker.close()

    ledger = PrivacyBudgetLedger(url=ledger_url)
    assert table_counts(ledger_url) == before
    assert [r.id for r in ledger.open_reservations()] == [reservation.id]
    assert all(ledger.epsilon_of(key) == 0.0 for key in keys)
    assert ledger.reap(timedelta(0)) == [reservation.id]
    assert all(
        ledger.epsilon_of(key) == pytest.approx(reference_epsilon(4.0, 1), rel=1e-9) for key in keys
    )
    report = ledger.verify()
    assert report.ok, report.problems
    ledger.close()


# ---------------------------------------------------------------------------- idempotency, audit


@pytest.mark.parametrize("op", ["spend", "commit"])
def test_the_same_attempt_from_several_processes_is_charged_once(ledger_url, op):
    """Duplicate workers of one task attempt (e.g. a zombie and its replacement) at once.

    An attempt reserves once, ever: exactly one duplicate gets the reservation and charges
    it (``spend``; or ``commit``: ``reserve``, then ``commit`` of the reservation it got,
    in its own process), every other one is refused with AttemptReused naming
    that reservation, and the account is charged once. The workers are released together
    from behind a lock, so all of them are under way (on PostgreSQL: inside their reserve
    transactions, queued on the window row, which a reserve locks first and exclusively)
    before any of them could write the attempt: nothing but the attempt's uniqueness in
    the ledger keeps a second one out.
    """
    postgres = make_url(ledger_url).get_backend_name() == "postgresql"
    ledger = PrivacyBudgetLedger(cap=CAP, url=ledger_url)
    key = key_for("erin", "count", WINDOW)
    ledger.spend(key, GaussianMechanism(4.0))
    ledger.close()
    attempt = f"dag/task/run/-1/1/{uuid.uuid4()}"
    worker_op, argument = {
        "spend": ("spend", (key, attempt)),
        "commit": ("reserve-commit", ([key], attempt)),
    }[op]
    duplicates = 4
    database = make_url(ledger_url).database
    before = table_counts(ledger_url)
    go = FORKSERVER.Event()

    started = [
        start_worker(workers.operation, (ledger_url, worker_op, argument, 4.0, go))
        for _ in range(duplicates)
    ]
    for process, results in started:
        expect_ready(results, process)
    if postgres:
        with pg_session(ledger_url, autocommit=False) as locker, pg_session(ledger_url) as session:
            with locker.cursor() as cursor:
                cursor.execute(
                    'SELECT 1 FROM dp_windows WHERE "window" = %s FOR UPDATE', (key.window,)
                )
            go.set()
            wait_for_lock_waiters(session, database, duplicates)
            assert [queued_on(session, pid) for pid in lock_waiters(session, database)] == [
                ["dp_windows"]
            ] * duplicates
            locker.rollback()
    else:
        locker = sqlite3.connect(database, isolation_level=None)
        locker.execute("BEGIN IMMEDIATE")
        go.set()
        time.sleep(0.5)
        locker.execute("ROLLBACK")
        locker.close()
    reports = [results.get(timeout=60) for _, results in started]
    _stop([process for process, _ in started])

    assert [r["error"] for r in reports] == [None] * duplicates, reports
    outcomes = Counter(r["outcome"] for r in reports)
    assert outcomes == {"completed": 1, AttemptReused.__name__: duplicates - 1}, reports
    (winner,) = [r for r in reports if r["outcome"] == "completed"]
    assert winner["epsilon"] == pytest.approx(reference_epsilon(4.0, 2), rel=1e-9)
    assert all(r["epsilon"] is None for r in reports if r is not winner)

    ledger = PrivacyBudgetLedger(url=ledger_url)
    entries = ledger.history(key)
    assert [e["action"] for e in entries] == ["reserve", "commit"] * 2
    of_attempt = [e for e in entries if e["payload"].get("attempt_id") == attempt]
    assert [e["action"] for e in of_attempt] == ["reserve", "commit"]
    reservation_id = of_attempt[0]["reservation_id"]
    assert of_attempt[1]["reservation_id"] == reservation_id
    for refused in (r for r in reports if r is not winner):
        refusal = f"attempt {attempt!r} has already reserved ({reservation_id}, "
        assert refusal in refused["message"], refused
    # The refused duplicates wrote nothing: one reservation, one key row (erin's class),
    # two entries more and the reserve's link to its (known) cohort; no class, no cohort.
    assert table_counts(ledger_url) == {
        **before,
        "dp_reservations": before["dp_reservations"] + 1,
        "dp_reservation_keys": before["dp_reservation_keys"] + 1,
        "dp_history": before["dp_history"] + 2,
        "dp_charge_cohorts": before["dp_charge_cohorts"] + 1,
    }
    (account,) = raw_accounts(ledger_url)
    assert (account.releases, account.open_reservations) == (2, 0)
    assert ledger.open_reservations() == []
    assert ledger.epsilon_of(key) == pytest.approx(reference_epsilon(4.0, 2), rel=1e-9)
    report = ledger.verify()
    assert report.ok, report.problems
    ledger.close()


def test_verify_is_not_fooled_by_a_concurrent_writer(ledger_url):
    """verify() reads history, reservations and accounts; another process spends meanwhile."""
    ledger = PrivacyBudgetLedger(cap=CAP, url=ledger_url)
    key = key_for("frank", "count", WINDOW)
    ledger.spend(key, GaussianMechanism(4.0))
    requests = FORKSERVER.Queue()
    process, results = start_worker(workers.spend_on_request, (ledger_url, key, 4.0, requests))
    expect_ready(results, process)
    interleaved: list[dict] = []

    def spend_elsewhere(_connection, _cursor, statement, *_args) -> None:
        # Once verify has read the history and turns to the accounts.
        if not interleaved and "FROM dp_accounts" in statement:
            requests.put("spend")
            interleaved.append(results.get(timeout=60))

    event.listen(Engine, "before_cursor_execute", spend_elsewhere)
    try:
        report = ledger.verify()
    finally:
        event.remove(Engine, "before_cursor_execute", spend_elsewhere)
        requests.put(None)
        _stop([process])
    assert interleaved and "epsilon" in interleaved[0], interleaved
    assert report.ok, report.problems
    assert ledger.verify().ok
    ledger.close()


# ---------------------------------------------------------------------------- faults (PostgreSQL)


def test_backend_terminated_during_a_large_reserve(postgres_url):
    ledger = PrivacyBudgetLedger(cap=CAP, url=postgres_url)
    keys = [key_for(f"s{i:05d}", "count", WINDOW) for i in range(10_000)]
    ledger.spend(keys[7], GaussianMechanism(4.0))
    ledger.close()
    database = make_url(postgres_url).database
    before = pg_snapshot(postgres_url)

    process, results = start_worker(workers.operation, (postgres_url, "reserve", keys, 4.0, None))
    expect_ready(results, process)
    with pg_session(postgres_url) as session, session.cursor() as cursor:
        pid = wait_for_backend(session, database, "backend_xid IS NOT NULL")
        cursor.execute("SELECT pg_terminate_backend(%s)", (pid,))
        report = results.get(timeout=120)
        _stop([process])
        wait_until_no_ledger_backend(session, database)

    assert report["error"] is None, report
    assert report["outcome"] == "LedgerUnavailable", report
    assert report["recovered"] is True, report
    _assert_nothing_changed(postgres_url, before)


@pytest.mark.parametrize("op", ["reserve", "spend", "commit"])
def test_backend_terminated_while_waiting_for_the_chain_head(postgres_url, op):
    """The ledger's transaction did all its work and waits for the chain head lock."""
    ledger = PrivacyBudgetLedger(cap=CAP, url=postgres_url)
    keys = [key_for(f"dave-{i:03d}", "count", WINDOW) for i in range(100)]
    ledger.spend(keys[0], GaussianMechanism(4.0))
    argument = {
        "reserve": keys,
        "spend": keys[0],
        "commit": ledger.reserve(keys[:10], GaussianMechanism(4.0)),
    }[op]
    ledger.close()
    database = make_url(postgres_url).database
    before = pg_snapshot(postgres_url)

    with pg_session(postgres_url, autocommit=False) as locker:
        with locker.cursor() as cursor:
            cursor.execute("SELECT seq FROM dp_chain_head FOR UPDATE")  # every chain
        process, results = start_worker(workers.operation, (postgres_url, op, argument, 4.0, None))
        expect_ready(results, process)
        with pg_session(postgres_url) as session, session.cursor() as cursor:
            pid = wait_for_backend(session, database, "wait_event_type = 'Lock'")
            # It is the chain head it waits for (the tuple lock it queues on), i.e. at the
            # very end of its transaction, in the append's lock of the head: every other
            # write of the transaction is done or queued for the commit.
            assert queued_on(session, pid) == ["dp_chain_head"]
            assert waiting_statement(session, pid).startswith("WITH head AS (SELECT hash")
            cursor.execute("SELECT pg_terminate_backend(%s)", (pid,))
            report = results.get(timeout=60)
        locker.rollback()
    _stop([process])

    assert report["error"] is None, report
    assert report["outcome"] == "LedgerUnavailable", report
    assert "terminat" in report["message"] or "closed" in report["message"], report
    assert report["recovered"] is True, report
    _assert_nothing_changed(postgres_url, before)


def _assert_nothing_changed(url: str, before: dict[str, list[tuple]]) -> None:
    after = pg_snapshot(url)
    for table, rows in before.items():
        assert after[table] == rows, f"{table} changed although the transaction failed"
    ledger = PrivacyBudgetLedger(url=url)
    report = ledger.verify()
    assert report.ok, report.problems
    assert report.accounts == len(before["dp_accounts"])
    ledger.close()


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg2://postgres@127.0.0.1:1/ledger",
        "sqlite:////nonexistent-directory/dp-budget/ledger.db",
    ],
    ids=["postgresql-closed-port", "sqlite-unopenable-path"],
)
def test_unreachable_ledger_fails_closed_at_construction(url):
    with pytest.raises(LedgerUnavailable):
        PrivacyBudgetLedger(cap=CAP, url=url)


# ---------------------------------------------------------------------------- lock order


@pytest.fixture
def icu_postgres_url() -> Iterator[str]:
    """A fresh database whose default collation is ICU en-US (not byte order).

    Most production clusters are initialised with a linguistic collation (en_US.UTF-8
    or ICU), under which "s_1" sorts before "s1" while Python sorts it after.
    """
    options = "TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'"
    with scratch_database("dpb_test_icu", options) as (_, url):
        yield url


def _collation_sorts_underscore_first(session: Any) -> None:
    """The premise: the database sorts tenant "s_1" before "s1" (Python: after)."""
    with session.cursor() as cursor:
        cursor.execute("SELECT array_agg(t ORDER BY t) FROM (VALUES ('s1'), ('s_1')) AS v(t)")
        assert cursor.fetchone()[0] == ["s_1", "s1"]


def _assert_not_locked(session: Any, statement: str, what: str) -> None:
    """``statement`` (a FOR UPDATE NOWAIT) gets its row: no writer holds it."""
    with session.cursor() as cursor:
        try:
            cursor.execute(statement)
        except psycopg2.errors.LockNotAvailable:
            pytest.fail(what)


def test_reserve_and_commit_lock_in_the_same_order_under_a_linguistic_collation(
    icu_postgres_url,
):
    """A reserve and a commit of the same two accounts, both queued behind the first.

    The accounts are one subject's spend classes in tenants "s1" and "s_1": a class
    holds the subjects of one scope, so these are two accounts, and their tenants,
    compared first, decide their order whatever their labels. The reserve locks its
    accounts in key order ("s1" first); the commit (in its own process, holding the
    reservation's token) locks its reservation row, then the same accounts in a statement
    of its own. Had it locked them in the database's collation order it would hold "s_1"
    while waiting for "s1", and the reserve, once given "s1", would wait for "s_1": a
    deadlock.
    """
    url, database = icu_postgres_url, make_url(icu_postgres_url).database
    ledger = PrivacyBudgetLedger(cap=CAP, url=url)
    underscore = key_for("alice", "count", WINDOW, tenant="s_1")
    plain = key_for("alice", "count", WINDOW, tenant="s1")
    assert sorted([underscore, plain]) == [plain, underscore]  # Python: "s1" < "s_1"
    held = ledger.reserve([underscore, plain], GaussianMechanism(4.0))
    assert [key.tenant for key in held.keys] == ["s1", "s_1"]  # two accounts, key order
    ledger.close()

    with pg_session(url, autocommit=False) as locker, pg_session(url) as session:
        _collation_sorts_underscore_first(session)
        with locker.cursor() as cursor:  # hold "s1", the account the reserve locks first
            cursor.execute("SELECT id FROM dp_accounts WHERE tenant = 's1' FOR UPDATE")
        reserving, reserve_results = start_worker(
            workers.operation, (url, "reserve", [underscore, plain], 4.0, None)
        )
        expect_ready(reserve_results, reserving)
        reserve_pid = wait_for_backend(session, database, "wait_event_type = 'Lock'")
        # Past its (exclusive) window locks, queued for the account.
        assert queued_on(session, reserve_pid) == ["dp_accounts"]
        committing, commit_results = start_worker(
            workers.operation, (url, "commit", held, 4.0, None)
        )
        expect_ready(commit_results, committing)
        wait_for_lock_waiters(session, database, 2)
        commit_pid = wait_for_backend(
            session, database, f"wait_event_type = 'Lock' AND pid <> {reserve_pid}"
        )
        # The commit got past its reservation row and queues for an account: "s1", as
        # the reserve does, so neither of them holds "s_1".
        assert queued_on(session, commit_pid) == ["dp_accounts"]
        _assert_not_locked(
            session,
            "SELECT id FROM dp_accounts WHERE tenant = 's_1' FOR UPDATE NOWAIT",
            'the commit locked "s_1" before "s1": not the reserve\'s order',
        )
        # The reserve gets "s1" next and then wants "s_1", which a commit locking in
        # collation order would hold while waiting for "s1".
        locker.rollback()
        reports = [reserve_results.get(timeout=60), commit_results.get(timeout=60)]
    _stop([reserving, committing])

    deadlocked = [r["message"] for r in reports if "deadlock detected" in r["message"]]
    assert deadlocked == [], "reserve and commit took the same two row locks in opposite orders"
    assert [r["outcome"] for r in reports] == ["completed", "completed"], reports


def test_reserve_and_reset_lock_windows_in_the_same_order_under_a_linguistic_collation(
    icu_postgres_url,
):
    """A reserve over one subject in tenants "s1" and "s_1" and a reset of that (closed)
    week, both queued behind the window row of "s1".

    A reserve locks its window rows exclusively in byte order ("s1" first), before any
    account; a reset locks every unsealed scope of its week to seal them. Had the reset
    locked them in the database's collation order it would hold "s_1" while waiting for
    "s1", and the reserve, once given "s1", would wait for "s_1": a deadlock. Locking in
    the same order, the reset waits for the reserve and then finds its reservation open.

    Each transaction decides at the moment it began (on PostgreSQL, the server's clock
    then): the reserve's began while the week still took new releases (its worker's, and
    the setup's, ledger clock is inside the week), the reset's after its grace period (the
    real clock), as a reserve and a reset meet at the end of a grace period.
    """
    url, database = icu_postgres_url, make_url(icu_postgres_url).database
    week = "2020-w01"  # closed and past its grace period: a reset may seal it
    underscore = key_for("alice", "count", week, tenant="s_1")
    plain = key_for("alice", "count", week, tenant="s1")
    with pytest.MonkeyPatch.context() as then:
        ledger_time_in(then, week)
        ledger = PrivacyBudgetLedger(cap=CAP, url=url)
        ledger.commit(ledger.reserve([underscore, plain], GaussianMechanism(4.0)))
        ledger.close()

    with pg_session(url, autocommit=False) as locker, pg_session(url) as session:
        _collation_sorts_underscore_first(session)
        with locker.cursor() as cursor:  # hold "s1", the window the reserve locks first
            cursor.execute("SELECT 1 FROM dp_windows WHERE tenant = 's1' FOR UPDATE")
        reserving, reserve_results = start_worker(
            workers.at,
            (inside(week), workers.operation, url, "reserve", [underscore, plain], 4.0, None),
        )
        expect_ready(reserve_results, reserving)
        reserve_pid = wait_for_backend(session, database, "wait_event_type = 'Lock'")
        assert queued_on(session, reserve_pid) == ["dp_windows"]
        resetting, reset_results = start_worker(workers.operation, (url, "reset", week, 4.0, None))
        expect_ready(reset_results, resetting)
        wait_for_lock_waiters(session, database, 2)
        reset_pid = wait_for_backend(
            session, database, f"wait_event_type = 'Lock' AND pid <> {reserve_pid}"
        )
        assert queued_on(session, reset_pid) == ["dp_windows"]
        _assert_not_locked(
            session,
            "SELECT 1 FROM dp_windows WHERE tenant = 's_1' FOR UPDATE NOWAIT",
            'the reset locked window "s_1" before "s1": not the reserve\'s order',
        )
        locker.rollback()
        reports = [reserve_results.get(timeout=60), reset_results.get(timeout=60)]
    _stop([reserving, resetting])

    deadlocked = [r["message"] for r in reports if "deadlock detected" in r["message"]]
    assert deadlocked == [], "reserve and reset took the same two window locks in opposite orders"
    assert [r["outcome"] for r in reports] == ["completed", "WindowBusy"], reports
    ledger = PrivacyBudgetLedger(url=url)
    assert len(ledger.open_reservations()) == 1
    report = ledger.verify()
    assert report.ok, report.problems
    ledger.close()


# ---------------------------------------------------------------------------- splits (PostgreSQL)


@pytest.mark.parametrize("first", ["split", "commit"])
def test_a_commit_racing_a_split_closes_first_or_charges_the_new_part(postgres_url, first):
    """A reservation R holds the class of {a, b}; a reserve over a alone splits it while a
    commit of R (in its own process) is under way, both queued behind that account.

    A split locks the open reservations it carries before the accounts, as a commit locks
    its reservation before its accounts: the split going first gives R the new part as one
    more key, which the commit then charges with the old one; the commit going first closes
    R, so the new part is born with R's charge and nothing to carry. Either way each subject
    is charged R once, nothing stays pending but the new reservation, and nobody deadlocks.
    """
    database = make_url(postgres_url).database
    ledger = PrivacyBudgetLedger(cap=CAP, url=postgres_url)
    a, b = key_for("a", "count", WINDOW), key_for("b", "count", WINDOW)
    held = ledger.reserve([a, b], GaussianMechanism(4.0))
    (parent,) = held.keys
    ledger.close()
    reserve_args = (postgres_url, "reserve", [a], 4.0, None)
    commit_args = (postgres_url, "commit", held, 4.0, None)
    # The split waits for R (the commit holds it), or the commit waits for R (the split does).
    runs = {"split": (reserve_args, commit_args), "commit": (commit_args, reserve_args)}[first]

    with pg_session(postgres_url, autocommit=False) as locker, pg_session(postgres_url) as session:
        with locker.cursor() as cursor:
            cursor.execute(
                "SELECT id FROM dp_accounts WHERE subject = %s FOR UPDATE", (parent.subject,)
            )
        started = []
        for arguments in runs:
            process, results = start_worker(workers.operation, arguments)
            expect_ready(results, process)
            started.append((process, results))
            wait_for_lock_waiters(session, database, len(started))
        pids = lock_waiters(session, database)
        assert sorted(queued_on(session, pid) for pid in pids) == [
            ["dp_accounts"],
            ["dp_reservations"],
        ]
        locker.rollback()
        reports = [results.get(timeout=60) for _, results in started]
    _stop([process for process, _ in started])

    assert [r["outcome"] for r in reports] == ["completed", "completed"], reports
    ledger = PrivacyBudgetLedger(url=postgres_url)
    entries = ledger.history()
    commit = next(e for e in entries if e["action"] == "commit")
    split_by = [e for e in entries if e["action"] == "reserve"][-1]
    (refined,) = [cohort["refined"] for cohort in split_by["payload"]["cohorts"]]
    ((split_parent, child, moved, carried),) = refined["split"]
    assert (split_parent, moved) == (parent.subject, 1)
    assert carried == ([held.id] if first == "split" else [])
    assert commit["payload"]["key_count"] == (2 if first == "split" else 1)
    rows = {row.subject: row for row in subject_accounts(postgres_url)}
    assert (rows["a"].account, rows["b"].account) == (child, parent.subject)
    assert (rows["a"].releases, rows["b"].releases) == (1, 1)
    assert (rows["a"].open_reservations, rows["b"].open_reservations) == (1, 0)
    assert (
        ledger.epsilon_of(a)
        == ledger.epsilon_of(b)
        == pytest.approx(reference_epsilon(4.0, 1), rel=1e-9)
    )
    report = ledger.verify()
    assert report.ok, report.problems
    ledger.close()


def test_refinements_of_several_windows_lock_carried_reservations_in_one_order(postgres_url):
    """Two reserves, A over windows 1 and 2 and B over windows 3 and 4, each splitting a
    class in both of its windows; open reservations R (windows 1 and 4) and R' (2 and 3)
    hold those classes, so each reserve carries both R and R' to the new parts, and
    locks them before it splits.

    A is held up after it locked what window 1 carries (R), until B has locked what
    window 3 carries (R') and queues for R. Had each reserve locked the reservations of
    one window after another, A would now queue for R' (window 2): a deadlock. Locking
    every carried reservation of the charge at once, in one order, A already holds R' and
    B simply waits for it.

    The windows are days, the last four (today's included): a new release may charge
    them all at once on the workers' (real) clock, which four ISO weeks never allow.
    """
    database = make_url(postgres_url).database
    days = WindowCalendar("day")
    today = datetime.now(timezone.utc)
    w1, w2, w3, w4 = (days.window_of(today - timedelta(days=ago)) for ago in (3, 2, 1, 0))
    ledger = PrivacyBudgetLedger(cap=CAP, url=postgres_url, calendar=days)
    pairs = {"R": (("x", w1), ("y", w4)), "R'": (("u", w2), ("v", w3))}
    held = {
        name: ledger.reserve(
            [key_for(s + tail, "count", w) for s, w in pair for tail in ("", "3")],
            GaussianMechanism(4.0),
        )
        for name, pair in pairs.items()
    }
    ledger.close()
    over = {
        "A": [key_for(s, "count", w) for s, w in (("x", w1), ("x2", w1), ("u", w2), ("u2", w2))],
        "B": [key_for(s, "count", w) for s, w in (("v", w3), ("v2", w3), ("y", w4), ("y2", w4))],
    }

    with pg_session(postgres_url, autocommit=False) as locker, pg_session(postgres_url) as session:
        with locker.cursor() as cursor:  # x's class: A waits for it after locking R
            cursor.execute('SELECT id FROM dp_accounts WHERE "window" = %s FOR UPDATE', (w1,))
        first, first_results = start_worker(
            workers.operation, (postgres_url, "reserve", over["A"], 4.0, None)
        )
        expect_ready(first_results, first)
        a_pid = wait_for_backend(session, database, "wait_event_type = 'Lock'")
        assert queued_on(session, a_pid) == ["dp_accounts"]
        second, second_results = start_worker(
            workers.operation, (postgres_url, "reserve", over["B"], 4.0, None)
        )
        expect_ready(second_results, second)
        wait_for_lock_waiters(session, database, 2)
        b_pid = wait_for_backend(session, database, f"wait_event_type = 'Lock' AND pid <> {a_pid}")
        assert queued_on(session, b_pid) == ["dp_reservations"]
        locker.rollback()
        reports = [first_results.get(timeout=60), second_results.get(timeout=60)]
    _stop([first, second])

    deadlocked = [r["message"] for r in reports if "deadlock detected" in r["message"]]
    assert deadlocked == [], "two refinements locked the reservations they carry in opposite orders"
    assert [r["outcome"] for r in reports] == ["completed", "completed"], reports
    ledger = PrivacyBudgetLedger(url=postgres_url)
    carried = [
        [split[3] for split in cohort["refined"]["split"]]
        for entry in ledger.history()[-2:]
        for cohort in entry["payload"]["cohorts"]
    ]
    r, r_ = held["R"].id, held["R'"].id
    assert sorted(carried) == sorted([[[r]], [[r_]], [[r_]], [[r]]])  # a split in each window
    # R and R' hold the new parts too; A and B a part and a new class in each window.
    assert [len(r.keys) for r in ledger.open_reservations()] == [4, 4, 4, 4]
    report = ledger.verify()
    assert report.ok, report.problems
    ledger.close()
