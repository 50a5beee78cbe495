"""What a Python client can reach with the ledger's transaction shapes, without the ledger.

Run: ``.venv/bin/python bench/ledger_ceiling.py`` (``--duration`` seconds per run,
default 5; PostgreSQL at ``DP_BUDGET_TEST_PG``; ``pgbench`` on the PATH).

``bench/ledger.py`` compares the ledger with pgbench. This benchmark separates what the
design costs from what the implementation costs: 8 processes run bare psycopg2 loops of
the same transaction *shapes* on the same machine, with no accounting, no validation and
no JSON, against a one-row "accounts" table, a reservations table and a hash-chained
history like the ledger's:

* ``python-pgbench``: the pgbench hot-row script itself from Python (client overhead);
* ``two-phase, client-side``: reserve (lock, client decides, write + link + commit: 2
  round trips) and commit (lock, write + link + commit: 2 round trips), the hash linked
  by the server (``dp_append``-like), i.e. the ledger's reserve and a client-side commit;
* ``two-phase, server commit``: the same reserve, commit as one server function call,
  i.e. the shape the ledger uses on PostgreSQL;
* ``optimistic server reserve``: the client decides on the account state it last saw and
  the server applies the reservation only if the locked row still holds that state
  (else it answers with the current state and the client decides again); commit as one
  server call. No lock is held across a round trip. The ledger does not have this shape.
* ``all server-side``: reserve and commit each one server function call (the check made
  by the server), a shape the ledger does not have.
* ``two-phase, server commit, 8 chains``: the ledger's shape with the history split into
  8 hash chains by key, so writers on different keys rarely share a chain head.

Hot = all processes on one key; distinct = one key per process. Ratios are against the
pgbench baselines of bench/ledger.py measured in the same run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.ledger import HOT_SCRIPT, PROCESSES, connect, pgbench, pgbench_tps  # noqa: E402
from tests.scratch_postgres import scratch_database  # noqa: E402

SCHEMA = r"""
CREATE TABLE acc (id serial PRIMARY KEY, k text UNIQUE, rho float8 NOT NULL DEFAULT 0,
                  pending float8 NOT NULL DEFAULT 0, open int NOT NULL DEFAULT 0);
CREATE TABLE res (id text PRIMARY KEY, attempt text UNIQUE, state text, cost float8, k text);
CREATE TABLE hist (seq int PRIMARY KEY, payload text, prev text, hash text);
CREATE TABLE head (id int PRIMARY KEY, seq int, hash text);
INSERT INTO head SELECT i, 0, repeat('0', 64) FROM generate_series(1, 8) AS i;
CREATE TABLE hot (id int PRIMARY KEY, v bigint);
INSERT INTO hot VALUES (1, 0);
CREATE FUNCTION app(p text, chain int DEFAULT 1) RETURNS int LANGUAGE plpgsql AS $$
DECLARE s int; h text; n text;
BEGIN
  SELECT seq, hash INTO s, h FROM head WHERE id = chain FOR UPDATE;
  s := s + 1;
  n := encode(sha256(convert_to(h || E'\n' || p || s::text || '}', 'UTF8')), 'hex');
  INSERT INTO hist VALUES (chain * 100000000 + s, p, h, n);
  UPDATE head SET seq = s, hash = n WHERE id = chain;
  RETURN s;
END $$;
CREATE FUNCTION reserve(key text, att text, c float8) RETURNS text LANGUAGE plpgsql AS $$
DECLARE i text := gen_random_uuid()::text;
BEGIN
  INSERT INTO acc (k, open, pending) VALUES (key, 1, c)
  ON CONFLICT (k) DO UPDATE SET open = acc.open + 1, pending = acc.pending + c;
  INSERT INTO res VALUES (i, att, 'open', c, key);
  PERFORM app('{"action":"reserve","attempt":' || to_json(att)::text || ',"seq":');
  RETURN i;
END $$;
CREATE FUNCTION reserve_if(key text, att text, c float8, seen float8) RETURNS float8
LANGUAGE plpgsql AS $$
DECLARE now_seen float8;
BEGIN
  INSERT INTO acc (k) VALUES (key) ON CONFLICT (k) DO NOTHING;
  SELECT rho + pending INTO now_seen FROM acc WHERE k = key FOR UPDATE;
  IF now_seen IS DISTINCT FROM seen THEN
    RETURN now_seen;
  END IF;
  UPDATE acc SET open = open + 1, pending = pending + c WHERE k = key;
  INSERT INTO res VALUES (att, att, 'open', c, key);
  PERFORM app('{"action":"reserve","attempt":' || to_json(att)::text || ',"seq":');
  RETURN NULL;
END $$;
CREATE FUNCTION commit_(rid text, chains int DEFAULT 0) RETURNS float8 LANGUAGE plpgsql AS $$
DECLARE x record; r float8;
BEGIN
  SELECT k, cost INTO x FROM res WHERE id = rid AND state = 'open' FOR UPDATE;
  UPDATE acc SET rho = rho + x.cost, pending = pending - x.cost, open = open - 1
  WHERE k = x.k RETURNING rho INTO r;
  UPDATE res SET state = 'committed' WHERE id = rid;
  PERFORM app('{"action":"commit","reservation":' || to_json(rid)::text || ',"seq":',
              CASE WHEN chains > 0 THEN 1 + abs(hashtext(x.k)) % chains ELSE 1 END);
  RETURN r;
END $$;
"""

APPEND = "SELECT app(%s)"
SHARDED_APPEND = "SELECT app(%s, 1 + abs(hashtext(%s)) %% 8)"
SHAPES = (
    "python-pgbench",
    "two-phase, client-side",
    "two-phase, server commit",
    "optimistic server reserve",
    "all server-side",
    "two-phase, server commit, 8 chains",
)


def _reserve_client(cursor, key: str, sharded: bool = False) -> str:
    reservation = str(uuid.uuid4())
    cursor.execute(
        "BEGIN; INSERT INTO acc (k, open) VALUES (%s, 1) ON CONFLICT (k) DO UPDATE "
        "SET open = acc.open + 1 RETURNING id, rho, pending",
        (key,),
    )
    account, rho, pending = cursor.fetchone()
    assert rho + pending >= 0  # the client's decision
    link = (
        (SHARDED_APPEND, ('{"a":"reserve","seq":', key))
        if sharded
        else (APPEND, ('{"a":"reserve","seq":',))
    )
    cursor.execute(
        "UPDATE acc SET pending = %s WHERE id = %s; INSERT INTO res VALUES (%s, %s, 'open', "
        f"%s, %s); {link[0]}; COMMIT",
        (pending + 1e-6, account, reservation, reservation, 1e-6, key, *link[1]),
    )
    return reservation


def _loop(database: str, shape: str, key: str, duration: float, barrier, results) -> None:
    connection = connect(database)
    connection.autocommit = True
    cursor = connection.cursor()
    barrier.wait(60)
    seen = None
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < duration:
        if shape == "python-pgbench":
            cursor.execute("BEGIN; SELECT v FROM hot WHERE id = 1 FOR UPDATE")
            cursor.fetchone()
            cursor.execute("UPDATE hot SET v = v + 1 WHERE id = 1; COMMIT")
        elif shape == "optimistic server reserve":
            reservation = str(uuid.uuid4())
            while True:  # the client decides on the state it saw; the server applies if unchanged
                cursor.execute("SELECT reserve_if(%s, %s, %s, %s)", (key, reservation, 1e-6, seen))
                current = cursor.fetchone()[0]
                if current is None:
                    break
                seen = current
            cursor.execute("SELECT commit_(%s)", (reservation,))
            seen = cursor.fetchone()[0]
        elif shape == "two-phase, server commit, 8 chains":
            reservation = _reserve_client(cursor, key, sharded=True)
            cursor.execute("SELECT commit_(%s, 8)", (reservation,))
        elif shape == "all server-side":
            cursor.execute("SELECT reserve(%s, %s, %s)", (key, str(uuid.uuid4()), 1e-6))
            cursor.execute("SELECT commit_(%s)", (cursor.fetchone()[0],))
        else:
            reservation = _reserve_client(cursor, key)
            if shape == "two-phase, server commit":
                cursor.execute("SELECT commit_(%s)", (reservation,))
            else:
                cursor.execute(
                    "BEGIN; SELECT k, cost FROM res WHERE id = %s FOR UPDATE", (reservation,)
                )
                account_key, cost = cursor.fetchone()
                cursor.execute(
                    "SELECT rho, pending FROM acc WHERE k = %s FOR UPDATE", (account_key,)
                )
                rho, pending = cursor.fetchone()
                cursor.execute(
                    "UPDATE acc SET rho = %s, pending = %s, open = open - 1 WHERE k = %s; "
                    f"UPDATE res SET state = 'committed' WHERE id = %s; {APPEND}; COMMIT",
                    (rho + cost, pending - cost, account_key, reservation, '{"a":"c","seq":'),
                )
        done += 1
    results.put(done / (time.perf_counter() - start))
    connection.close()


def throughput(database: str, shape: str, distinct: bool, duration: float) -> float:
    spawn = multiprocessing.get_context("spawn")
    results, barrier = spawn.Queue(), spawn.Barrier(PROCESSES)
    processes = [
        spawn.Process(
            target=_loop,
            args=(database, shape, f"key-{i if distinct else 0}", duration, barrier, results),
        )
        for i in range(PROCESSES)
    ]
    for process in processes:
        process.start()
    rates = [results.get(timeout=duration + 120) for _ in processes]
    for process in processes:
        process.join()
    return sum(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per run")
    duration = parser.parse_args().duration
    with scratch_database("dpb_bench_ceiling") as (name, _), tempfile.TemporaryDirectory() as tmp:
        with connect(name) as connection, connection.cursor() as cursor:
            cursor.execute(SCHEMA)
        connection.close()
        script = Path(tmp) / "hot.sql"
        script.write_text(HOT_SCRIPT)
        clients = ("-c", str(PROCESSES), "-j", "2", "-T", str(int(duration)))
        hot_base = pgbench_tps(name, "-n", *clients, "-f", str(script))
        pgbench(name, "-i", "-q", "-s", "1")
        distinct_base = pgbench_tps(name, "-n", "-N", *clients)
        print(f"{PROCESSES} processes, {duration:g} s per run")
        print(f"pgbench FOR UPDATE one row: {hot_base:.0f} tps; -N: {distinct_base:.0f} tps")
        print()
        print("| shape | hot: /s | vs pgbench FOR UPDATE | distinct: /s | vs pgbench -N |")
        print("|---|---|---|---|---|")
        for shape in SHAPES:
            hot = throughput(name, shape, False, duration)
            distinct = throughput(name, shape, True, duration)
            print(
                f"| {shape} | {hot:.0f} | {hot / hot_base:.3f} | {distinct:.0f} | "
                f"{distinct / distinct_base:.3f} |"
            )


if __name__ == "__main__":
    main()
