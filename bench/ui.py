"""Benchmark of the budget UI on a big ledger: 10^5 subjects, one with 10^4 history entries.

Run: ``.venv/bin/python bench/ui.py`` (PostgreSQL at ``DP_BUDGET_TEST_PG``, by default
``host=127.0.0.1 port=5432 user=postgres``). ``--accounts``, ``--history`` and
``--repeat`` change the sizes and the number of timed requests.

The ledger is filled the honest way, through the ledger API: three releases over
10^5, 5*10^4 and 10^4 subjects (``reserve`` + ``commit`` of one multi-key reservation
each, as DPReleaseOperator makes them), then ``spend`` on one of those subjects until
its history holds 10^4 entries (every release is a reserve and a commit entry). Each
backend (an SQLite file, a scratch PostgreSQL database) is timed through the real app
and the real authentication: FastAPI's TestClient with an Airflow JWT (the simple auth
manager, its metadata database in a throw-away AIRFLOW_HOME); no network in between.
The releases leave four spend classes (the hot key's among them), the largest of 5*10^4
subjects, each stored as one account (``dp_members`` maps the 10^5 subjects to them):
the accounts API lists subjects through the memberships, the classes API groups the
four accounts. Goal: the first page of the accounts API, the first page of the classes
API and the account page of the 10^4-entry key each under 300 ms (median). The script
prints the load average, because wall times on a shared machine move with its load.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.ledger_time import this_week  # noqa: E402
from tests.scratch_postgres import scratch_database  # noqa: E402

# The current week: a past one takes no new release once its grace period is over.
WINDOW = this_week()
GOAL_MS = 300.0


@contextlib.contextmanager
def scratch_postgres() -> Iterator[str]:
    with scratch_database("dpb_bench_ui") as (_, url):
        yield url


def airflow_home(path: Path) -> None:
    """A throw-away Airflow home with a migrated metadata DB (the JWT check reads it)."""
    os.environ.update(
        AIRFLOW_HOME=str(path),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__LOGGING__LOGGING_LEVEL="ERROR",
        AIRFLOW__API_AUTH__JWT_SECRET=os.urandom(48).hex(),
    )
    airflow = Path(sys.executable).with_name("airflow")
    subprocess.run([str(airflow), "db", "migrate"], check=True, capture_output=True)


def fill(url: str, accounts: int, history: int):
    """The ledger with ``accounts`` subjects and one key with ``history`` entries."""
    from dp_budget_provider.accounting import GaussianMechanism
    from dp_budget_provider.ledger import BudgetCap, PrivacyBudgetLedger, key_for

    ledger = PrivacyBudgetLedger(BudgetCap(3.0, 1e-5), url=url)
    keys = [key_for(f"subject-{i:06d}", "heatmap", WINDOW, tenant="acme") for i in range(accounts)]
    started = time.perf_counter()
    for run, share in enumerate((1, 2, 10)):
        reservation = ledger.reserve(
            keys[: accounts // share], GaussianMechanism(4.0), attempt=f"bench/heatmap/{run}/-1/1"
        )
        ledger.commit(reservation)
    bulk = time.perf_counter() - started
    hot = keys[0]
    started = time.perf_counter()
    spends = (history - len(ledger.history(hot))) // 2
    for run in range(spends):
        ledger.spend(hot, GaussianMechanism(400.0), attempt=f"bench/hot/{run}/-1/1")
    single = time.perf_counter() - started
    entries = len(ledger.history(hot))
    if url.startswith("postgresql"):
        # What autovacuum does after a fill like this one (its default threshold is 10% of
        # a table's rows changed); this machine's server runs with autovacuum off, and
        # stale statistics give PostgreSQL other plans than a live ledger gets.
        import sqlalchemy

        engine = sqlalchemy.create_engine(url, isolation_level="AUTOCOMMIT")
        with engine.connect() as connection:
            connection.execute(sqlalchemy.text("ANALYZE"))
        engine.dispose()
    return ledger, hot, entries, bulk, single, spends


def timed(call: Callable[[], object], repeat: int) -> tuple[float, float]:
    """Median and max milliseconds of ``repeat`` calls after two warm-up calls."""
    for _ in range(2):
        call()
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples), max(samples)


def measure(
    ledger, hot, entries: int, token: str, repeat: int
) -> list[tuple[str, float, float, bool]]:
    from fastapi.testclient import TestClient

    from dp_budget_provider.plugins.app import create_app

    client = TestClient(create_app(lambda: ledger))
    client.headers["Authorization"] = f"Bearer {token}"
    key = hot.as_dict()

    def get(path: str, **params: object) -> Callable[[], object]:
        def call() -> object:
            response = client.get(path, params=params)
            assert response.status_code == 200, (path, response.status_code, response.text[:300])
            return response

        return call

    total = client.get("/api/accounts").json()["total"]
    classes = client.get("/api/classes").json()["classes"]
    largest = max(classes, key=lambda c: c["subjects"])
    cases = [
        ("accounts API, first page (50, key order)", get("/api/accounts"), True),
        (f"classes API, first page (all {total} subjects grouped)", get("/api/classes"), True),
        (
            f"class members API, first page (class of {largest['subjects']})",
            get("/api/classes/members", **dict(parse_qsl(urlsplit(largest["members_url"]).query))),
            False,
        ),
        ("accounts page (HTML), first page", get("/accounts"), False),
        (f"account page (HTML), key with {entries} entries", get("/account", **key), True),
        ("account API (detail + chart series)", get("/api/account", **key), False),
        ("account history API, first page", get("/api/account/history", **key), False),
        (
            f"accounts API sorted by epsilon (all {total} ranked)",
            get("/api/accounts", sort="epsilon", order="desc"),
            False,
        ),
        ("accounts API filtered by state=warning", get("/api/accounts", state="warning"), False),
    ]
    results = []
    for name, call, goal in cases:
        median, worst = timed(call, repeat)
        results.append((name, median, worst, goal))
    client.close()
    return results


def load_average() -> str:
    """The 1-minute load average: other work on the machine slows wall times, not CPU."""
    return f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accounts", type=int, default=10**5, help="subjects")
    parser.add_argument("--history", type=int, default=10**4)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        airflow_home(Path(tmp) / "airflow")
        from airflow.api_fastapi.app import init_auth_manager
        from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

        token = init_auth_manager().generate_jwt(
            SimpleAuthManagerUser(username="admin", role="ADMIN")
        )
        rows = []
        for backend in ("sqlite", "postgresql"):
            with contextlib.ExitStack() as stack:
                if backend == "sqlite":
                    url = f"sqlite:///{Path(tmp) / 'ledger.db'}"
                else:
                    url = stack.enter_context(scratch_postgres())
                print(f"{backend}: filling the ledger", file=sys.stderr, flush=True)
                ledger, hot, entries, bulk, single, spends = fill(url, args.accounts, args.history)
                print(
                    f"{backend}: {args.accounts} subjects by 3 releases in {bulk:.1f} s, "
                    f"{spends} single-key releases in {single:.1f} s; key {hot} has "
                    f"{entries} history entries",
                    file=sys.stderr,
                    flush=True,
                )
                for name, median, worst, goal in measure(ledger, hot, entries, token, args.repeat):
                    rows.append((backend, name, median, worst, goal))
                ledger.close()

    print(
        f"\n{args.accounts} subjects, a key with {args.history} history entries, "
        f"median and max of {args.repeat} requests after 2 warm-ups, "
        f"load average {load_average()}\n"
    )
    print("| backend | request | median ms | max ms | goal < 300 ms |")
    print("|---|---|---|---|---|")
    for backend, name, median, worst, goal in rows:
        verdict = ("met" if median < GOAL_MS else "MISSED") if goal else "(info)"
        print(f"| {backend} | {name} | {median:.1f} | {worst:.1f} | {verdict} |")


if __name__ == "__main__":
    main()
