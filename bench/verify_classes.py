"""Benchmark of ``verify`` proving spend classes: many subjects, few overlapping cohorts.

Run: ``.venv/bin/python bench/verify_classes.py`` (PostgreSQL at ``DP_BUDGET_TEST_PG``,
by default ``host=127.0.0.1 port=5432 user=postgres``; SQLite in a temporary file).
``--subjects`` (default 10^5) subjects of one window are charged by ``--releases``
(default 20) releases through the public API, each over one of ``--cohorts`` (default 5)
random cohorts of 30-90 % of the subjects, in turn: the first release over each cohort
refines the window's classes (splits, new accounts), the later ones charge its listed
accounts. ``--backend`` picks sqlite, postgresql or both (default). On PostgreSQL the
fill runs ``ANALYZE`` after each release, as autovacuum would (this server runs with
``autovacuum = off``; without statistics the planner takes the tables for empty).

Each figure is measured in a fresh child process that does one thing, reads its own
peak RSS (``VmHWM``) and exits:

* verify: opens the ledger and runs ``verify()`` (which must report ``ok``);
* open: only opens the ledger (verify's memory is shown above it);
* stream: reads ``dp_members`` and ``dp_cohort_members`` once, in the order verify reads
  them, discarding the rows (server-side cursors on PostgreSQL): what a streaming proof
  of the memberships and digests reads at least. Its time is verify's baseline.
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg2

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.ledger_time import this_week  # noqa: E402
from tests.scratch_postgres import dsn_part, scratch_database, url_of  # noqa: E402

# The current week: a past one takes no new release once its grace period is over.
WINDOW = this_week()
STREAM_BATCH = 5000
STREAMED = (
    'SELECT * FROM dp_members ORDER BY tenant, query_type, "window", subject',
    "SELECT * FROM dp_cohort_members ORDER BY cohort_id, subject",
)


def mib(kib: float) -> float:
    return kib / 1024


def peak_kib() -> int:
    """This process's peak RSS as the kernel reports it (VmHWM, KiB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def connect(url: str) -> psycopg2.extensions.connection:
    """A psycopg2 connection to the scratch database of ``url``."""
    return psycopg2.connect(
        host=dsn_part("host"),
        port=dsn_part("port"),
        user=dsn_part("user"),
        dbname=url.rsplit("/", 1)[1],
    )


def analyze(url: str) -> None:
    if url.startswith("postgresql"):
        connection = connect(url)
        connection.autocommit = True
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")
        connection.close()


def fill(url: str, subjects: int, cohorts: int, releases: int, seed: int) -> dict[str, Any]:
    """The history: ``releases`` releases over ``cohorts`` random cohorts, in turn."""
    from dp_budget_provider.accounting import GaussianMechanism
    from dp_budget_provider.ledger import BudgetCap, PrivacyBudgetLedger, keys_for

    rng = random.Random(seed)
    everyone = [f"user-{index:07d}" for index in range(subjects)]
    chosen = [rng.sample(everyone, int(subjects * rng.uniform(0.3, 0.9))) for _ in range(cohorts)]
    ledger = PrivacyBudgetLedger(BudgetCap(1000.0, 1e-5), url=url, actor="bench")
    start = time.perf_counter()
    try:
        for number in range(releases):
            keys = keys_for(chosen[number % cohorts], "count", [WINDOW])
            ledger.commit(ledger.reserve(keys, GaussianMechanism(20.0)))
            analyze(url)
    finally:
        ledger.close()
    return {"seconds": time.perf_counter() - start, "charged": len(set().union(*chosen))}


def child_main(mode: str, url: str) -> None:
    """One measurement in this fresh process; prints its result as one JSON line."""
    result: dict[str, Any] = {}
    if mode == "stream":
        start = time.perf_counter()
        rows = 0
        if url.startswith("sqlite"):
            connection = sqlite3.connect(url.removeprefix("sqlite:///"))
            for query in STREAMED:
                rows += sum(1 for _ in connection.execute(query))
        else:
            connection = connect(url)
            for number, query in enumerate(STREAMED):
                cursor = connection.cursor(name=f"bench_stream_{number}")  # server-side
                cursor.itersize = STREAM_BATCH
                cursor.execute(query.replace(", subject", ', subject COLLATE "C"'))
                rows += sum(1 for _ in cursor)
                cursor.close()
        connection.close()
        result.update(seconds=time.perf_counter() - start, rows=rows)
    else:
        from dp_budget_provider.ledger import PrivacyBudgetLedger

        ledger = PrivacyBudgetLedger(url=url)
        if mode == "verify":
            start = time.perf_counter()
            report = ledger.verify()
            result.update(
                seconds=time.perf_counter() - start,
                ok=report.ok,
                entries=report.entries,
                accounts=report.accounts,
                problems=report.problems[:5],
            )
        ledger.close()
    result["vmhwm_kib"] = peak_kib()
    print(json.dumps(result), flush=True)


def child(mode: str, url: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--url", url],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {mode} child failed (exit {done.returncode}):\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench(backend: str, url: str, arguments: argparse.Namespace) -> None:
    filled = fill(url, arguments.subjects, arguments.cohorts, arguments.releases, arguments.seed)
    child("stream", url)  # warm: every later reader finds the tables in the page cache
    stream, opened = child("stream", url), child("open", url)
    runs = [child("verify", url) for _ in range(arguments.rounds)]
    for run in runs:
        if not run["ok"]:
            raise RuntimeError(f"verify failed on {backend}: {run['problems']}")
    best = min(runs, key=lambda run: run["seconds"])
    times = ", ".join(f"{run['seconds']:.2f}" for run in runs)
    print(
        f"{backend}: {arguments.subjects} subjects ({filled['charged']} charged), "
        f"{arguments.releases} releases over {arguments.cohorts} cohorts written in "
        f"{filled['seconds']:.1f} s; {best['entries']} entries, {best['accounts']} accounts\n"
        f"  verify {best['seconds']:.2f} s (best of {len(runs)}: "
        f"{times}); "
        f"streaming {stream['rows']} member and cohort member rows once "
        f"{stream['seconds']:.2f} s ({best['seconds'] / stream['seconds']:.1f}x)\n"
        f"  verify peak RSS {mib(best['vmhwm_kib']):.1f} MiB, "
        f"{mib(best['vmhwm_kib'] - opened['vmhwm_kib']):.1f} MiB above opening the ledger "
        f"({mib(opened['vmhwm_kib']):.1f} MiB); the stream's peak "
        f"{mib(stream['vmhwm_kib']):.1f} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subjects", type=int, default=10**5)
    parser.add_argument("--cohorts", type=int, default=5)
    parser.add_argument("--releases", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="verify runs (best is shown)")
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child:
        child_main(arguments.child, arguments.url)
        return
    if arguments.backend in ("sqlite", "both"):
        with tempfile.TemporaryDirectory() as folder:
            bench("sqlite", f"sqlite:///{Path(folder) / 'ledger.db'}", arguments)
    if arguments.backend in ("postgresql", "both"):
        with scratch_database("dpb_bench_classes") as (name, _):
            bench("postgresql", url_of(name), arguments)


if __name__ == "__main__":
    main()
