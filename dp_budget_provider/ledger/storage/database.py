"""Engines, transactions and schema management for the ledger database.

SQLite (the embedded default) serialises writers: every write transaction starts with
``BEGIN IMMEDIATE``, in WAL mode with a busy timeout, so the prospective check and the
reservation can never interleave with another writer. PostgreSQL takes row locks
(``SELECT ... FOR UPDATE`` / upserts) in key order. Connection failures surface as
:class:`LedgerUnavailable`; the surrounding transaction is rolled back, so nothing is
half-written.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event, exc, inspect, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import StaticPool

from dp_budget_provider.ledger.errors import LedgerSchemaError, LedgerUnavailable
from dp_budget_provider.ledger.storage import clock

MIGRATIONS = Path(__file__).parent / "migrations"
VERSION_TABLE = "dp_budget_alembic_version"
SQLITE_BUSY_TIMEOUT_MS = 60_000
IDLE_PING_SECONDS = 2.0
_WRITE = "dp_budget_write"

# Opens one transaction on the ledger's database (the ledger's ``reading``, ``_write``).
Transaction = Callable[[], contextlib.AbstractContextManager[Connection]]


# Every usual spelling of a PostgreSQL URL. The ledger's pipeline speaks psycopg2 (the
# driver the package installs), so each of them is opened with it; SQLAlchemy alone would
# map ``postgresql://`` to psycopg 3, which the package does not install.
_POSTGRES_SCHEMES = ("postgres", "postgresql", "postgresql+psycopg2", "postgresql+psycopg")
POSTGRES_DRIVER = "postgresql+psycopg2"
_URL_FORMS = "sqlite:////abs/path/ledger.db or postgresql://user:password@host:5432/database"


def parse_url(url: str) -> URL:
    """The ledger database's URL, parsed: PostgreSQL's spellings opened with psycopg2,
    a relative SQLite path made absolute; ValueError naming the accepted forms otherwise."""
    unprintable = next((char for char in str(url) if not char.isprintable()), None)
    if unprintable is not None:  # a NUL byte, a newline, an undecodable byte (a surrogate)
        raise ValueError(
            f"the ledger URL contains the unprintable character U+{ord(unprintable):04X} "
            f"(expected {_URL_FORMS})"
        )
    scheme, separator, rest = str(url).partition("://")
    if not separator or not scheme:  # never echoed: a mistyped URL may hold a password
        raise ValueError(f"not a database URL (expected {_URL_FORMS})")
    if scheme.lower() in _POSTGRES_SCHEMES:
        if scheme.lower() not in ("postgresql", POSTGRES_DRIVER):
            logging.getLogger(__name__).info(
                "ledger URL scheme %r opened with %s (the driver the ledger speaks)",
                scheme,
                POSTGRES_DRIVER,
            )
        url = f"{POSTGRES_DRIVER}://{rest}"
    elif scheme.lower().startswith("postgresql+"):
        raise ValueError(
            f"the ledger speaks to PostgreSQL through psycopg2, not {scheme.split('+', 1)[1]!r}: "
            "write the URL as postgresql://user:password@host:5432/database"
        )
    try:
        parsed = make_url(url)
    except (exc.ArgumentError, ValueError):  # its message may quote the URL and password
        raise ValueError(f"not a database URL (expected {_URL_FORMS})") from None
    backend = parsed.get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        raise ValueError(f"unsupported ledger database {backend!r}: use sqlite or postgresql")
    try:
        parsed.get_dialect()
    except exc.NoSuchModuleError:
        raise ValueError(
            f"not a database URL: no driver {parsed.drivername!r} (expected {_URL_FORMS})"
        ) from None
    return _absolute_sqlite(parsed) if backend == "sqlite" else _one_postgres_target(parsed)


# Query parameters a PostgreSQL ledger URL may carry: how to connect, never where to.
_POSTGRES_QUERY = frozenset(
    {
        "sslmode",
        "sslcert",
        "sslkey",
        "sslrootcert",
        "sslcrl",
        "sslpassword",
        "gssencmode",
        "connect_timeout",
        "application_name",
        "target_session_attrs",
        "keepalives",
        "keepalives_idle",
        "keepalives_interval",
        "keepalives_count",
    }
)


def _one_postgres_target(url: URL) -> URL:
    """Refuse query parameters that would connect elsewhere than the URL says (``dbname``,
    ``user``, ``options=-csearch_path=...``: another database or schema is another ledger,
    with a full budget). ``host`` is taken only as the URL's host, for a Unix socket."""
    extra = set(url.query) - _POSTGRES_QUERY - ({"host"} if not url.host else set())
    if extra:
        raise ValueError(
            f"the ledger URL's query names {', '.join(sorted(extra))}: put the host, port, user "
            "and database in the URL itself (query parameters may only say how to connect)"
        )
    return url


# Engines whose every transaction shares one connection (the private in-memory ledger),
# each with the lock that keeps two threads (a task and its lease renewals) from
# interleaving statements, and so transactions, on it.
_ONE_CONNECTION: weakref.WeakKeyDictionary[Engine, threading.RLock] = weakref.WeakKeyDictionary()


def make_engine(url: str | None) -> Engine:
    """An engine for ``url``; ``None`` is a private in-memory SQLite ledger."""
    if url is None:
        engine = create_engine(
            "sqlite://", poolclass=StaticPool, connect_args={"check_same_thread": False}
        )
        _ONE_CONNECTION[engine] = threading.RLock()
    else:
        parsed = parse_url(url)
        if parsed.get_backend_name() == "sqlite":
            _require_folder(parsed)
            engine = create_engine(parsed, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
            _one_process_per_connection(engine)
        else:
            engine = create_engine(
                parsed,
                connect_args={"connect_timeout": 10, "application_name": "dp-budget-ledger"},
            )
            _one_process_per_connection(engine)
            _ping_idle_connections(engine)
    if engine.dialect.name == "sqlite":
        _configure_sqlite(engine)
    return engine


def sqlite_path(url: URL) -> Path | None:
    """The file of a SQLite ledger URL; None for an in-memory database. A ``file:`` URI
    (``?uri=true``) must name an absolute path: a relative one would be another file in
    every working folder, each a ledger with a full budget. Without ``uri=true`` SQLite
    opens ``file:x.db`` as a plain (relative) file name, resolved like any other."""
    database = url.database or ""
    if database in ("", ":memory:"):
        return None
    if database.startswith("file:") and str(url.query.get("uri", "")).lower() in ("true", "1"):
        target = database[len("file:") :].split("?", 1)[0]
        if target.startswith("//"):
            target = target[2:]
            target = target[target.index("/") :] if "/" in target else ""
        if target in ("", ":memory:") or url.query.get("mode") == "memory":
            return None
        if not target.startswith("/"):
            raise ValueError(
                "a SQLite file: URI must name an absolute path (file:/abs/path/ledger.db)"
            )
        return Path(target)
    return Path(database)


def _require_folder(url: URL) -> None:
    """SQLite cannot create a file in a folder that does not exist: say so, by name."""
    path = sqlite_path(url)
    if path is not None and not path.parent.is_dir():
        raise LedgerUnavailable(
            f"the folder {path.parent} of the SQLite ledger {path} does not exist "
            "(`dp-budget init` creates it)"
        )


def _absolute_sqlite(url: URL) -> URL:
    """A SQLite URL with an absolute path: ``sqlite:///ledger.db`` opened from two folders
    would be two ledgers, each with a full budget. The resolved path is logged."""
    path = sqlite_path(url)
    if path is None or path.is_absolute():
        return url
    resolved = path.resolve()
    logging.getLogger(__name__).warning(
        "relative SQLite ledger path %r resolved to %s (give an absolute path: "
        "sqlite:////abs/path/ledger.db)",
        str(path),
        resolved,
    )
    return url.set(database=str(resolved))


# PostgreSQL connections made in this process or inherited from a parent: after a fork
# the child detaches their sockets (``_detach_inherited``), whatever it does with them.
_SOCKETS: weakref.WeakSet[Any] = weakref.WeakSet()


def _one_process_per_connection(engine: Engine) -> None:
    """Never use a connection made by another process (a forked child's inheritance).

    A connection inherited across a fork is one server session behind two processes:
    their messages interleave on the socket and one may read the other's answer, e.g.
    a refused reservation read as granted. A checked-out connection made by another
    process is therefore dropped without being touched, and the pool makes a new one;
    after a fork, :func:`_detach_inherited` has already pointed the child's copies of
    the sockets at ``/dev/null``, so even closing them cannot end the parent's sessions.
    """

    @event.listens_for(engine, "connect")
    def on_connect(dbapi_connection: Any, record: Any) -> None:
        record.info["pid"] = os.getpid()
        if engine.dialect.name == "postgresql":
            _SOCKETS.add(dbapi_connection)

    @event.listens_for(engine, "checkout")
    def on_checkout(_dbapi_connection: Any, record: Any, proxy: Any) -> None:
        made_by = record.info.get("pid")
        if made_by != os.getpid():
            record.dbapi_connection = proxy.dbapi_connection = None  # the maker's to close
            raise exc.DisconnectionError(
                f"ledger connection made by process {made_by}, not this one ({os.getpid()})"
            )


def _detach_inherited() -> None:
    """In a forked child: point every inherited PostgreSQL socket at ``/dev/null``.

    The parent keeps its sockets; whatever the child later sends on its copies (a
    rollback when a pool takes one back, libpq's goodbye when one is garbage collected)
    goes nowhere, and the child's pools replace them on first use.
    """
    inherited = [connection for connection in list(_SOCKETS) if not connection.closed]
    if not inherited:
        return
    nowhere = os.open(os.devnull, os.O_RDWR)
    try:
        for connection in inherited:
            with contextlib.suppress(Exception):
                os.dup2(nowhere, connection.fileno())
    finally:
        os.close(nowhere)


os.register_at_fork(after_in_child=_detach_inherited)


def _ping_idle_connections(engine: Engine) -> None:
    """Check a pooled connection before use when it sat idle, not on every checkout.

    ``pool_pre_ping`` costs a round trip per transaction, a third of a release's round
    trips. A connection back in use within seconds is almost surely alive; if it is not,
    the statement fails, the transaction rolls back and the connection is discarded.
    """

    @event.listens_for(engine, "checkin")
    def on_checkin(_dbapi_connection: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def on_checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        idle_since = record.info.get("idle_since")
        if idle_since is None or time.monotonic() - idle_since < IDLE_PING_SECONDS:
            return
        try:
            alive = engine.dialect.do_ping(dbapi_connection)
        except Exception as error:  # any failure: let the pool replace the connection
            raise exc.DisconnectionError(str(error)) from error
        if not alive:
            raise exc.DisconnectionError("ledger connection failed its ping")


def _configure_sqlite(engine: Engine) -> None:
    """WAL, a busy timeout, foreign keys, and BEGIN IMMEDIATE for write transactions."""

    @event.listens_for(engine, "connect")
    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
        cursor = dbapi_connection.cursor()
        if engine.url.database not in (None, "", ":memory:"):
            cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=FULL")
        # 32 MiB of pages per connection (SQLite's default is 2 MiB): a cohort's members,
        # read in order by a release or by verify, stay cached instead of read again.
        cursor.execute("PRAGMA cache_size=-32768")
        cursor.close()

    @event.listens_for(engine, "begin")
    def on_begin(connection: Connection) -> None:
        write = connection.get_execution_options().get(_WRITE, False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def safe_url(engine: Engine) -> str:
    """The engine's URL without its password, for messages."""
    return engine.url.render_as_string(hide_password=True)


@contextlib.contextmanager
def transaction(
    engine: Engine,
    *,
    write: bool,
    snapshot: bool = False,
    clock_skew: timedelta = clock.DEFAULT_CLOCK_SKEW,
) -> Iterator[Connection]:
    """One transaction; a write transaction first proves its schema revision.

    A write takes SQLite's write lock up front and, before anything else, reads the
    database's schema revision under the lock a migration takes (:func:`proven`), so code
    of another revision never writes; on PostgreSQL it also takes its moment from the
    server's clock (refusing a worker whose clock is more than ``clock_skew`` off).
    ``snapshot`` makes every statement of a read see the same state (PostgreSQL
    REPEATABLE READ READ ONLY; SQLite WAL readers already do). Any database-level failure
    (unreachable server, connection killed mid-transaction) is re-raised as
    :class:`LedgerUnavailable` after the rollback.
    """
    with _transaction(engine, write=write, snapshot=snapshot) as connection:
        if not write:
            yield connection
            return
        with proving(connection, clock_skew):
            yield connection


def migrating(engine: Engine) -> contextlib.AbstractContextManager[Connection]:
    """A write transaction that may change the schema (create it, upgrade it), so it
    proves no revision: the migration locks the version table itself (:func:`lock_revision`)."""
    return _transaction(engine, write=True, snapshot=False)


@contextlib.contextmanager
def _transaction(engine: Engine, *, write: bool, snapshot: bool) -> Iterator[Connection]:
    serialised = _ONE_CONNECTION.get(engine) or contextlib.nullcontext()
    try:
        with serialised, engine.connect() as connection:
            options: dict[str, Any] = {_WRITE: write}
            if snapshot and connection.dialect.name == "postgresql":
                options["isolation_level"] = "REPEATABLE READ"
            connection.execution_options(**options)
            with connection.begin():
                if snapshot and connection.dialect.name == "postgresql":
                    connection.exec_driver_sql("SET TRANSACTION READ ONLY")
                yield connection
    except (exc.OperationalError, exc.InterfaceError) as error:
        raise unavailable(engine, error) from error
    except exc.DBAPIError as error:
        if error.connection_invalidated:
            raise unavailable(engine, error, "connection lost") from error
        raise


# The first statement of every write transaction. PostgreSQL: the revision row share-locked
# (so its table ROW SHARE locked) until the transaction ends, which a migration's lock (see
# ``lock_revision``) waits for; a write that comes after that lock waits for the
# migration's commit and then reads the new revision (READ COMMITTED reads with a snapshot
# taken after the wait, and follows a row it waited for to its newest version); the
# server's clock comes in the same round trip. ``clock_timestamp()``, not ``now()``:
# ``now()`` is the time the transaction began, stale by whatever it waited for before this
# statement's answer (a migration's lock), and would be compared with this process's
# reading after the wait. SQLite: writes hold the database's write lock from BEGIN
# IMMEDIATE, which a migration (itself a write) needs too, so a plain read of the row is
# already under that lock.
_PG_PROVE = f"SELECT version_num, clock_timestamp() FROM {VERSION_TABLE} FOR SHARE"
_SQLITE_PROVE = f"SELECT version_num FROM {VERSION_TABLE}"


def proving(
    connection: Connection, clock_skew: timedelta
) -> contextlib.AbstractContextManager[None]:
    """:func:`proven` in ``connection``'s transaction."""
    return proven(
        lambda sql: list(connection.exec_driver_sql(sql)),
        connection.dialect.name == "postgresql",
        clock_skew,
    )


@contextlib.contextmanager
def proven(
    run: Callable[[str], list[Any]], postgresql: bool, clock_skew: timedelta
) -> Iterator[None]:
    """Prove, first thing in a write transaction, that this code may write: the database's
    schema revision (read under the lock a migration takes) is the one the code was written
    for, and on PostgreSQL this process's clock agrees with the server's, whose time is
    then the ledger's for the rest of the transaction (:mod:`clock`).

    Checked on every write, not once when the ledger is opened: a worker that opened the
    ledger before ``dp-budget db upgrade`` would otherwise go on writing with code of the
    older revision (reading membership where the new schema no longer keeps all of it,
    and charging subjects from zero). ``run`` executes a statement in the transaction.
    """
    if not postgresql:
        refuse_revision(_revision_of(run(_SQLITE_PROVE)), "write to it")
        yield
        return
    before = clock.process_now()
    rows = run(_PG_PROVE)
    after = clock.process_now()
    refuse_revision(_revision_of(rows), "write to it")
    with clock.server_time(rows[0][1], before, after, clock_skew):
        yield


def _revision_of(rows: Sequence[Sequence[Any]]) -> str | None:
    """The revision the version table's rows name (None: none, or several)."""
    return rows[0][0] if len(rows) == 1 else None


def refuse_revision(found: str | None, what: str) -> None:
    """Refuse (fail closed) a database whose schema revision is not this code's head."""
    expected = head_revision()
    if found != expected:
        raise LedgerSchemaError(
            f"the ledger database's schema is at revision {found!r}, but this code was written "
            f"for revision {expected!r}: refusing to {what}. If the database is older, run "
            "`dp-budget db upgrade`; if it was upgraded, run this package's release of its "
            "revision (restart workers still running older code)"
        )


def lock_revision(connection: Connection) -> None:
    """Lock the revision for the rest of a migration's transaction, before it changes
    anything (PostgreSQL; a new database has no version table yet to lock).

    The table lock conflicts with the share lock every write takes on the revision row
    (see :func:`proven`): the migration waits for the writes under way, and a write that
    begins after it waits for the migration's commit and then reads the new revision, so
    no write of the old code commits after the migration or meets a half-migrated
    schema. A table lock rather than the row's own FOR UPDATE: PostgreSQL queues new
    requests behind a waiting table lock, while a row share lock may join the share locks
    already held, so under a steady stream of writes a row lock could wait forever.
    EXCLUSIVE still lets the version be read (a ledger being opened). SQLite's migration
    holds the database's write lock from its first statement, which does the same.
    """
    if connection.dialect.name != "postgresql":
        return
    if connection.execute(text(f"SELECT to_regclass('{VERSION_TABLE}')")).scalar() is None:
        return
    connection.execute(text(f"LOCK TABLE {VERSION_TABLE} IN EXCLUSIVE MODE"))


def unavailable(engine: Engine, error: BaseException, what: str = "failed") -> LedgerUnavailable:
    """The error a ledger call raises when its database fails, naming the database."""
    cause = getattr(error, "orig", None) or error
    return LedgerUnavailable(f"ledger database {safe_url(engine)} {what}: {cause}")


def _alembic_config(connection: Connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    return config


@functools.cache
def head_revision() -> str:
    """The schema revision this code was written for: the newest of the migrations it
    ships (read from the scripts once, so every new migration is the head by itself)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    head = ScriptDirectory.from_config(config).get_current_head()
    if head is None:
        raise LedgerSchemaError("the package ships no ledger migrations")
    return head


def current_revision(connection: Connection) -> str | None:
    """The schema revision of the database, None for an empty database.

    Alembic announces its dialect at INFO on every configure; every task opens the ledger,
    so that would be two noise lines in every task log.
    """
    migration_log = logging.getLogger("alembic.runtime.migration")
    level = migration_log.level
    migration_log.setLevel(logging.WARNING)
    try:
        context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
        return context.get_current_revision()
    finally:
        migration_log.setLevel(level)


def create_schema(connection: Connection) -> None:
    """Create the newest schema on an empty database, inside the caller's transaction."""
    command.upgrade(_alembic_config(connection), "head")


def upgrade(engine: Engine) -> str:
    """Bring the schema to the newest revision (``dp-budget db upgrade``); returns it.

    The migration locks the version table first thing (``migrations/env.py`` calls
    :func:`lock_revision`), so it waits for the writes under way and holds off new ones.
    """
    with migrating(engine) as connection:
        command.upgrade(_alembic_config(connection), "head")
        return current_revision(connection) or ""


def check_schema(connection: Connection) -> None:
    """Refuse to open a database whose schema is not exactly the one this package expects
    (every write checks again, see :func:`proven`)."""
    refuse_revision(current_revision(connection), "open it")


def is_initialised(connection: Connection) -> bool:
    """True once the schema holds the ledger's configuration row."""
    return connection.execute(text("SELECT count(*) FROM dp_ledger_config")).scalar_one() > 0


def is_empty(connection: Connection) -> bool:
    """True when the database holds no ledger tables at all."""
    names = set(inspect(connection).get_table_names())
    return VERSION_TABLE not in names and "dp_ledger_config" not in names
