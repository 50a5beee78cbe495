"""Benchmarks of the privacy budget ledger against what its database can do at best.

Run: ``.venv/bin/python bench/ledger.py`` (PostgreSQL at ``DP_BUDGET_TEST_PG``, by
default ``host=127.0.0.1 port=5432 user=postgres``; ``pgbench`` on the PATH).
``--duration`` sets the seconds of each throughput run (default 10), ``--rounds`` how
many times the throughput benchmarks alternate a baseline run and ours (default 3).

Every benchmark measures its baseline in the same run, on the same server, and prints
the ratio; each creates its own scratch databases and drops them afterwards. The
throughput ratios are medians over rounds, each of ours against the baseline run just
before it, because this machine's speed drifts from minute to minute.

* hot key: 8 processes doing reserve + commit on one key, releases/s, vs ``pgbench``
  with 8 clients each running BEGIN; SELECT ... FOR UPDATE; UPDATE; END on one row.
* distinct keys: 8 processes, each on its own keys, vs ``pgbench -N`` with 8 clients.
* embedded SQLite: releases/s of ``spend`` from one process vs the same transaction
  shape (BEGIN IMMEDIATE; SELECT; UPDATE; INSERT; COMMIT) in raw sqlite3.
* cohort releases (``--cohort-size``, default 10^6 on PostgreSQL, a tenth on SQLite):
  building the keys, a first release over a new cohort, the same release again, a
  ``budget_check`` over the cohort, the rows the repeated release writes, and a release
  over a list of keys half of which the cohort holds (a split beside new subjects), each
  against loading the same ids into a table at best (PostgreSQL ``COPY``; SQLite one
  INSERT transaction).
* cohort releases under three scopes (``--only scopes``, PostgreSQL, ``--cohort-size``):
  a ledger capping each subject's total across query types and across a 52-week horizon
  against one capping only the query type, the same cohort's first release and its
  repeats alternating between the two, and the rows a repeat writes.

``--only NAME`` (repeatable) runs only the named benchmarks. The CPU figures read the
machine's busy time (``/proc/stat``), so run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import re
import resource
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import psycopg2
import sqlalchemy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import (
    AdminKey,
    BudgetCap,
    Policy,
    PrivacyBudgetLedger,
    key_for,
    keys_for,
)
from dp_budget_provider.ledger.storage import pipeline
from tests.ledger_time import this_week  # noqa: E402
from tests.scratch_postgres import dsn_part, scratch_database  # noqa: E402

PROCESSES = 8
# The current week: a past one takes no new release once its grace period is over.
WINDOW = this_week()
# A cap no benchmark can reach, and a tiny cost per release: nothing is ever refused.
CAP = BudgetCap(epsilon=1e9, delta=1e-5)
MECHANISM = GaussianMechanism(1000.0)
GOAL_THROUGHPUT = 0.3
SPAWN = multiprocessing.get_context("spawn")


def machine_busy_seconds() -> float:
    """CPU seconds every process on the machine has used so far (Linux ``/proc/stat``)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle, iowait = fields[3], fields[4]
    return (sum(fields) - idle - iowait) / os.sysconf("SC_CLK_TCK")


class Measured(NamedTuple):
    """A throughput run and where its CPU went, per release (or per transaction)."""

    rate: float
    client_us: float
    server_us: float


def connect(database: str) -> psycopg2.extensions.connection:
    return psycopg2.connect(
        host=dsn_part("host"), port=dsn_part("port"), user=dsn_part("user"), dbname=database
    )


def pgbench(database: str, *arguments: str) -> str:
    command = [
        "pgbench",
        "-h",
        dsn_part("host"),
        "-p",
        dsn_part("port"),
        "-U",
        dsn_part("user"),
        *arguments,
        database,
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return done.stdout + done.stderr


def pgbench_run(database: str, *arguments: str) -> Measured:
    """A pgbench run: transactions/s, and pgbench's and the server's CPU per transaction
    (the machine's busy time during the run minus pgbench's own)."""
    client = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy = machine_busy_seconds()
    output = pgbench(database, *arguments)
    busy = machine_busy_seconds() - busy
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    rate = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", output)
    done = re.search(r"number of transactions actually processed: ([0-9]+)", output)
    if rate is None or done is None:
        raise RuntimeError(f"could not read tps from pgbench:\n{output}")
    transactions = int(done.group(1))
    own = after.ru_utime + after.ru_stime - client.ru_utime - client.ru_stime
    return Measured(
        float(rate.group(1)), own / transactions * 1e6, (busy - own) / transactions * 1e6
    )


def pgbench_clients(duration: float) -> tuple[str, ...]:
    """pgbench's options for a run of ``duration`` s with as many clients as we run processes."""
    return ("-n", "-c", str(PROCESSES), "-j", "2", "-T", str(int(duration)))


def pgbench_tps(database: str, *arguments: str) -> float:
    return pgbench_run(database, *arguments).rate


# ---------------------------------------------------------------------------- ledger workers


def release_loop(url: str, keys: list, mode: str, duration: float, barrier, results) -> None:
    """Releases on ``keys`` (round robin) for ``duration`` seconds after the barrier;
    reports (releases, seconds, CPU seconds of this process during the loop). Mode
    ``immediate`` is reserve+commit with every write sent when issued, not with the commit."""
    if mode == "immediate":
        pipeline.Pipeline.defer_sends = False
    ledger = PrivacyBudgetLedger(url=url)
    ledger.commit(ledger.reserve(keys[0], MECHANISM))  # connection and caches warm
    barrier.wait(120)
    cpu = time.process_time()
    done, start = 0, time.perf_counter()
    deadline = start + duration
    while time.perf_counter() < deadline:
        key = keys[done % len(keys)]
        if mode == "spend":
            ledger.spend(key, MECHANISM)
        else:
            ledger.commit(ledger.reserve(key, MECHANISM))
        done += 1
    results.put((done, time.perf_counter() - start, time.process_time() - cpu))
    ledger.close()


def ledger_run(url: str, key_sets: list[list], mode: str, duration: float) -> Measured:
    """``len(key_sets)`` processes releasing, one key set each. The server's CPU is the
    machine's busy time while they loop minus their own: run nothing else meanwhile."""
    results = SPAWN.Queue()
    barrier = SPAWN.Barrier(len(key_sets) + 1)
    processes = [
        SPAWN.Process(target=release_loop, args=(url, keys, mode, duration, barrier, results))
        for keys in key_sets
    ]
    for process in processes:
        process.start()
    barrier.wait(300)
    busy = machine_busy_seconds()
    reports = [results.get(timeout=duration + 300) for _ in processes]
    busy = machine_busy_seconds() - busy
    for process in processes:
        process.join()
    releases = sum(done for done, _, _ in reports)
    client = sum(cpu for _, _, cpu in reports)
    return Measured(
        releases / max(elapsed for _, elapsed, _ in reports),
        client / releases * 1e6,
        (busy - client) / releases * 1e6,
    )


def ledger_throughput(url: str, key_sets: list[list], mode: str, duration: float) -> float:
    """Releases per second of ``len(key_sets)`` processes, one key set each."""
    return ledger_run(url, key_sets, mode, duration).rate


# ---------------------------------------------------------------------------- benchmarks

HOT_SUBJECT = "hot-subject"
KEYS_PER_PROCESS = 16


def distinct_key_sets() -> list[list]:
    """Each process's own keys (the distinct-key benchmarks)."""
    return [
        [key_for(f"worker-{w}-subject-{j}", "count", WINDOW) for j in range(KEYS_PER_PROCESS)]
        for w in range(PROCESSES)
    ]


def create_hot_row(database: str) -> None:
    """The one row the hot-key baseline locks and updates."""
    with connect(database) as connection, connection.cursor() as cursor:
        cursor.execute("CREATE TABLE hot (id integer PRIMARY KEY, v bigint NOT NULL)")
        cursor.execute("INSERT INTO hot VALUES (1, 0)")
    connection.close()


HOT_SCRIPT = """BEGIN;
SELECT v FROM hot WHERE id = 1 FOR UPDATE;
UPDATE hot SET v = v + 1 WHERE id = 1;
END;
"""


def interleaved(rounds: int, ours: Callable[[], float], base: Callable[[], float]) -> tuple:
    """Rates of ``rounds`` alternating runs (baseline first) and their median ratio.

    The machine's speed drifts within minutes (pgbench on one row gave 780 tps in one
    run and 1,412 in the next), so each of ours is paired with the baseline run just
    before it, and the median of the pair ratios is reported.
    """
    pairs = []
    for _ in range(rounds):
        base_rate = base()
        pairs.append((ours(), base_rate))
    ratios = sorted(o / b for o, b in pairs)
    middle = statistics.median(ratios)
    ours_rates = [o for o, _ in pairs]
    base_rates = [b for _, b in pairs]
    return statistics.median(ours_rates), statistics.median(base_rates), middle, pairs


def describe(pairs: list[tuple[float, float]]) -> str:
    return ", ".join(f"{o:.0f}/{b:.0f}" for o, b in pairs)


def bench_hot_key(duration: float, rounds: int) -> list[tuple]:
    with (
        scratch_database("dpb_bench_hot") as (_, url),
        scratch_database("dpb_bench_pgbench_hot") as (name, _),
        tempfile.TemporaryDirectory() as tmp,
    ):
        PrivacyBudgetLedger(cap=CAP, url=url).close()
        hot = [key_for(HOT_SUBJECT, "count", WINDOW)]
        create_hot_row(name)
        script = Path(tmp) / "hot.sql"
        script.write_text(HOT_SCRIPT)
        clients = pgbench_clients(duration)

        def base() -> float:
            return pgbench_tps(name, *clients, "-f", str(script))

        results = {
            mode: interleaved(
                rounds,
                lambda mode=mode: ledger_throughput(url, [hot] * PROCESSES, mode, duration),
                base,
            )
            for mode in ("reserve-commit", "spend")
        }
    rows = []
    for mode, label, goal in (
        ("reserve-commit", "hot key, reserve+commit", f">= {GOAL_THROUGHPUT}"),
        ("spend", "hot key, spend() (reserve+commit in one call)", "(info)"),
    ):
        ours, base_rate, ratio, pairs = results[mode]
        rows.append(
            (
                f"{label} (median of {rounds}: {describe(pairs)})",
                ours,
                "releases/s",
                base_rate,
                "pgbench FOR UPDATE tps",
                ratio,
                goal,
            )
        )
    return rows


def bench_distinct_keys(duration: float, rounds: int) -> list[tuple]:
    with (
        scratch_database("dpb_bench_distinct") as (_, url),
        scratch_database("dpb_bench_pgbench_n") as (name, _),
    ):
        PrivacyBudgetLedger(cap=CAP, url=url).close()
        key_sets = distinct_key_sets()
        pgbench(name, "-i", "-q", "-s", "1")
        ours, base_rate, ratio, pairs = interleaved(
            rounds,
            lambda: ledger_throughput(url, key_sets, "reserve-commit", duration),
            lambda: pgbench_tps(name, *pgbench_clients(duration), "-N"),
        )
    return [
        (
            f"distinct keys, reserve+commit (median of {rounds}: {describe(pairs)})",
            ours,
            "releases/s",
            base_rate,
            "pgbench -N tps",
            ratio,
            f">= {GOAL_THROUGHPUT}",
        ),
    ]


_TABLES = (
    "dp_accounts",
    "dp_members",
    "dp_cohorts",
    "dp_cohort_members",
    "dp_cohort_accounts",
    "dp_charge_cohorts",
    "dp_reservation_keys",
    "dp_reservations",
    "dp_history",
)


def bench_pipeline(duration: float, rounds: int) -> list[tuple]:
    """What deferring the writes nobody reads back to the commit saves (distinct keys):
    ours with the deferral, against the same releases sending each write at once."""
    with scratch_database("dpb_bench_pipeline") as (_, url):
        PrivacyBudgetLedger(cap=CAP, url=url).close()
        key_sets = distinct_key_sets()
        ours, base_rate, ratio, pairs = interleaved(
            rounds,
            lambda: ledger_throughput(url, key_sets, "reserve-commit", duration),
            lambda: ledger_throughput(url, key_sets, "immediate", duration),
        )
    return [
        (
            f"distinct keys, writes deferred to the commit (median of {rounds}: {describe(pairs)})",
            ours,
            "releases/s",
            base_rate,
            "releases/s sending each write at once",
            ratio,
            "(keep if > 1)",
        ),
    ]


def _rows(ledger: PrivacyBudgetLedger) -> int:
    """Rows in the ledger's growing tables (what a release writes, accounts included)."""
    with ledger.reading() as connection:
        return sum(
            connection.execute(sqlalchemy.text(f"SELECT count(*) FROM {table}")).scalar_one()
            for table in _TABLES
        )


def _copy_baseline(size: int, url: str) -> float:
    """Seconds to load ``size`` subject ids into a fresh table at best: PostgreSQL COPY,
    SQLite one executemany INSERT in one transaction."""
    ids = "".join(f"cohort-subject-{i:07d}\n" for i in range(size))
    if url.startswith("sqlite"):
        with tempfile.TemporaryDirectory() as tmp:
            raw = sqlite3.connect(Path(tmp) / "raw.db", isolation_level=None)
            raw.execute("CREATE TABLE ids (subject TEXT PRIMARY KEY)")
            start = time.perf_counter()
            raw.execute("BEGIN")
            raw.executemany("INSERT INTO ids VALUES (?)", ((s,) for s in ids.split()))
            raw.execute("COMMIT")
            elapsed = time.perf_counter() - start
            raw.close()
            return elapsed
    database = url.rsplit("/", 1)[1]
    with connect(database) as connection, connection.cursor() as cursor:
        cursor.execute("CREATE TABLE ids (subject text PRIMARY KEY)")
        connection.commit()
        start = time.perf_counter()
        cursor.copy_expert("COPY ids (subject) FROM STDIN", io.StringIO(ids))
        connection.commit()
        elapsed = time.perf_counter() - start
        cursor.execute("DROP TABLE ids")
    connection.close()
    return elapsed


VERIFIED_RELEASES = 100
_VERIFY_CHILD = """
import json, sys, time
from pathlib import Path
from dp_budget_provider.ledger import PrivacyBudgetLedger
ledger = PrivacyBudgetLedger(url=sys.argv[1])
start = time.perf_counter()
report = ledger.verify()
elapsed = time.perf_counter() - start
peak = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
            if line.startswith("VmHWM:"))
result = {"seconds": elapsed, "kib": peak, "ok": report.ok, "problems": report.problems[:3]}
print(json.dumps(result))
"""


def _verify_in_a_child(url: str) -> tuple[float, float]:
    """verify() of the ledger in a fresh process: its seconds and its peak RSS (MiB)."""
    done = subprocess.run(
        [sys.executable, "-c", _VERIFY_CHILD, url], capture_output=True, text=True, check=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["ok"]:
        raise AssertionError(f"verify failed: {result['problems']}")
    return result["seconds"], result["kib"] / 1024


def _cohort_rows(backend: str, size: int, url: str) -> list[tuple]:
    """The release shapes of a real population (issue: cohorts and spend classes)."""
    copy = _copy_baseline(size, url)
    ledger = PrivacyBudgetLedger(cap=CAP, url=url)
    subjects = [f"cohort-subject-{i:07d}" for i in range(size)]
    timed: dict[str, float] = {}
    start = time.perf_counter()
    keys = keys_for(subjects, "count", [WINDOW])
    timed["keys"] = time.perf_counter() - start
    # The realistic shape: an upstream task registers the cohort, the release charges it.
    before = _rows(ledger)
    start = time.perf_counter()
    covered = ledger.cohort(subjects).in_window("count", WINDOW)
    ledger.commit(ledger.reserve(covered, MECHANISM))
    timed["first"] = time.perf_counter() - start
    timed["first rows"] = _rows(ledger) - before
    before = _rows(ledger)
    start = time.perf_counter()
    ledger.commit(ledger.reserve(covered, MECHANISM))
    timed["repeated"] = time.perf_counter() - start
    timed["repeated rows"] = _rows(ledger) - before
    start = time.perf_counter()
    ledger.commit(ledger.reserve(keys, MECHANISM))
    timed["repeated keys"] = time.perf_counter() - start
    start = time.perf_counter()
    check = ledger.budget_check(covered, MECHANISM)
    timed["check"] = time.perf_counter() - start
    assert not check.exceeds and check.states == 1
    start = time.perf_counter()
    check = ledger.budget_check(keys, MECHANISM)
    timed["check keys"] = time.perf_counter() - start
    assert not check.exceeds and check.states == 1
    while sum(1 for e in ledger.history() if e["action"] == "commit") < VERIFIED_RELEASES:
        ledger.commit(ledger.reserve(covered, MECHANISM))
    if backend == "PostgreSQL":  # what autovacuum does after a fill (keep it on; docs/deploying.md)
        with ledger.reading() as connection:
            connection.execute(sqlalchemy.text("ANALYZE"))
    timed["verify"], timed["verify MiB"] = _verify_in_a_child(url)
    # A list of keys half of which the cohort holds: its class splits, and the other half
    # (new to the window) forms a new class beside the window's members.
    overlapping = keys_for(
        [f"cohort-subject-{i:07d}" for i in range(size // 2, size + size // 2)], "count", [WINDOW]
    )
    start = time.perf_counter()
    ledger.commit(ledger.reserve(overlapping, MECHANISM))
    timed["overlapping"] = time.perf_counter() - start
    ledger.close()
    print(f"  {backend} {size}: {timed} against COPY {copy:.3f} s", file=sys.stderr)
    label = f"{backend}, {size:.0e} subjects"
    baseline = "COPY of the ids s" if backend == "PostgreSQL" else "one INSERT txn of the ids s"
    return [
        (f"{label}: build the keys", timed["keys"], "s", copy, baseline, timed["keys"] / copy,
         "(info)"),
        (f"{label}: first release (register the cohort, reserve, commit)", timed["first"],
         "s", copy, baseline, timed["first"] / copy, "<= 3"),
        (f"{label}: the same release again (cohort handle)", timed["repeated"], "s", copy,
         baseline, timed["repeated"] / copy, "<= 0.05"),
        (f"{label}: the same release again (list of keys)", timed["repeated keys"], "s", copy,
         baseline, timed["repeated keys"] / copy, "(info)"),
        (f"{label}: budget_check over the cohort (handle)", timed["check"], "s", copy,
         baseline, timed["check"] / copy, "<= 0.1"),
        (f"{label}: budget_check over the cohort (list of keys)", timed["check keys"], "s",
         copy, baseline, timed["check keys"] / copy, "(info)"),
        (f"{label}: a release over keys half of which the cohort holds (split + new)",
         timed["overlapping"], "s", copy, baseline, timed["overlapping"] / copy, "(info)"),
        (f"{label}: verify after {VERIFIED_RELEASES} releases over the cohort", timed["verify"],
         "s", copy, baseline, timed["verify"] / copy, "<= 1"),
        (f"{label}: verify's peak RSS", timed["verify MiB"], "MiB", 256, "the goal's bound MiB",
         timed["verify MiB"] / 256, "<= 1"),
        (f"{label}: rows written by the repeated release", timed["repeated rows"], "rows",
         size, "subjects", timed["repeated rows"] / size, "O(1)"),
    ]  # fmt: skip


def bench_cohort(pg_size: int, sqlite_size: int) -> list[tuple]:
    rows = []
    with scratch_database("dpb_bench_cohort") as (_name, url):
        rows += _cohort_rows("PostgreSQL", pg_size, url)
    with tempfile.TemporaryDirectory() as tmp:
        rows += _cohort_rows("SQLite", sqlite_size, f"sqlite:///{Path(tmp) / 'ledger.db'}")
    return rows


def _scoped_ledger(url: str, scoped: bool) -> PrivacyBudgetLedger:
    """A ledger with only the default cap, or also caps across query types and windows."""
    admin = AdminKey.generate()
    ledger = PrivacyBudgetLedger(cap=CAP, url=url, admin=admin)
    if scoped:
        ledger.set_policy(Policy(CAP.epsilon, across="query_types"))
        ledger.set_policy(Policy(CAP.epsilon, across="windows", horizon_windows=52))
    return ledger


def bench_scopes(size: int, repeats: int = 5) -> list[tuple]:
    """A cohort release charged to three scopes against the same release charged to one."""
    subjects = [f"cohort-subject-{i:07d}" for i in range(size)]
    timed: dict[str, list[float]] = {"first": [], "first base": [], "again": [], "again base": []}
    with (
        scratch_database("dpb_bench_scopes") as (_a, scoped_url),
        scratch_database("dpb_bench_scope1") as (_b, base_url),
    ):
        ledgers = {True: _scoped_ledger(scoped_url, True), False: _scoped_ledger(base_url, False)}
        covered = {}
        for scoped in (False, True):  # each ledger registers the cohort in its first release
            ledger = ledgers[scoped]
            start = time.perf_counter()
            covered[scoped] = ledger.cohort(subjects).in_window("count", WINDOW)
            ledger.commit(ledger.reserve(covered[scoped], MECHANISM))
            timed["first" if scoped else "first base"].append(time.perf_counter() - start)
        rows_before = _rows(ledgers[True])
        for _ in range(repeats):
            for scoped in (False, True):
                ledger = ledgers[scoped]
                start = time.perf_counter()
                ledger.commit(ledger.reserve(covered[scoped], MECHANISM))
                timed["again" if scoped else "again base"].append(time.perf_counter() - start)
        rows_written = (_rows(ledgers[True]) - rows_before) / repeats
        accounts = len(ledgers[True].accounts(subject=subjects[0]))
        for ledger in ledgers.values():
            ledger.close()
    print(f"  scopes {size}: {timed}", file=sys.stderr)
    first, first_base = timed["first"][0], timed["first base"][0]
    again, again_base = statistics.median(timed["again"]), statistics.median(timed["again base"])
    label = f"PostgreSQL, {size:.0e} subjects, three scopes ({accounts} accounts per subject)"
    return [
        (f"{label}: first release (register the cohort, reserve, commit)", first, "s",
         first_base, "the same on one scope s", first / first_base, "<= 1.5"),
        (f"{label}: the same release again (median of {repeats})", again, "s", again_base,
         "the same on one scope s", again / again_base, "<= 1.5"),
        (f"{label}: rows written by a repeat", rows_written, "rows", size, "subjects",
         rows_written / size, "O(1)"),
    ]  # fmt: skip


def bench_sqlite(duration: float) -> list[tuple]:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'ledger.db'}"
        ledger = PrivacyBudgetLedger(cap=CAP, url=url)
        keys = [key_for(f"embedded-{i}", "count", WINDOW) for i in range(4)]
        ledger.spend(keys[0], MECHANISM)
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < duration:
            ledger.spend(keys[done % len(keys)], MECHANISM)
            done += 1
        ours = done / (time.perf_counter() - start)
        ledger.close()

        raw = sqlite3.connect(Path(tmp) / "raw.db", isolation_level=None)
        for pragma in ("journal_mode=WAL", "busy_timeout=60000", "synchronous=FULL"):
            raw.execute(f"PRAGMA {pragma}")
        raw.execute("CREATE TABLE account (id INTEGER PRIMARY KEY, rho REAL, releases INTEGER)")
        raw.execute("CREATE TABLE history (seq INTEGER PRIMARY KEY, account INTEGER, rho REAL)")
        raw.executemany("INSERT INTO account VALUES (?, 0.0, 0)", [(i,) for i in range(4)])
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < duration:
            account = done % 4
            raw.execute("BEGIN IMMEDIATE")
            raw.execute("SELECT rho, releases FROM account WHERE id = ?", (account,)).fetchone()
            raw.execute(
                "UPDATE account SET rho = rho + ?, releases = releases + 1 WHERE id = ?",
                (MECHANISM.zcdp_rho, account),
            )
            raw.execute(
                "INSERT INTO history (account, rho) VALUES (?, ?)", (account, MECHANISM.zcdp_rho)
            )
            raw.execute("COMMIT")
            done += 1
        base = done / (time.perf_counter() - start)
        raw.close()
    return [
        (
            "embedded SQLite, spend, 1 process",
            ours,
            "releases/s",
            base,
            "raw sqlite3 txn/s",
            ours / base,
            "(info)",
        ),
    ]


def print_table(rows: list[tuple]) -> None:
    print()
    print("| benchmark | ours | unit | baseline | baseline is | ratio | goal |")
    print("|---|---|---|---|---|---|---|")
    for name, ours, unit, base, base_name, ratio, goal in rows:
        print(f"| {name} | {ours:.4g} | {unit} | {base:.4g} | {base_name} | {ratio:.3g} | {goal} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per throughput run")
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternating runs of ours and the baseline"
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=["hot", "distinct", "pipeline", "sqlite", "cohort", "scopes"],
        help="run only this benchmark (repeatable; default: all)",
    )
    parser.add_argument(
        "--cohort-size",
        type=int,
        default=10**6,
        help="subjects of the cohort benchmark on PostgreSQL (SQLite: a tenth)",
    )
    arguments = parser.parse_args()
    duration, rounds = arguments.duration, arguments.rounds
    benchmarks = {
        "hot": ("hot key", lambda: bench_hot_key(duration, rounds)),
        "distinct": ("distinct keys", lambda: bench_distinct_keys(duration, rounds)),
        "pipeline": ("deferred writes", lambda: bench_pipeline(duration, rounds)),
        "sqlite": ("embedded SQLite", lambda: bench_sqlite(duration)),
        "cohort": (
            "cohort releases",
            lambda: bench_cohort(arguments.cohort_size, arguments.cohort_size // 10),
        ),
        "scopes": (
            "cohort releases under three scopes",
            lambda: bench_scopes(arguments.cohort_size),
        ),
    }
    rows: list[tuple] = []
    for title, run in (benchmarks[name] for name in arguments.only or benchmarks):
        print(f"running: {title}", file=sys.stderr)
        start = time.perf_counter()
        rows += run()
        print(f"  done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(
        f"{PROCESSES} processes, {os.cpu_count()} cores, {duration:g} s per throughput run, "
        f"{rounds} rounds of ours and the baseline alternating (median ratio; each pair "
        "ours/baseline in the name)"
    )
    print_table(rows)


if __name__ == "__main__":
    main()
