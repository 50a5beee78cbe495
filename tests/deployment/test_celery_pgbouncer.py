"""Many workers, for real: Airflow 3.3's CeleryExecutor with two Celery workers (separate
process trees, Redis as the broker, a PostgreSQL metadata database), the ledger behind
PgBouncer in transaction-pooling mode with fewer server sessions than clients.

Three DAGs release at once over overlapping cohorts while a fourth release, on the other
worker, is in the middle of its callable; that worker is SIGKILLed (its whole process
tree, as a lost machine). Then the ``dp_budget_reap`` DAG runs on the surviving worker.
The ledger must show: no subject over its cap, exactly the releases that fit granted and
the rest refused, the killed attempt charged by the reap (never refunded), every account
equal to an independent count of its charged releases, a verify that passes, no log of
any component or task naming an error of session state or prepared statements, and no
server session of the pool holding anything a transaction left (a prepared statement, a
setting, a lock, a LISTEN, a temporary table, a cursor) for the next client.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import psutil
import psycopg2
import pytest

from dp_budget_provider.accounting import PureDPMechanism, RDPAccountant
from dp_budget_provider.ledger import BudgetCap, Policy, PrivacyBudgetLedger, key_for
from tests.admin import ADMIN
from tests.deployment.celery_cluster import Cluster, cluster_for, running
from tests.deployment.pgbouncer import PgBouncer, PgBouncerMissing, pgbouncer, session_leftovers
from tests.scratch_postgres import scratch_database

# Over 20 s in all: scheduled before the light files (tests/conftest.py).
pytestmark = pytest.mark.heavy

ROOT = Path(__file__).resolve().parents[2]
CHAIN_KEY = "celery-pgbouncer-chain-key-0123456789abcdef"
TENANT, QUERY_TYPE = "acme", "visits"
DELTA = 1e-5
EPSILON0 = 1.0  # each release: discrete Laplace on the integers, pure eps = 1
# Two releases fit on a subject, a third does not: 3.41 and 4.36 as the cap check counts
# them (a privacy filter at cap 3.5's own order).
CAP = 3.5
LEASE_SECONDS = 2
# Cohorts: the doomed release holds u00-u05 when the others start. A and C then compete
# for u00-u01 (one more fits there), A and B for u04-u05: either A alone is granted, or
# B and C (each subject in B and C only is charged twice at most).
COHORTS = {
    "doomed": [f"u{i:02d}" for i in range(0, 6)],
    "release_a": [f"u{i:02d}" for i in range(0, 8)],
    "release_b": [f"u{i:02d}" for i in range(4, 12)],
    "release_c": [f"u{i:02d}" for i in (0, 1, 8, 9, 10, 11)],
}
RACING = ("release_a", "release_b", "release_c")
# What a ledger that leaves state in a pooled server session meets (psycopg2, PostgreSQL
# and PgBouncer wording), in any log of any component or task.
SESSION_ERRORS = re.compile(
    r"prepared statement|DuplicatePreparedStatement|InvalidSqlStatementName"
    r"|current transaction is aborted|in a read-only transaction|InFailedSqlTransaction"
    r"|unsupported startup parameter|server conn crashed|advisory lock"
    r"|SET SESSION|LedgerUnavailable|ledger is unavailable",
    re.IGNORECASE,
)

# The four release DAGs, one file (one parse): each release marks that its callable runs
# (with its pid); the doomed one then stays in its callable until its worker is killed.
RELEASE_DAGS = """
import os, pathlib, time
from datetime import datetime, timezone
from airflow.sdk import DAG
from dp_budget_provider.operators.release import DPReleaseOperator

HOME = pathlib.Path({home!r})


def answer(dag_id):
    (HOME / f"{{dag_id}}.ran").write_text(str(os.getpid()))
    if dag_id == "doomed":
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            time.sleep(0.1)
        raise RuntimeError("never killed")
    return 7


for dag_id, (subjects, queue) in {dags!r}.items():
    with DAG(dag_id, schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)):
        DPReleaseOperator(
            task_id="release",
            python_callable=answer,
            op_args=[dag_id],
            mechanism={{"kind": "laplace", "epsilon0": {epsilon0!r}}},
            l1_sensitivity=1.0,
            granularity=1,
            integer=True,
            bounds=(0, 100),
            subjects=subjects,
            query_type={query_type!r},
            tenant={tenant!r},
            window={window!r},
            queue=queue,
        )
"""


def expected_epsilon(releases: int) -> float:
    accountant = RDPAccountant()
    if releases:
        accountant.compose(PureDPMechanism(EPSILON0), count=releases)
    return accountant.get_epsilon(DELTA)[0] if releases else 0.0


def bouncer_for(prefix: str, folder: Path) -> Iterator[PgBouncer]:
    """A scratch database of its own, reached only through PgBouncer; fails (never skips)
    without PgBouncer or PostgreSQL."""
    try:
        with scratch_database(prefix) as (name, _), pgbouncer(name, folder) as running:
            yield running
    except PgBouncerMissing as missing:
        pytest.fail(str(missing))
    except psycopg2.OperationalError as error:
        pytest.fail(f"PostgreSQL is required for the tests and is not reachable: {error}")


@pytest.fixture(scope="module")
def bouncer(tmp_path_factory) -> Iterator[PgBouncer]:
    """The ledger's database."""
    yield from bouncer_for("dpb_ledger", tmp_path_factory.mktemp("pgbouncer"))


@pytest.fixture
def fresh_bouncer(tmp_path) -> Iterator[PgBouncer]:
    yield from bouncer_for("dpb_leak", tmp_path)


def write_release_dags(cluster: Cluster, window: str) -> None:
    """The four release DAGs, the doomed one on its own queue."""
    dags = {
        dag_id: (subjects, cluster.queue_named("doomed" if dag_id == "doomed" else "default"))
        for dag_id, subjects in COHORTS.items()
    }
    source = RELEASE_DAGS.format(
        home=str(cluster.home),
        dags=dags,
        epsilon0=EPSILON0,
        query_type=QUERY_TYPE,
        tenant=TENANT,
        window=window,
    )
    (cluster.home / "dags").mkdir(parents=True)
    (cluster.home / "dags" / "releases.py").write_text(source)


def wait_for(path: Path, cluster: Cluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        cluster.check_alive()
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.1)


def test_celery_workers_behind_pgbouncer_never_pass_a_cap_and_a_killed_worker_is_charged(
    bouncer, tmp_path
):
    started = time.monotonic()
    home = tmp_path / "airflow"
    connection = {
        "conn_type": "dpbudget",
        "extra": {
            "url": bouncer.url,
            "chain_key_secret": CHAIN_KEY,
            "admin_public_key": ADMIN.public.text,
        },
    }
    with scratch_database("dpb_airflow") as (_, metadata_url):
        cluster = cluster_for(
            home,
            metadata_url,
            connection,
            AIRFLOW__DP_BUDGET__LEASE_SECONDS=str(LEASE_SECONDS),
            # New DAG files are found within a second (the reap DAG is deployed late).
            AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="1",
        )
        cluster.migrate()
        # Meanwhile the administrator creates the ledger (through PgBouncer, too).
        ledger = PrivacyBudgetLedger(
            BudgetCap(3.0, DELTA), url=bouncer.url, chain_key=CHAIN_KEY, admin=ADMIN
        )
        ledger.set_policy(Policy(CAP, tenant=TENANT, compliance_clause="at most eps 3.5"))
        now = datetime.now(timezone.utc)
        (window,) = ledger.windows_for(TENANT, QUERY_TYPE, now, now)
        write_release_dags(cluster, window)
        marker = {dag_id: home / f"{dag_id}.ran" for dag_id in COHORTS}
        # The doomed worker serves only the doomed release's queue; the steady one runs the
        # three racing releases at once, and the reap.
        workers = {"worker-doomed": (["doomed"], 1), "worker-steady": (["default"], 3)}
        with running(cluster, workers):
            cluster.wait_for_dags(list(COHORTS))
            doomed_run = cluster.trigger("doomed")
            wait_for(marker["doomed"], cluster, timeout=180)  # reserved, in its callable
            runs = {dag_id: cluster.trigger(dag_id) for dag_id in RACING}
            killed = cluster.kill("worker-doomed")
            killed_at = time.monotonic()
            assert int(marker["doomed"].read_text()) in killed
            assert not any(map(psutil.pid_exists, killed))
            states = {d: cluster.wait_for_run(d, r, timeout=180) for d, r in runs.items()}
            # the doomed attempt's last renewal has run out
            time.sleep(max(0.0, killed_at + LEASE_SECONDS - time.monotonic()))
            # The maintenance DAG, deployed now as shipped: unpaused, it runs at once (its
            # latest schedule, catchup off), on the surviving worker.
            shutil.copy(ROOT / "dags" / "dp_budget_reap.py", home / "dags")
            cluster.wait_for_dags(["dp_budget_reap"])
            reap_run = cluster.first_run("dp_budget_reap", timeout=120)
            assert cluster.wait_for_run("dp_budget_reap", reap_run, timeout=120) == "success"
            # As far as Airflow knows the doomed task still runs: nothing reports it again.
            assert cluster.task_state("doomed", doomed_run, "release") == "running"
        logs = cluster.logs()
    elapsed = time.monotonic() - started

    history = ledger.history()
    attempts: dict[str, list[str]] = {}
    for entry in history:
        attempt = entry["payload"].get("attempt_id") or ""
        if "/release/" in attempt:
            attempts.setdefault(attempt.split("/", 1)[0], []).append(entry["action"])
    # The killed attempt: reserved, then charged by the reap, never released.
    assert attempts.get("doomed") == ["reserve", "reap"], attempts
    reaped = [e for e in history if e["action"] == "reap"]
    assert len(reaped) == 1 and "its lease ran out at" in reaped[0]["payload"]["reason"]
    # Exactly the releases that fit: A alone, or B and C; the others refused (no entry).
    granted = {d for d in RACING if attempts.get(d) == ["reserve", "commit"]}
    assert granted in ({"release_a"}, {"release_b", "release_c"}), attempts
    assert {d for d in RACING if d not in granted} == {d for d in RACING if d not in attempts}
    assert states == {d: "success" if d in granted else "failed" for d in RACING}
    for dag_id in set(RACING) - granted:
        (task_log,) = [text for path, text in logs.items() if f"dag_id={dag_id}/" in str(path)]
        assert "no release: the privacy budget ledger refused this release" in task_log
    # Every account equals its charged releases counted independently, within the cap.
    for subject in sorted({s for cohort in COHORTS.values() for s in cohort}):
        charged = sum(subject in COHORTS[d] for d in ("doomed", *granted))
        key = key_for(subject, QUERY_TYPE, window, tenant=TENANT)
        assert ledger.epsilon_of(key) == pytest.approx(expected_epsilon(charged), rel=1e-9)
        assert ledger.epsilon_of(key) <= CAP
    assert ledger.open_reservations() == []
    assert ledger.verify().ok
    # No session state met another client's transaction on a shared server session.
    errors = {p.name: m.group(0) for p, t in logs.items() if (m := SESSION_ERRORS.search(t))}
    assert errors == {}
    assert not SESSION_ERRORS.search(bouncer.log.read_text())
    leftovers = session_leftovers(bouncer)
    assert all(found == [] for found in leftovers.values()), leftovers
    (stats,) = [s for s in bouncer.admin("SHOW STATS") if s["database"] != "pgbouncer"]
    assert stats["total_xact_count"] > 20  # the workers' ledger work went through PgBouncer
    ledger.close()
    print(
        f"celery + pgbouncer: {elapsed:.1f} s, granted {sorted(granted)}, "
        f"{stats['total_xact_count']} transactions through PgBouncer"
    )


def test_the_session_check_sees_what_a_client_leaves_in_a_pooled_session(fresh_bouncer):
    """The check above can fail: a client that SETs, PREPAREs, LISTENs, takes an advisory
    lock or creates a temporary table outside a transaction leaves it in the server
    session, for the next client PgBouncer hands that session to."""
    bouncer = fresh_bouncer
    assert all(found == [] for found in session_leftovers(bouncer).values())
    client = psycopg2.connect(bouncer.dsn)
    client.autocommit = True
    with client.cursor() as cursor:
        for statement in (
            "SET statement_timeout = 5000",
            "PREPARE leftover AS SELECT 1",
            "LISTEN leftover",
            "SELECT pg_advisory_lock(42)",
            "CREATE TEMPORARY TABLE leftover (x int)",
        ):
            cursor.execute(statement)
    client.close()
    found = [item for items in session_leftovers(bouncer).values() for item in items]
    assert sorted(found) == [
        "LISTEN leftover",
        "SET statement_timeout = 5000",
        "advisory lock 42",
        "prepared statement leftover",
        "temporary table leftover",
    ]
