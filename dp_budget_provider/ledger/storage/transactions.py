"""The ledger's database as its collaborators use it: one engine, four kinds of transaction.

Every part of the ledger reads and writes through one :class:`LedgerDatabase`, so every
write proves its schema revision and takes the ledger's time the same way
(:func:`database.transaction`), whichever part makes it.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

from sqlalchemy import Connection, Engine

from dp_budget_provider.ledger.storage import database, pipeline


class LedgerDatabase:
    """One ledger database: its engine and the clock skew its writes tolerate."""

    def __init__(self, url: str | None, clock_skew: timedelta) -> None:
        self._clock_skew = clock_skew
        self.engine: Engine = database.make_engine(url)

    def reading(self) -> contextlib.AbstractContextManager[Connection]:
        """A read-only transaction on the ledger's tables."""
        return database.transaction(self.engine, write=False)

    def snapshot(self) -> contextlib.AbstractContextManager[Connection]:
        """A read-only transaction that reads every table at one moment (verify's)."""
        return database.transaction(self.engine, write=False, snapshot=True)

    def write(self) -> contextlib.AbstractContextManager[Connection]:
        """A write transaction: it proves its schema revision first and, on PostgreSQL,
        takes the ledger's time from the server (:func:`database.proven`)."""
        return database.transaction(self.engine, write=True, clock_skew=self._clock_skew)

    def pipelined(self) -> contextlib.AbstractContextManager[pipeline.Pipeline]:
        """A pipelined write transaction (see :mod:`pipeline`) on a pooled connection."""
        return pipeline.write(self.engine, self._clock_skew)

    def migrating(self) -> contextlib.AbstractContextManager[Connection]:
        """A write transaction that may create or upgrade the schema (opening a ledger)."""
        return database.migrating(self.engine)

    @property
    def url(self) -> str:
        """The database URL without password."""
        return database.safe_url(self.engine)

    def close(self) -> None:
        """Release the database connections."""
        self.engine.dispose()
