"""A PgBouncer in transaction-pooling mode in front of one PostgreSQL database, for tests.

Debian's ``pgbouncer`` must be installed (``scripts/test.sh`` installs it as root): without
it the tests that need it fail, never skip. PgBouncer refuses to run as root, so as root it
is started with ``-u`` (it reads its files, then drops to that user). Its pool is smaller
than the number of clients, so transactions of different clients share server sessions:
whatever a client left in a session would meet another client's transaction.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg2

from tests.plugins.airflow_server import free_port
from tests.scratch_postgres import dsn_part

POOL_SIZE = 2
START_TIMEOUT = 30
# PgBouncer drops to this user when started as root (it must not run as root).
RUN_AS = os.environ.get("DP_BUDGET_TEST_PGBOUNCER_USER", "postgres")
BINARY = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"

CONFIG = """\
[databases]
{database} = host={host} port={port} dbname={database} user={user}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {listen_port}
unix_socket_dir =
auth_type = trust
auth_file = {auth_file}
admin_users = {user}
pool_mode = transaction
default_pool_size = {pool_size}
max_client_conn = 500
"""


class PgBouncerMissing(RuntimeError):
    """The ``pgbouncer`` program is not installed."""


@dataclass
class PgBouncer:
    url: str  # the SQLAlchemy URL of the database, through PgBouncer
    dsn: str  # the same for psycopg2
    port: int
    log: Path

    def admin(self, command: str) -> list[dict[str, object]]:
        """One command of PgBouncer's admin console (``SHOW STATS`` ...) as dicts."""
        connection = psycopg2.connect(
            host="127.0.0.1", port=self.port, user=dsn_part("user"), dbname="pgbouncer"
        )
        connection.autocommit = True  # the console takes no transactions
        try:
            with connection.cursor() as cursor:
                cursor.execute(command)
                names = [column.name for column in cursor.description]
                return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
        finally:
            connection.close()


# What a server session can keep from one transaction to the next, read in the session
# itself. PgBouncer sets its tracked startup parameters on every server session it hands
# out, so those are not a client's leftovers; nor are the transaction_* settings, which
# belong to the transaction reading them.
LEFTOVERS = """
SELECT 'prepared statement ' || name FROM pg_prepared_statements
UNION ALL SELECT 'LISTEN ' || channel FROM pg_listening_channels() AS channel
UNION ALL SELECT 'SET ' || name || ' = ' || setting FROM pg_settings
    WHERE source = 'session' AND name NOT LIKE 'transaction\\_%' AND name NOT IN (
        'application_name', 'client_encoding', 'DateStyle', 'TimeZone',
        'standard_conforming_strings', 'IntervalStyle')
UNION ALL SELECT 'temporary table ' || relname FROM pg_class
    WHERE relnamespace = pg_my_temp_schema()
UNION ALL SELECT 'advisory lock ' || objid FROM pg_locks
    WHERE locktype = 'advisory' AND pid = pg_backend_pid()
UNION ALL SELECT 'cursor ' || name FROM pg_cursors
"""


def session_leftovers(bouncer: PgBouncer) -> dict[int, list[str]]:
    """What each of the pool's server sessions still holds from earlier clients: one
    client per session, all in a transaction at once so that each gets its own."""
    clients = [psycopg2.connect(bouncer.dsn) for _ in range(POOL_SIZE)]
    try:
        found = {}
        for client in clients:  # each stays in its transaction: the next gets another session
            with client.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                (pid,) = cursor.fetchone()
                cursor.execute(LEFTOVERS)
                found[pid] = [row[0] for row in cursor.fetchall()]
        return found
    finally:
        for client in clients:  # rolled back first: PgBouncer closes a session left in one
            client.rollback()
            client.close()


@contextmanager
def pgbouncer(database: str, folder: Path) -> Iterator[PgBouncer]:
    """Start PgBouncer (transaction pooling, ``POOL_SIZE`` server sessions) in front of
    ``database`` on the tests' PostgreSQL server; stopped afterwards."""
    if not os.access(BINARY, os.X_OK):
        raise PgBouncerMissing(
            "pgbouncer is not installed (Debian package `pgbouncer`: apt-get install -y "
            "pgbouncer; scripts/test.sh installs it when run as root)"
        )
    folder.mkdir(parents=True, exist_ok=True)
    user = dsn_part("user")
    auth_file = folder / "users.txt"
    auth_file.write_text(f'"{user}" ""\n')
    port = free_port()
    config = folder / "pgbouncer.ini"
    config.write_text(
        CONFIG.format(
            database=database,
            host=dsn_part("host"),
            port=dsn_part("port"),
            user=user,
            listen_port=port,
            auth_file=auth_file,
            pool_size=POOL_SIZE,
        )
    )
    as_user = ["-u", RUN_AS] if os.geteuid() == 0 else []
    log = folder / "pgbouncer.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            [BINARY, *as_user, str(config)],
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        bouncer = PgBouncer(
            f"postgresql+psycopg2://{user}@127.0.0.1:{port}/{database}",
            f"host=127.0.0.1 port={port} user={user} dbname={database}",
            port,
            log,
        )
        _wait_until_listening(process, bouncer)
        yield bouncer
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _wait_until_listening(process: subprocess.Popen, bouncer: PgBouncer) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if process.poll() is not None:
            raise RuntimeError(
                f"pgbouncer exited ({process.returncode}):\n{bouncer.log.read_text()}"
            )
        try:
            bouncer.admin("SHOW VERSION")
            return
        except psycopg2.OperationalError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"pgbouncer not answering after {START_TIMEOUT}s:\n{bouncer.log.read_text()}"
                ) from None
            time.sleep(0.1)
