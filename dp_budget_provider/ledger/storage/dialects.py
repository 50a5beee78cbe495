"""Where PostgreSQL and SQLite differ on the write path, behind one interface.

The write path (locks, upserts, batched inserts, cohort members) asks its transaction's
:class:`WriteDialect` instead of asking which database it is on, the way Airflow's
common.sql hands SQL differences to a dialect. PostgreSQL takes row locks, sends one
statement for a whole batch (``unnest``, COPY) and keeps its statistics fresh; SQLite
already holds the database's one write lock, so it locks nothing more and writes in
chunks that fit its variable limit.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import insert, update

from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.storage import statements
from dp_budget_provider.ledger.storage.schema import Account, ReservationKey

# Scope of a window row: (tenant, query type, window).
WindowScope = tuple[str, str, str]
# Rows one transaction writes into a table past which PostgreSQL re-reads its statistics
# before the transaction's next join over it: without them it takes a table a release has
# just filled with a million rows for empty, and plans the join of two such sets as a
# rescan of one per row of the other (hours, not seconds). Autovacuum comes after commit.
ANALYZE_AFTER = 10_000
# SQLite: how many cohort members one INSERT carries (one JSON parameter).
_MEMBERS_PER_INSERT = 10**5


class WriteDialect(ABC):
    """What the write path does differently on each database; ``pipe`` is a
    :class:`~dp_budget_provider.ledger.storage.pipeline.Pipeline` (typed loosely here:
    the pipeline hands out its dialect)."""

    # Appended to a SELECT that must lock its rows (empty where the transaction already
    # holds the database's write lock).
    row_lock: str
    # Between an INSERT's VALUES and RETURNING: a twin that inserted first wins.
    insert_once: str

    @abstractmethod
    def upsert_accounts(
        self, pipe: Any, keys: Sequence[LedgerKey], added: Mapping[str, Any], now: str
    ) -> tuple[list[Any], int | None]:
        """Create missing accounts of ``keys`` and lock all of them in key order, adding
        ``added`` (a reservation's open count and pending spend) in the same statement;
        returns the rows after, and the policy version where the database reports it."""

    @abstractmethod
    def window_rows(self, pipe: Any, scopes: Sequence[WindowScope], now: str) -> list[Any]:
        """Create and share-lock the window rows of ``scopes`` (sorted); their rows, each
        with the ledger's quarantine columns."""

    @abstractmethod
    def set_pending_residual(self, pipe: Any, stored: str | None, ids: Sequence[int]) -> None:
        """Set the pending residual curve ``stored`` on accounts ``ids``."""

    @abstractmethod
    def insert_reservation_keys(
        self, pipe: Any, reservation_id: str, keys: Sequence[LedgerKey]
    ) -> None:
        """Store the keys a reservation holds, in order."""

    @abstractmethod
    def subjects_param(self, subjects: Sequence[str]) -> str:
        """A list of subjects as one parameter the server unpacks (:meth:`unpack`)."""

    @abstractmethod
    def unpack(self) -> str:
        """SQL unpacking the ``%(subjects)s`` parameter into rows of one column ``s``."""

    @abstractmethod
    def store_members(self, pipe: Any, cohort_id: int, subjects: Sequence[str]) -> None:
        """Store a new cohort's members (sorted canonical subject ids)."""

    @abstractmethod
    def written(self, pipe: Any, table: str, rows: int) -> None:
        """``rows`` rows were just written to ``table`` in this transaction."""

    @abstractmethod
    def lock_reservations(self, pipe: Any, held_by: Callable[[], Iterable[str]]) -> None:
        """Lock the reservations ``held_by()`` names (ids), all at once, in id order; where
        the transaction holds the database's write lock already, nothing is asked."""


class PostgreSQLWrites(WriteDialect):
    """PostgreSQL: one statement per batch, row locks in key order, fresh statistics."""

    row_lock = " FOR UPDATE"
    insert_once = "ON CONFLICT (tenant, digest) DO NOTHING "

    def upsert_accounts(
        self, pipe: Any, keys: Sequence[LedgerKey], added: Mapping[str, Any], now: str
    ) -> tuple[list[Any], int | None]:
        # One INSERT ... SELECT FROM unnest ... ON CONFLICT, which also opens the
        # transaction and reports the policy version.
        rows = pipe.query(statements.PG_UPSERT, {**added, "now": now, **statements.key_parts(keys)})
        return rows, rows[0][16]

    def window_rows(self, pipe: Any, scopes: Sequence[WindowScope], now: str) -> list[Any]:
        parts = {
            "tenants": statements.newline_joined([scope[0] for scope in scopes]),
            "query_types": statements.newline_joined([scope[1] for scope in scopes]),
            "windows": statements.newline_joined([scope[2] for scope in scopes]),
        }
        return pipe.query(statements.PG_LOCK_WINDOWS, {**parts, "now": now})

    def set_pending_residual(self, pipe: Any, stored: str | None, ids: Sequence[int]) -> None:
        pipe.send(statements.PG_SET_PENDING_RESIDUAL, {"residual": stored, "ids": list(ids)})

    def insert_reservation_keys(
        self, pipe: Any, reservation_id: str, keys: Sequence[LedgerKey]
    ) -> None:
        pipe.send(
            statements.PG_RESERVATION_KEYS,
            {"reservation_id": reservation_id, **statements.key_parts(keys)},
        )

    def subjects_param(self, subjects: Sequence[str]) -> str:
        return statements.newline_joined(subjects)

    def unpack(self) -> str:
        return "unnest(string_to_array(%(subjects)s, E'\\n')) AS u(s)"

    def store_members(self, pipe: Any, cohort_id: int, subjects: Sequence[str]) -> None:
        # COPY, the cheapest way in. Its text format: a tab between the columns, a
        # backslash escaped; canonical subjects hold no tab or newline (control characters
        # are refused).
        prefix = f"{int(cohort_id)}\t"
        text = "\n".join(subjects).replace("\\", "\\\\")
        pipe.copy_in(
            "COPY dp_cohort_members (cohort_id, subject) FROM STDIN",
            prefix + text.replace("\n", "\n" + prefix) + "\n",
        )

    def written(self, pipe: Any, table: str, rows: int) -> None:
        # ANALYZE counts the transaction's own rows: the statements after plan for them.
        if rows >= ANALYZE_AFTER:
            pipe.query(f"ANALYZE {table}")

    def lock_reservations(self, pipe: Any, held_by: Callable[[], Iterable[str]]) -> None:
        ordered = sorted(set(held_by()))  # code points: the order of the bytes compared
        for chunk in statements.chunks(ordered):
            pipe.query(
                f"SELECT r.id FROM dp_reservations r WHERE r.id IN (SELECT s FROM {self.unpack()}) "
                'ORDER BY r.id COLLATE "C" FOR UPDATE',
                {"subjects": self.subjects_param(chunk)},
            )


class SQLiteWrites(WriteDialect):
    """SQLite: the transaction holds the write lock; batches in chunks of statements."""

    row_lock = ""
    insert_once = ""

    def upsert_accounts(
        self, pipe: Any, keys: Sequence[LedgerKey], added: Mapping[str, Any], now: str
    ) -> tuple[list[Any], int | None]:
        rows: list[Any] = []
        for chunk in statements.chunks(keys):
            rows += pipe.connection.execute(
                statements.sqlite_upsert(),
                [
                    {
                        **key.as_dict(),
                        "rho": 0.0,
                        "residual": None,
                        "gaussian_mu2": 0.0,
                        "releases": 0,
                        "open_reservations": added["add_open"],
                        "pending_rho": added["add_rho"],
                        "pending_residual": None,
                        "pending_mu2": added["add_mu2"],
                        "pending_others": added["add_others"],
                        "updated_at": now,
                    }
                    for key in chunk
                ],
            ).all()
        return rows, None

    def window_rows(self, pipe: Any, scopes: Sequence[WindowScope], now: str) -> list[Any]:
        rows: list[Any] = []
        for tenant, query_type, window in scopes:
            scope = {"tenant": tenant, "query_type": query_type, "window": window}
            pipe.query(statements.SQLITE_NEW_WINDOW, {**scope, "now": now})
            rows += pipe.query(statements.SQLITE_WINDOW, scope)
        return rows

    def set_pending_residual(self, pipe: Any, stored: str | None, ids: Sequence[int]) -> None:
        for chunk in statements.chunks(ids):
            pipe.connection.execute(
                update(Account).where(Account.id.in_(chunk)).values(pending_residual=stored)
            )

    def insert_reservation_keys(
        self, pipe: Any, reservation_id: str, keys: Sequence[LedgerKey]
    ) -> None:
        for offset, chunk in enumerate(statements.chunks(keys)):
            pipe.connection.execute(
                insert(ReservationKey),
                [
                    {
                        "reservation_id": reservation_id,
                        "position": offset * statements.CHUNK + i,
                        **key.as_dict(),
                    }
                    for i, key in enumerate(chunk)
                ],
            )

    def subjects_param(self, subjects: Sequence[str]) -> str:
        return json.dumps(list(subjects))

    def unpack(self) -> str:
        return "(SELECT value AS s FROM json_each(%(subjects)s))"

    def store_members(self, pipe: Any, cohort_id: int, subjects: Sequence[str]) -> None:
        for start in range(0, len(subjects), _MEMBERS_PER_INSERT):
            pipe.query(
                "INSERT INTO dp_cohort_members (cohort_id, subject) "
                f"SELECT %(cohort)s, s FROM {self.unpack()}",
                {
                    "cohort": cohort_id,
                    "subjects": self.subjects_param(subjects[start : start + _MEMBERS_PER_INSERT]),
                },
            )

    def written(self, pipe: Any, table: str, rows: int) -> None:
        """SQLite plans by its indexes, without statistics: nothing to refresh."""

    def lock_reservations(self, pipe: Any, held_by: Callable[[], Iterable[str]]) -> None:
        """The transaction holds SQLite's write lock: no reservation can move meanwhile."""


POSTGRESQL = PostgreSQLWrites()
SQLITE = SQLiteWrites()


def for_dialect(name: str) -> WriteDialect:
    """The write dialect of a SQLAlchemy dialect name."""
    return POSTGRESQL if name == "postgresql" else SQLITE
