"""Reading: receipts, accounts, history and open reservations (no writes)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, union_all

from dp_budget_provider.ledger.accounts import classes, concerning
from dp_budget_provider.ledger.accounts.covered import in_lock_order, one_key
from dp_budget_provider.ledger.accounts.holdings import Holdings
from dp_budget_provider.ledger.accounts.keys import LedgerKey, canonical_part, whole_number
from dp_budget_provider.ledger.accounts.pricing import Pricing
from dp_budget_provider.ledger.accounts.standing import ReadableLedger, Standings
from dp_budget_provider.ledger.accounts.subject_rows import LIVE, SEALED, STORES
from dp_budget_provider.ledger.records import OPEN, AccountStatus, Reservation, SpendReceipt
from dp_budget_provider.ledger.releases import reservation_rows
from dp_budget_provider.ledger.storage import history, statements
from dp_budget_provider.ledger.storage.schema import HistoryEntry
from dp_budget_provider.ledger.storage.schema import Reservation as ReservationRow
from dp_budget_provider.ledger.storage.transactions import LedgerDatabase
from dp_budget_provider.ledger.windows.policy_store import (
    PolicyStore,
    policy_for,
    policy_of_scope,
)


class Reading:
    """Reading: receipts, accounts, history and open reservations (no writes)."""

    def __init__(
        self,
        database: LedgerDatabase,
        pricing: Pricing,
        holdings: Holdings,
        store: PolicyStore,
        readable: ReadableLedger,
    ) -> None:
        self._database = database
        self._pricing = pricing
        self._holdings = holdings
        self._store = store
        self._readable = readable  # what a standing reads: pricing, a read

    # ------------------------------------------------------------------ reading

    def account_of(self, key: LedgerKey) -> LedgerKey | None:
        """The account (spend class) subject key ``key`` is charged to; None if untouched.

        An account key is its own account. Every subject of an account holds its spend.
        """
        key = one_key(key)[0]
        with self._database.reading() as connection:
            held = self._holdings.held(connection, [key]).get(key)
            if held is None:
                return None
            if classes.is_label(key.subject):
                return key
            live = key in self._holdings.held_in(connection, [key], LIVE)
            accounts = LIVE.accounts if live else SEALED.accounts
            label = connection.execute(
                select(accounts.subject).where(accounts.id == held.id)
            ).scalar_one()
        return LedgerKey.from_canonical(key.tenant, label, key.query_type, key.window)

    def subject_of(self, account: LedgerKey) -> LedgerKey:
        """A subject of ``account`` (the least), as a subject key: what a receipt of a
        class is shown as. A subject key, or an account that holds no subject, is itself."""
        account = one_key(account)[0]
        with self._database.reading() as connection:
            return classes.example_subject(connection, account)

    def epsilon_of(self, key: LedgerKey) -> float:
        """Committed cumulative eps of ``key`` at the ledger's delta (0 if untouched)."""
        return self.receipt(key).epsilon

    def remaining(self, key: LedgerKey) -> float:
        """Headroom before the cap, never negative."""
        return self.receipt(key).remaining

    def receipt(self, key: LedgerKey) -> SpendReceipt:
        """The committed state of ``key`` as a receipt."""
        keys = in_lock_order(key)
        with self._database.reading() as connection:
            return self._holdings.receipts(connection, keys)[0]

    def accounts(
        self,
        *,
        window: str | None = None,
        tenant: str | None = None,
        limit: int | None = None,
        offset: int = 0,
        sealed: bool = False,
        subject: str | None = None,
    ) -> list[AccountStatus]:
        """Every subject of a live account in key order (subject keys), optionally filtered,
        with its status (committed and held spend, state:
        :mod:`~dp_budget_provider.ledger.accounts.standing`): its account's, which its whole class
        shares.

        A window asked for by name, or ``sealed=True``, includes the sealed windows too:
        each subject's final spend there, state SEALED (its account's ``sealed_at`` set).
        ``subject`` lists one subject's accounts: each query type's, and its totals across
        query types and windows where a cap keeps them.
        """
        if not isinstance(sealed, bool):
            raise ValueError(f"sealed must be True or False, got {sealed!r}")
        wanted = []
        if window is not None:
            wanted.append(("window", canonical_part("window", window)))
        if tenant is not None:
            wanted.append(("tenant", canonical_part("tenant", tenant)))
        if subject is not None:
            wanted.append(("subject", canonical_part("subject", subject)))
        stores = STORES if sealed or window is not None else (LIVE,)
        parts = [
            store.subject_rows().where(*(getattr(store.rows, n) == v for n, v in wanted))
            for store in stores
        ]
        rows_of = union_all(*parts).subquery("rows") if len(parts) > 1 else parts[0].subquery()
        query = (
            select(rows_of)
            .order_by(*(rows_of.c[column.key] for column in statements.KEY_COLUMNS))
            .offset(whole_number("offset", offset))
        )
        if limit is not None:
            query = query.limit(whole_number("limit", limit))
        with self._database.reading() as connection:
            rows = list(connection.execute(query))
            policies = self._store.read(connection)
        standings = Standings(self._readable, lambda t, q: policy_of_scope(policies, t, q))
        return [
            AccountStatus.of(row, standing, policy_for(policies, LedgerKey.from_row(row)))
            for row, standing in zip(rows, standings.of_rows(rows), strict=True)
        ]

    def history(
        self,
        key: LedgerKey | None = None,
        *,
        after_seq: int = 0,
        before_seq: int | None = None,
        limit: int | None = None,
        newest_first: bool = False,
    ) -> list[dict[str, Any]]:
        """History entries in order (all, or those concerning ``key``), as plain dicts:
        numbered above ``after_seq`` and below ``before_seq``, oldest first, or with
        ``newest_first`` the latest ``limit`` of them, newest first.

        Paging with ``after_seq`` never skips an entry: only entries whose number is final
        are returned (see :func:`history.settled_seq`), so one numbered below the last
        entry returned cannot appear later.
        """
        if key is not None:
            key = one_key(key)[0]
        after_seq = whole_number("after_seq", after_seq)
        if limit is not None:
            limit = whole_number("limit", limit)
        if not isinstance(newest_first, bool):
            raise ValueError(f"newest_first must be True or False, got {newest_first!r}")
        order = HistoryEntry.seq.desc() if newest_first else HistoryEntry.seq
        settled = history.settled_seq(self._database.engine)
        query = select(HistoryEntry).where(HistoryEntry.seq > after_seq).order_by(order)
        if before_seq is not None:
            query = query.where(HistoryEntry.seq < whole_number("before_seq", before_seq))
        if settled is not None:
            query = query.where(HistoryEntry.seq <= settled)
        if key is not None:
            query = query.where(HistoryEntry.seq.in_(concerning.entries(key)))
        if limit is not None:
            query = query.limit(limit)
        with self._database.reading() as connection:
            rows = list(connection.execute(query))
        return [history.entry_record(row) for row in rows]

    def open_reservations(self) -> list[Reservation]:
        """Every reservation still open, oldest first."""
        with self._database.reading() as connection:
            rows = list(
                connection.execute(
                    select(ReservationRow)
                    .where(ReservationRow.state == OPEN)
                    .order_by(ReservationRow.created_at)
                )
            )
            return [
                reservation_rows.reservation_of(
                    row, tuple(reservation_rows.keys_of(connection, row.id)), self._pricing
                )
                for row in rows
            ]
