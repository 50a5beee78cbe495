"""Write transactions in as few round trips as the database allows.

A release's reservation needs the locked accounts back before it can decide, and then
only writes. On PostgreSQL the transaction's ``BEGIN`` goes with its first statement,
which proves the schema revision and reads the server's clock (:func:`database.proven`),
and every later write is queued and sent with the ``COMMIT`` in one round trip, so row
locks are held for one client computation and one round trip, not for a dozen statements.
SQLite serialises writers anyway (``BEGIN IMMEDIATE``) and runs in-process, so there a
pipeline simply executes each statement at once.

Statements are written for psycopg2 (``%(name)s`` parameters); SQLite gets them with
``:name``. A failure rolls back everything and surfaces like any ledger transaction:
:class:`LedgerUnavailable` for a lost or unreachable database.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, Engine, exc

from dp_budget_provider.ledger.errors import (
    LedgerCorrupt,
    LedgerError,
    LedgerSchemaError,
)
from dp_budget_provider.ledger.storage import clock, database, history
from dp_budget_provider.ledger.storage.dialects import WriteDialect, for_dialect

# Every write reads what it locked as of after the lock: each statement a fresh snapshot
# (a server or role whose default is REPEATABLE READ would read, after a window's lock
# was granted, a snapshot taken before it: a refinement blind to the class a concurrent
# release had just made).
_BEGIN = "BEGIN ISOLATION LEVEL READ COMMITTED"


class UniqueViolation(LedgerError):
    """A write hit a unique constraint (e.g. a twin reserved the same attempt first)."""


class Pipeline:
    """One write transaction: ``query`` runs now, ``send`` may be deferred to the commit."""

    # PostgreSQL: queue the writes nobody reads back and send them with the COMMIT (one
    # round trip instead of one each); ``bench/ledger.py --only pipeline`` measures what
    # that saves against sending each at once.
    defer_sends = True

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._postgresql = connection.dialect.name == "postgresql"
        # What the write path does differently on this database (:mod:`dialects`).
        self.dialect: WriteDialect = for_dialect(connection.dialect.name)
        self._cursor: Any = None
        self._queued: list[bytes] = []
        self._begun = False
        # The link each chain's head moves to in this transaction, by chain: its move is
        # queued with the commit, so a second entry on the chain links to it from here.
        self._moved: dict[int, str] = {}

    def _pg_cursor(self) -> Any:
        if self._cursor is None:
            self._cursor = self.connection.connection.dbapi_connection.cursor()
        return self._cursor

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> list[Any]:
        """Run ``sql`` now (inside the transaction) and return its rows."""
        if not self._postgresql:
            result = self.connection.exec_driver_sql(history.named(sql), dict(params or {}))
            return list(result) if result.returns_rows else []
        cursor = self._pg_cursor()
        cursor.execute(cursor.mogrify(sql, params))
        return cursor.fetchall() if cursor.description else []

    def _begin(self, sql: str) -> list[Any]:
        """PostgreSQL: begin the transaction with ``sql`` (no parameters), its first
        statement, in one round trip; its rows."""
        self._begun = True  # from here on, a failure needs a ROLLBACK
        cursor = self._pg_cursor()
        cursor.execute(f"{_BEGIN}; {sql}")
        return cursor.fetchall()

    def copy_in(self, sql: str, text: str) -> None:
        """PostgreSQL: ``COPY ... FROM STDIN`` of ``text`` now, inside the transaction."""
        if not self._postgresql:
            raise RuntimeError("COPY is PostgreSQL's")
        self._pg_cursor().copy_expert(sql, io.StringIO(text))

    def core(self) -> Connection:
        """The connection, inside the transaction, for SQLAlchemy Core statements."""
        return self.connection

    def send(self, sql: str, params: Mapping[str, Any] | None = None) -> None:
        """A write whose result nobody needs: queued until the commit on PostgreSQL."""
        if not self._postgresql:
            self.connection.exec_driver_sql(history.named(sql), dict(params or {}))
            return
        statement = self._pg_cursor().mogrify(sql, params)
        if self.defer_sends:
            self._queued.append(statement)
        else:
            self._pg_cursor().execute(statement)

    def append_history(self, chain_key: history.ChainKey, /, **entry: Any) -> int:
        """Append a history entry last in the transaction (see :mod:`history`).

        On PostgreSQL the chain head is locked (one round trip that also numbers the
        entry), the link is made here with ``key``, and the entry and the head's move go
        with the commit. A transaction may append several entries (a correction's, one per
        account): on a chain it already moved, an entry links to that move. Returns the
        entry's number.
        """
        if not self._postgresql:
            return history.append(self.connection, chain_key, **entry)
        row = history.entry_columns(**entry)
        heads = self.query(history.PG_LOCK_HEAD, {"chain": row["chain"]})
        head = heads[0] if heads else None
        if head is not None and row["chain"] in self._moved:
            head = (self._moved[row["chain"]], *head[1:])
        values = history.linked(row, head, chain_key)
        self.send(history.INSERT_ENTRY, values)
        self.send(history.MOVE_HEAD, values)
        self._moved[row["chain"]] = values["hash"]
        return int(values["seq"])

    def _commit(self) -> None:
        if not self._postgresql:
            return
        self._pg_cursor().execute(b";\n".join([*self._queued, b"COMMIT"]))
        self._queued.clear()
        self._begun = False

    def _rollback(self) -> None:
        if self._postgresql and self._begun:
            with contextlib.suppress(Exception):
                self._pg_cursor().execute("ROLLBACK")
            self._begun = False


@contextlib.contextmanager
def write(engine: Engine, clock_skew: timedelta = clock.DEFAULT_CLOCK_SKEW) -> Iterator[Pipeline]:
    """A pipelined write transaction; rolled back (nothing written) if the block raises.

    Like every write transaction it first proves its schema revision and, on PostgreSQL,
    takes its moment from the server's clock (:func:`database.proven`).
    """
    if engine.dialect.name != "postgresql":
        try:
            with database.transaction(engine, write=True, clock_skew=clock_skew) as connection:
                yield Pipeline(connection)
        except exc.IntegrityError as error:
            raise UniqueViolation(str(error.orig)) from error
        return
    import psycopg2

    with translated_errors(engine), engine.connect() as connection:
        # psycopg2's own flag (no server round trip, unlike an isolation-level change
        # through SQLAlchemy, which resets it with a SET on every check-in); put back
        # before the connection returns to the pool.
        dbapi_connection = connection.connection.dbapi_connection
        dbapi_connection.autocommit = True
        pipeline = Pipeline(connection)
        try:
            with database.proven(pipeline._begin, True, clock_skew):
                yield pipeline
            pipeline._commit()
        except (psycopg2.OperationalError, psycopg2.InterfaceError):
            connection.invalidate()  # a broken connection must not go back to the pool
            raise
        except BaseException:
            pipeline._rollback()
            raise
        finally:
            if pipeline._cursor is not None:
                with contextlib.suppress(Exception):
                    pipeline._cursor.close()
            if not connection.invalidated:
                dbapi_connection.autocommit = False


@contextlib.contextmanager
def translated_errors(engine: Engine) -> Iterator[None]:
    """psycopg2's errors as the ledger's: what failed, and on which database."""
    import psycopg2

    try:
        yield
    except psycopg2.errors.UniqueViolation as error:
        raise UniqueViolation(str(error)) from error
    except psycopg2.DatabaseError as error:
        if isinstance(error, psycopg2.errors.DataCorrupted):
            raise LedgerCorrupt(str(error).strip()) from error
        if isinstance(error, psycopg2.errors.UndefinedFunction):
            raise LedgerSchemaError(
                f"ledger database {database.safe_url(engine)} lacks a server function of its "
                f"schema ({str(error).strip().splitlines()[0]}); run `dp-budget db upgrade`"
            ) from error
        if isinstance(error, psycopg2.OperationalError):
            raise database.unavailable(engine, error) from error
        raise
    except (psycopg2.InterfaceError, exc.OperationalError, exc.InterfaceError) as error:
        raise database.unavailable(engine, error) from error
