"""Benchmarks of the ledger's audit (``verify``) on a long history, and of one release there.

Run: ``.venv/bin/python bench/verify.py`` (PostgreSQL at ``DP_BUDGET_TEST_PG``, by
default ``host=127.0.0.1 port=5432 user=postgres``). ``--rows`` sets the history's length
(default 10^6; e.g. ``--rows 20000`` for a quick run), ``--keys`` the subjects it is
spread over (default 10^4), ``--workers`` the processes that write it (default 2, one per
core), ``--rounds`` how many times the release benchmarks alternate a baseline and ours
(default 5). ``--only NAME`` (repeatable) runs only the named benchmarks.

Every benchmark measures its baseline in the same run, on the same server and the same
database, and prints the ratio. The run creates its own scratch database and drops it
afterwards; nothing is cached.

The history is written through the public API only (``spend``, ``reserve`` + ``commit``
or ``release``, ``correct``), since its chain and payloads are the ledger's own business
and change with it: ``--workers`` processes, each on its own subjects, run a mix of
one-key Gaussian releases, one in ten Laplace (a curve that is not zCDP-linear), one in
``--cohort-every`` (default 100) over a cohort of ``--cohort`` subjects (default 100;
each writes that many reservation key rows, which verify replays too), one in fifty
reserved then released, one in a thousand a correction, and each leaves one reservation
open for the audit to find. Each release writes two history rows (reserve, commit)
whatever its number of keys, so 10^6 rows take 5 * 10^5 releases: at the ledger's 80-150
operations/s on this 2-core machine (each costs 4-8 ms of client CPU, plus the server's)
that fill dominates the run, one to two hours for 10^6 rows. A history of 10^6 rows of
both kinds fills in minutes with larger cohorts (e.g. ``--rows 100000 --cohort 200
--cohort-every 10``: 10^5 entries and 10^6 key rows). Every release over wide plain key lists
(``--keys 2000 --cohort 400 --cohort-every 1``: each list a cohort of its own, listed
with up to 400 accounts of its window) is the shape whose replayed listings grow with
the key rows: verify keeps them in a scratch file, so its memory should not. The fill runs with
``synchronous_commit = off`` on the scratch database (the same rows, only not flushed
per commit), reset to the server's default before anything is measured. This server runs
with ``autovacuum = off``, so the fill vacuums and analyses the database as autovacuum
would (each time it has grown by a tenth, and at the end).

Each memory figure is the peak RSS of a fresh child process that does one thing, reads
its own ``VmHWM`` (``/proc/self/status``) and exits. (Not ``ru_maxrss``: Linux carries a
child's peak across fork and exec, so every child would report at least this process's.)

* verify: opens the ledger and runs ``verify()`` (which must report ``ok``), vs a child
  that streams ``dp_history`` and ``dp_reservation_keys`` through server-side cursors
  and discards the rows (what a streaming audit needs at least). Also shown: verify's memory
  above a child that only opens the ledger, vs the raw rows' memory (a child that fetches
  them whole with a client-side cursor, above the streaming one).
* verify time: the wall time of ``verify()`` in its child vs the stream's.
* release, 1 key and 10^4 keys: ``reserve`` + ``commit`` on the long ledger (on keys it
  already holds), vs the same transaction shape in raw SQL on tables of the same sizes
  in the same database: reserve = BEGIN + share-lock the window rows; upsert and lock
  the accounts (pending spend +); insert the reservation and its keys, link a history
  entry on its chain (sha256 in the server) + COMMIT; commit = BEGIN + lock the
  reservation; lock its accounts through its key rows; charge them, close it, link an
  entry + COMMIT. No accounting, validation or JSON decoding.

Ratios of the release times are medians over rounds, each of ours against the baseline
run just before it. The CPU is shared with whatever else runs: run nothing meanwhile.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import queue
import random
import statistics
import subprocess
import sys
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg2

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.ledger_time import this_week  # noqa: E402
from tests.scratch_postgres import PG_ADMIN_DSN, dsn_part, scratch_database  # noqa: E402

# The current week: a past one takes no new release once its grace period is over.
WINDOW = this_week()
QUERY_TYPE = "count"
MANY = 10**4
SINGLE_PER_ROUND = 20  # one-key releases per round (each timed on its own)
STREAM_BATCH = 5000
SPAWN = multiprocessing.get_context("spawn")


def subject(index: int) -> str:
    return f"subject-{index:06d}"


def connect(database: str) -> psycopg2.extensions.connection:
    return psycopg2.connect(
        host=dsn_part("host"), port=dsn_part("port"), user=dsn_part("user"), dbname=database
    )


def admin(statement: str) -> None:
    """One statement on the admin connection, outside any transaction."""
    connection = psycopg2.connect(PG_ADMIN_DSN)
    connection.autocommit = True
    with connection.cursor() as cursor:
        cursor.execute(statement)
    connection.close()


def scalar(database: str, query: str) -> Any:
    with connect(database) as connection, connection.cursor() as cursor:
        cursor.execute(query)
        value = cursor.fetchone()[0]
    connection.close()
    return value


def mib(kib: float) -> float:
    return kib / 1024.0


# ---------------------------------------------------------------------------- the ledger


def ledger_objects() -> dict[str, Any]:
    """The package's objects, imported late: the streaming child never imports them."""
    from dp_budget_provider.accounting import GaussianMechanism, LaplaceMechanism
    from dp_budget_provider.ledger import BudgetCap, PrivacyBudgetLedger, key_for

    return {
        "ledger": PrivacyBudgetLedger,
        "key": lambda index: key_for(subject(index), QUERY_TYPE, WINDOW),
        # A cap no release reaches, and tiny costs: nothing is ever refused.
        "cap": BudgetCap(epsilon=1e9, delta=1e-5),
        "gaussian": GaussianMechanism(1000.0),
        "laplace": LaplaceMechanism(1e-4),
    }


def fill_worker(
    url: str,
    worker: int,
    workers: int,
    keys: int,
    cohort: tuple[int, int],
    quota: int,
    done,
    results,
) -> None:
    """Write ``quota`` history rows through the public API on this worker's own subjects;
    ``cohort`` = (size, every): one release in ``every`` is over ``size`` of them."""
    objects = ledger_objects()
    ledger = objects["ledger"](url=url)
    gaussian, laplace = objects["gaussian"], objects["laplace"]
    own = [objects["key"](i) for i in range(worker, keys, workers)]
    rng = random.Random(worker)
    rows = step = 0
    start = time.perf_counter()
    while rows < quota - 1:  # the last row: a reservation left open
        attempt = f"bench/verify/w{worker}/{step}"
        mechanism = laplace if step % 10 == 3 else gaussian
        if step % cohort[1] == cohort[1] - 1:
            members = rng.sample(own, min(cohort[0], len(own)))
            ledger.commit(ledger.reserve(members, gaussian, attempt=attempt))
            rows += 2
        elif step % 50 == 25:
            reservation = ledger.reserve(rng.choice(own), mechanism, attempt=attempt)
            ledger.release(reservation, reason="the task failed before it read the data")
            rows += 2
        elif step % 1000 == 500:
            ledger.correct(rng.choice(own), mechanism, reason="a release the ledger missed")
            rows += 1
        else:
            ledger.spend(rng.choice(own), mechanism, attempt=attempt)
            rows += 2
        step += 1
        if step % 100 == 0:
            with done.get_lock():
                done.value += 100
    ledger.reserve(rng.choice(own), gaussian, attempt=f"bench/verify/w{worker}/open")
    results.put((worker, step + 1, rows + 1, time.perf_counter() - start))
    ledger.close()


def fill(
    name: str, url: str, rows: int, keys: int, workers: int, cohort: tuple[int, int]
) -> dict[str, float]:
    """A ledger of ``rows`` history rows over ``keys`` subjects, written by ``workers``.

    Vacuums and analyses the database each time the operations grow by a tenth (and at
    the end), as autovacuum would: this server runs with ``autovacuum = off``, and
    without statistics a commit's account lock plans a sequential scan over every
    account (42 ms a commit at 10^4 accounts), which no production ledger would see.
    """
    objects = ledger_objects()
    admin(f'ALTER DATABASE "{name}" SET synchronous_commit = off')
    objects["ledger"](cap=objects["cap"], url=url).close()
    opening = scalar(name, "SELECT count(*) FROM dp_history")
    share, extra = divmod(max(rows - opening, workers * 2), workers)
    done, results = SPAWN.Value("q", 0), SPAWN.Queue()
    processes = [
        SPAWN.Process(
            target=fill_worker,
            args=(url, w, workers, keys, cohort, share + (w < extra), done, results),
        )
        for w in range(workers)
    ]
    maintenance = connect(name)
    maintenance.autocommit = True
    vacuums = {"count": 0, "seconds": 0.0, "at": 0}

    def vacuum() -> None:
        began = time.perf_counter()
        with maintenance.cursor() as cursor:
            cursor.execute("VACUUM (ANALYZE)")
        vacuums["count"] += 1
        vacuums["seconds"] += time.perf_counter() - began

    start = last_report = time.perf_counter()
    for process in processes:
        process.start()
    reports = []
    while len(reports) < workers:
        try:
            reports.append(results.get(timeout=10))
            continue
        except queue.Empty:
            pass
        # A worker's report is in the queue before it exits: an exit without one failed.
        exits = [process.exitcode for process in processes]
        if any(code not in (None, 0) for code in exits) or None not in exits:
            raise RuntimeError(f"a fill worker died (exit codes {exits})")
        operations = done.value
        if operations - vacuums["at"] >= max(1000, vacuums["at"] // 10):
            vacuums["at"] = operations
            vacuum()
        if time.perf_counter() - last_report >= 60:
            last_report = time.perf_counter()
            elapsed = last_report - start
            left = (rows / 2 - operations) / max(operations / elapsed, 1e-9)
            print(
                f"  fill: {operations} operations in {elapsed:.0f} s "
                f"({operations / elapsed:.0f}/s, about {max(left, 0):.0f} s to go; "
                f"{vacuums['count']} VACUUM ANALYZE, {vacuums['seconds']:.0f} s)",
                file=sys.stderr,
            )
    for process in processes:
        process.join()
    elapsed = time.perf_counter() - start
    admin(f'ALTER DATABASE "{name}" RESET synchronous_commit')
    vacuum()
    maintenance.close()
    operations = sum(report[1] for report in reports)
    print(
        f"  fill: {operations} operations, {sum(r[2] for r in reports)} rows in {elapsed:.0f} s "
        f"({operations / elapsed:.0f} operations/s); {vacuums['count']} VACUUM ANALYZE, "
        f"{vacuums['seconds']:.0f} s in all",
        file=sys.stderr,
    )
    return {"seconds": elapsed, "operations": operations}


# ---------------------------------------------------------------------------- children


def peak_kib_reported() -> int:
    """This process's peak RSS as the kernel reports it (VmHWM, KiB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


# What a streaming audit must read at least: the history and its reservations' key rows.
RAW_READS = (
    "SELECT * FROM dp_history ORDER BY seq",
    "SELECT * FROM dp_reservation_keys ORDER BY reservation_id, position",
)


def child_main(mode: str, database: str) -> None:
    """One measurement in this fresh process; prints its result as one JSON line."""
    result: dict[str, Any] = {}
    if mode in ("stream", "fetchall"):
        connection = connect(database)
        start = time.perf_counter()
        rows = 0
        for number, query in enumerate(RAW_READS):
            if mode == "stream":
                cursor = connection.cursor(name=f"bench_stream_{number}")  # server-side
                cursor.itersize = STREAM_BATCH
                cursor.execute(query)
                count = sum(1 for _ in cursor)
            else:
                cursor = connection.cursor()
                cursor.execute(query)
                held = cursor.fetchall()
                count = len(held)
            rows = rows or count  # the history's entries (the first read)
            cursor.close()
        result["seconds"] = time.perf_counter() - start
        result["rows"] = rows
        connection.close()
    else:
        import dp_budget_provider
        from tests.scratch_postgres import url_of

        result["package"] = dp_budget_provider.__file__
        ledger = ledger_objects()["ledger"](url=url_of(database))
        if mode == "verify":
            start = time.perf_counter()
            report = ledger.verify()
            result["seconds"] = time.perf_counter() - start
            result["ok"] = report.ok
            result["entries"] = report.entries
            result["accounts"] = report.accounts
            result["problems"] = report.problems[:10]
        ledger.close()
    result["vmhwm_kib"] = peak_kib_reported()
    print(json.dumps(result), flush=True)


def child(mode: str, database: str) -> dict[str, Any]:
    """Run one measurement in a fresh process and return what it reported."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--database", database],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {mode} child failed (exit {done.returncode}):\n{done.stderr}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"  {mode}: peak RSS {mib(result['vmhwm_kib']):.1f} MiB"
        + (f", {result['seconds']:.2f} s" if "seconds" in result else ""),
        file=sys.stderr,
    )
    return result


# ---------------------------------------------------------------------------- benchmarks


def bench_verify(name: str) -> list[tuple]:
    child("stream", name)  # warm: every later reader finds the table in memory
    stream = child("stream", name)
    fetched = child("fetchall", name)
    opened = child("open", name)
    verified = child("verify", name)
    if not verified["ok"]:
        raise AssertionError(f"verify found problems on a healthy ledger: {verified['problems']}")
    assert verified["entries"] == stream["rows"], (verified["entries"], stream["rows"])
    print(f"  verify's package: {verified['package']}", file=sys.stderr)
    key_rows = scalar(name, "SELECT count(*) FROM dp_reservation_keys")
    verify_rss, stream_rss = verified["vmhwm_kib"], stream["vmhwm_kib"]
    above_open = verify_rss - opened["vmhwm_kib"]
    raw_rows = fetched["vmhwm_kib"] - stream_rss
    return [
        (
            f"verify peak RSS ({verified['entries']} entries, {key_rows} reservation key rows, "
            f"{verified['accounts']} accounts)",
            mib(verify_rss),
            "MiB",
            mib(stream_rss),
            "stream history and key rows, server-side cursors, MiB",
            verify_rss / stream_rss,
            "(info)",
        ),
        (
            f"verify RSS above opening the ledger ({mib(opened['vmhwm_kib']):.0f} MiB)",
            mib(above_open),
            "MiB",
            mib(raw_rows),
            f"rows fetched whole, above streaming ({mib(fetched['vmhwm_kib']):.0f} MiB)",
            above_open / max(raw_rows, 1),
            "(info)",
        ),
        (
            "verify time",
            verified["seconds"],
            "s",
            stream["seconds"],
            "stream history and key rows s",
            verified["seconds"] / stream["seconds"],
            "(info)",
        ),
    ]


RAW_TABLES = """
CREATE TABLE raw_windows (tenant text, query_type text, "window" text, sealed_at text,
    PRIMARY KEY (tenant, query_type, "window"));
CREATE TABLE raw_accounts (id bigserial PRIMARY KEY, tenant text NOT NULL,
    subject text NOT NULL, query_type text NOT NULL, "window" text NOT NULL,
    rho float8 NOT NULL, pending_rho float8 NOT NULL, open_reservations integer NOT NULL,
    releases bigint NOT NULL, updated_at text NOT NULL,
    UNIQUE (tenant, subject, query_type, "window"));
CREATE TABLE raw_reservations (id text PRIMARY KEY, attempt_id text UNIQUE NOT NULL,
    state text NOT NULL, cost_rho float8 NOT NULL, key_count integer NOT NULL,
    keys_digest text NOT NULL, created_at text NOT NULL, resolved_at text);
CREATE TABLE raw_reservation_keys (reservation_id text, position integer, tenant text,
    subject text, query_type text, "window" text, PRIMARY KEY (reservation_id, position));
CREATE INDEX ON raw_reservation_keys (tenant, subject, query_type, "window");
CREATE TABLE raw_history (seq bigint PRIMARY KEY, chain integer NOT NULL,
    payload text NOT NULL, prev_hash text NOT NULL, hash text NOT NULL);
CREATE TABLE raw_chain_head (id integer PRIMARY KEY, seq bigint NOT NULL, hash text NOT NULL);
CREATE SEQUENCE raw_seq;
"""

RAW_APPEND = """WITH head AS (
    SELECT hash FROM raw_chain_head WHERE id = %(chain)s FOR UPDATE
), entry AS (
    INSERT INTO raw_history (seq, chain, payload, prev_hash, hash)
    SELECT n.seq, %(chain)s, %(payload)s, head.hash,
           encode(sha256(convert_to(head.hash || E'\\n' || %(payload)s || n.seq, 'UTF8')), 'hex')
    FROM head, (SELECT nextval('raw_seq') AS seq) AS n
    RETURNING seq, hash
)
UPDATE raw_chain_head SET seq = entry.seq, hash = entry.hash FROM entry
WHERE raw_chain_head.id = %(chain)s"""

RAW_LOCK_WINDOWS = """BEGIN; SELECT sealed_at FROM raw_windows
WHERE (tenant, query_type, "window") IN (SELECT * FROM unnest(%(t)s::text[], %(q)s::text[],
    %(w)s::text[])) FOR SHARE"""

RAW_UPSERT = """INSERT INTO raw_accounts AS a (tenant, subject, query_type, "window", rho,
    pending_rho, open_reservations, releases, updated_at)
SELECT t, s, q, w, 0, %(cost)s, 1, 0, %(now)s
FROM unnest(%(tenants)s::text[], %(subjects)s::text[], %(query_types)s::text[],
    %(windows)s::text[]) AS u(t, s, q, w)
ORDER BY t, s, q, w
ON CONFLICT (tenant, subject, query_type, "window") DO UPDATE
SET open_reservations = a.open_reservations + 1,
    pending_rho = a.pending_rho + EXCLUDED.pending_rho, updated_at = EXCLUDED.updated_at
RETURNING a.id, a.rho, a.pending_rho"""

RAW_RESERVE_WRITES = """INSERT INTO raw_reservations VALUES (%(rid)s, %(attempt)s, 'open',
    %(cost)s, %(count)s, %(digest)s, %(now)s, NULL);
INSERT INTO raw_reservation_keys
SELECT %(rid)s, n - 1, t, s, q, w
FROM unnest(%(tenants)s::text[], %(subjects)s::text[], %(query_types)s::text[],
    %(windows)s::text[]) WITH ORDINALITY AS u(t, s, q, w, n);
"""

RAW_LOCK_RESERVATION = (
    "BEGIN; SELECT state, cost_rho, key_count FROM raw_reservations WHERE id = %(rid)s FOR UPDATE"
)

RAW_LOCK_ACCOUNTS = """SELECT a.id, a.rho, a.pending_rho, a.open_reservations
FROM raw_reservation_keys k JOIN raw_accounts a USING (tenant, subject, query_type, "window")
WHERE k.reservation_id = %(rid)s
ORDER BY a.tenant, a.subject, a.query_type, a."window" FOR UPDATE OF a"""

RAW_COMMIT_WRITES = """UPDATE raw_accounts SET rho = rho + %(cost)s, releases = releases + 1,
    open_reservations = open_reservations - 1,
    pending_rho = CASE WHEN open_reservations = 1 THEN 0 ELSE pending_rho - %(cost)s END,
    updated_at = %(now)s
WHERE id = ANY(%(ids)s);
UPDATE raw_reservations SET state = 'committed', resolved_at = %(now)s WHERE id = %(rid)s;
"""


class RawLedger:
    """The ledger's reserve + commit transaction shape in raw SQL (psycopg2, autocommit
    off by hand: BEGIN rides on the first statement, COMMIT on the last, as the ledger's
    pipeline does), on tables as large as the ledger's."""

    def __init__(self, database: str, history_rows: int, reservations: int) -> None:
        self.connection = connect(database)
        self.connection.autocommit = True
        self.cursor = self.connection.cursor()
        self.cursor.execute(RAW_TABLES)
        # As many rows as the ledger's tables, each as wide as an average history row.
        width = scalar(database, "SELECT avg(pg_column_size(h.*))::int FROM dp_history h")
        self.cursor.execute(
            "INSERT INTO raw_history SELECT i, i %% 64 + 1, repeat('x', %s), md5(i::text) || "
            "md5(i::text), md5(i::text) || md5(i::text) FROM generate_series(1, %s) AS i",
            (max(width - 160, 1), history_rows),
        )
        self.cursor.execute(
            "INSERT INTO raw_chain_head SELECT c, 0, repeat('0', 64) FROM generate_series(1, 64) "
            "AS c"
        )
        self.cursor.execute("SELECT setval('raw_seq', %s)", (history_rows,))
        self.cursor.execute(
            "INSERT INTO raw_reservations SELECT 'seed-' || i, 'seed-attempt-' || i, 'committed', "
            "0, 1, md5(i::text), '', '' FROM generate_series(1, %s) AS i",
            (reservations,),
        )
        self.cursor.execute(
            "INSERT INTO raw_reservation_keys SELECT 'seed-' || i, 0, 'default', 'seed-' || i, "
            "%s, %s FROM generate_series(1, %s) AS i",
            (QUERY_TYPE, WINDOW, reservations),
        )
        self.cursor.execute(
            "INSERT INTO raw_windows VALUES ('default', %s, %s, NULL)", (QUERY_TYPE, WINDOW)
        )
        self.cursor.execute("VACUUM ANALYZE")

    def release(self, subjects: list[str], cost: float) -> None:
        """One reserve + commit on ``subjects`` (tenant 'default', one window)."""
        now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
        count = len(subjects)
        keys = {
            "tenants": ["default"] * count,
            "subjects": subjects,
            "query_types": [QUERY_TYPE] * count,
            "windows": [WINDOW] * count,
        }
        rid = str(uuid.uuid4())
        attempt = f"raw/{rid}"
        digest = hashlib.sha256("\n".join(subjects).encode()).hexdigest()
        chain = zlib.crc32(subjects[0].encode()) % 64 + 1
        cursor = self.cursor
        cursor.execute(RAW_LOCK_WINDOWS, {"t": ["default"], "q": [QUERY_TYPE], "w": [WINDOW]})
        cursor.fetchall()
        cursor.execute(RAW_UPSERT, {**keys, "cost": cost, "now": now})
        accounts = cursor.fetchall()
        if max(rho + pending for _, rho, pending in accounts) > 1e9:
            raise RuntimeError("over the cap")
        payload = {"attempt_id": attempt, "cost": {"rho": cost}, "count": 1}
        payload.update(key_count=count, keys_digest=digest)
        params = {
            **keys,
            "rid": rid,
            "attempt": attempt,
            "cost": cost,
            "count": count,
            "digest": digest,
            "now": now,
            "chain": chain,
            "payload": json.dumps({**payload, "prospective_epsilon": 0.0}),
        }
        cursor.execute(RAW_RESERVE_WRITES + RAW_APPEND + "; COMMIT", params)
        cursor.execute(RAW_LOCK_RESERVATION, {"rid": rid})
        state, cost_rho, key_count = cursor.fetchone()
        cursor.execute(RAW_LOCK_ACCOUNTS, {"rid": rid})
        ids = [row[0] for row in cursor.fetchall()]
        if state != "open" or len(ids) != key_count:
            raise RuntimeError("raw reservation not open or keys missing")
        cursor.execute(
            RAW_COMMIT_WRITES + RAW_APPEND + "; COMMIT",
            {**params, "cost": cost_rho, "ids": ids, "payload": json.dumps(payload)},
        )

    def close(self) -> None:
        self.cursor.close()
        self.connection.close()


def interleaved(rounds: int, ours: Callable[[], float], base: Callable[[], float]) -> tuple:
    """Medians of ``rounds`` alternating runs (baseline first), and the median pair ratio."""
    pairs = []
    for _ in range(rounds):
        base_value = base()
        pairs.append((ours(), base_value))
    return (
        statistics.median(o for o, _ in pairs),
        statistics.median(b for _, b in pairs),
        statistics.median(o / b for o, b in pairs),
        pairs,
    )


def bench_release(name: str, url: str, rounds: int) -> list[tuple]:
    objects = ledger_objects()
    ledger = objects["ledger"](url=url)
    gaussian = objects["gaussian"]
    cost = gaussian.zcdp_rho
    one_key, many_keys = [objects["key"](0)], [objects["key"](i) for i in range(MANY)]
    many_subjects = [subject(i) for i in range(MANY)]
    # Every account exists before anything is timed (the fill may have had fewer keys).
    ledger.commit(ledger.reserve(many_keys, gaussian))
    history_rows = scalar(name, "SELECT count(*) FROM dp_history")
    reservations = scalar(name, "SELECT count(*) FROM dp_reservations")
    raw = RawLedger(name, history_rows, reservations)
    raw.release(many_subjects, cost)
    split: dict[str, list[tuple[float, float]]] = {"one": [], "many": []}

    def ours(keys: list, label: str) -> float:
        start = time.perf_counter()
        reservation = ledger.reserve(keys, gaussian)
        reserved = time.perf_counter()
        ledger.commit(reservation)
        committed = time.perf_counter()
        split[label].append((reserved - start, committed - reserved))
        return committed - start

    def raw_release(subjects: list[str]) -> float:
        start = time.perf_counter()
        raw.release(subjects, cost)
        return time.perf_counter() - start

    def median_of(run: Callable[[], float]) -> float:
        return statistics.median(run() for _ in range(SINGLE_PER_ROUND))

    ledger.commit(ledger.reserve(one_key, gaussian))
    raw.release([subject(0)], cost)
    one = interleaved(
        rounds,
        lambda: median_of(lambda: ours(one_key, "one")),
        lambda: median_of(lambda: raw_release([subject(0)])),
    )
    many = interleaved(rounds, lambda: ours(many_keys, "many"), lambda: raw_release(many_subjects))
    ledger.close()
    raw.close()
    rows = []
    for label, size, result in (("one", 1, one), ("many", MANY, many)):
        ours_s, base_s, ratio, pairs = result
        reserve = statistics.median(r for r, _ in split[label])
        commit = statistics.median(c for _, c in split[label])
        each = f"median of {SINGLE_PER_ROUND} per round, " if size == 1 else ""
        rows.append(
            (
                f"release on {size} key{'s' if size > 1 else ''}: reserve {reserve * 1e3:.1f} ms "
                f"+ commit {commit * 1e3:.1f} ms ({each}median of {rounds} rounds: "
                + ", ".join(f"{o * 1e3:.1f}/{b * 1e3:.1f}" for o, b in pairs)
                + " ms)",
                ours_s * 1e3,
                "ms per release",
                base_s * 1e3,
                "raw SQL reserve + commit ms",
                ratio,
                "(info)",
            )
        )
    return rows


def revision() -> str:
    done = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty", "--abbrev=40"],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10**6, help="history rows (default 10^6)")
    parser.add_argument("--keys", type=int, default=10**4, help="subjects the history is over")
    parser.add_argument("--cohort", type=int, default=100, help="subjects of a cohort release")
    parser.add_argument(
        "--cohort-every", type=int, default=100, help="one release in this many is a cohort's"
    )
    parser.add_argument("--workers", type=int, default=2, help="processes writing the history")
    parser.add_argument(
        "--rounds", type=int, default=5, help="alternating runs of ours and the baseline"
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=["verify", "release"],
        help="run only this benchmark (repeatable; default: all)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--database", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child:
        child_main(arguments.child, arguments.database)
        return
    import dp_budget_provider

    started = time.perf_counter()
    print(f"package: {dp_budget_provider.__file__} at {revision()}", file=sys.stderr)
    only = arguments.only or ["verify", "release"]
    rows: list[tuple] = []
    with scratch_database("dpb_bench_verify") as (name, url):
        print(f"filling: {arguments.rows} history rows", file=sys.stderr)
        cohort = (arguments.cohort, arguments.cohort_every)
        filled = fill(name, url, arguments.rows, arguments.keys, arguments.workers, cohort)
        benchmarks = {
            "verify": ("verify", lambda: bench_verify(name)),
            "release": ("release", lambda: bench_release(name, url, arguments.rounds)),
        }
        for title, run in (benchmarks[key] for key in only):
            print(f"running: {title}", file=sys.stderr)
            start = time.perf_counter()
            rows += run()
            print(f"  done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(
        f"package {dp_budget_provider.__file__} at {revision()}; {arguments.rows} history rows "
        f"over {arguments.keys} subjects (one release in {arguments.cohort_every} over "
        f"{arguments.cohort}), written by {arguments.workers} processes in "
        f"{filled['seconds']:.0f} s ({filled['operations'] / filled['seconds']:.0f} "
        f"operations/s); {os.cpu_count()} cores; whole run {time.perf_counter() - started:.0f} s"
    )
    from bench.ledger import print_table  # the children need none of it

    print_table(rows)


if __name__ == "__main__":
    main()
