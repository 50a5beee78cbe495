"""Reading: receipts, accounts, history and open reservations (no writes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    func,
    select,
    tuple_,
    union_all,
)

from dp_budget_provider.ledger.accounts import classes, concerning
from dp_budget_provider.ledger.accounts.classes import Scope
from dp_budget_provider.ledger.accounts.keys import (
    LedgerKey,
    canonical_part,
    whole_number,
)
from dp_budget_provider.ledger.accounts.memberships import Arm, in_scope, memberships
from dp_budget_provider.ledger.accounts.spend import Pending, Spend
from dp_budget_provider.ledger.accounts.standing import Standings
from dp_budget_provider.ledger.core import (
    LedgerCore,
)
from dp_budget_provider.ledger.errors import LedgerError
from dp_budget_provider.ledger.records import (
    OPEN,
    AccountStatus,
    Reservation,
    SpendReceipt,
)
from dp_budget_provider.ledger.storage import history, statements
from dp_budget_provider.ledger.storage.schema import (
    HistoryEntry,
    SealedAccount,
)
from dp_budget_provider.ledger.storage.schema import Reservation as ReservationRow
from dp_budget_provider.ledger.storage.schema import Window as WindowRow
from dp_budget_provider.ledger.views.subject_rows import LIVE, SEALED, STORES, Store, on
from dp_budget_provider.ledger.windows.policy_store import (
    policy_for,
)


class ReadingRoom(LedgerCore):
    """Reading: receipts, accounts, history and open reservations (no writes)."""

    # ------------------------------------------------------------------ reading

    def _held(
        self, connection: Connection, keys: Sequence[LedgerKey]
    ) -> dict[LedgerKey, statements.LockedAccount]:
        """The account each key is charged to (read, not locked): an account key's own, a
        subject key's through its membership, live or, for a sealed window, its final
        one; nothing for a subject never charged.

        Refuses (:class:`LedgerError`) a key of a window sealed before final spends were
        kept (revision 0011): its spend is not stored, and zero would be a lie."""
        found = self._held_in(connection, keys, LIVE)
        missing = [key for key in keys if key not in found]
        if missing:
            found.update(self._held_in(connection, missing, SEALED))
            _refuse_unkept(connection, [key for key in missing if key not in found])
        return found

    def _held_in(
        self, connection: Connection, keys: Sequence[LedgerKey], store: Store
    ) -> dict[LedgerKey, statements.LockedAccount]:
        """:meth:`_held` in one store (the live accounts or the sealed ones)."""
        found: dict[LedgerKey, statements.LockedAccount] = {}
        size = self._orders.size
        accounts = store.accounts
        row_columns = on(accounts, statements.ACCOUNT_COLUMNS)
        labelled = [key for key in keys if classes.is_label(key.subject)]
        subjects = [key for key in keys if not classes.is_label(key.subject)]
        for chunk in statements.chunks(labelled):
            rows = connection.execute(
                select(*row_columns).where(
                    tuple_(*on(accounts, statements.KEY_COLUMNS)).in_(
                        [statements.key_tuple(k) for k in chunk]
                    )
                )
            )
            found.update(statements.accounts_by_key(rows, chunk, size))
        by_scope: dict[Scope, list[LedgerKey]] = {}
        for key in subjects:
            by_scope.setdefault((key.tenant, key.query_type, key.window), []).append(key)

        def columns(arm: Arm) -> list[Any]:
            key = (arm.tenant, arm.subject, arm.query_type, arm.window)
            return [accounts.id, *key, *row_columns[5:]]

        for scope, scoped in by_scope.items():
            for chunk in statements.chunks(scoped):
                listed = [key.subject for key in chunk]

                def named(arm: Arm, scope: Scope = scope, listed: list[str] = listed) -> list[Any]:
                    return [*in_scope(*scope)(arm), arm.subject.in_(listed)]

                rows = connection.execute(memberships(columns, named, accounts))
                found.update(statements.accounts_by_key(rows, chunk, size))
        return found

    def _receipts(self, connection: Connection, keys: list[LedgerKey]) -> list[SpendReceipt]:
        """Receipts of account or subject keys (a subject's: one subject at its class's
        spend; an untouched one's: nothing spent)."""
        held = self._held(connection, keys)
        zero = statements.LockedAccount(0, Spend(), Pending(), 0, 0, None, 1)
        accounts = [held.get(key, zero) for key in keys]
        return self._receipts_of(
            keys,
            [account.spend for account in accounts],
            self._policy_store.read(connection),
            [
                account.size if classes.is_label(key.subject) else 1
                for key, account in zip(keys, accounts, strict=True)
            ],
        )

    def account_of(self, key: LedgerKey) -> LedgerKey | None:
        """The account (spend class) subject key ``key`` is charged to; None if untouched.

        An account key is its own account. Every subject of an account holds its spend.
        """
        key = self._one_key(key)[0]
        with self.reading() as connection:
            held = self._held(connection, [key]).get(key)
            if held is None:
                return None
            if classes.is_label(key.subject):
                return key
            live = key in self._held_in(connection, [key], LIVE)
            accounts = LIVE.accounts if live else SEALED.accounts
            label = connection.execute(
                select(accounts.subject).where(accounts.id == held.id)
            ).scalar_one()
        return LedgerKey.from_canonical(key.tenant, label, key.query_type, key.window)

    def subject_of(self, account: LedgerKey) -> LedgerKey:
        """A subject of ``account`` (the least), as a subject key: what a receipt of a
        class is shown as. A subject key, or an account that holds no subject, is itself."""
        account = self._one_key(account)[0]
        with self.reading() as connection:
            return classes.example_subject(connection, account)

    def epsilon_of(self, key: LedgerKey) -> float:
        """Committed cumulative eps of ``key`` at the ledger's delta (0 if untouched)."""
        return self.receipt(key).epsilon

    def remaining(self, key: LedgerKey) -> float:
        """Headroom before the cap, never negative."""
        return self.receipt(key).remaining

    def receipt(self, key: LedgerKey) -> SpendReceipt:
        """The committed state of ``key`` as a receipt."""
        keys = self._keys(key)
        with self.reading() as connection:
            return self._receipts(connection, keys)[0]

    def accounts(
        self,
        *,
        window: str | None = None,
        tenant: str | None = None,
        limit: int | None = None,
        offset: int = 0,
        sealed: bool = False,
    ) -> list[AccountStatus]:
        """Every subject of a live account in key order (subject keys), optionally filtered,
        with its status (committed and held spend, state:
        :mod:`~dp_budget_provider.ledger.accounts.standing`): its account's, which its whole class
        shares.

        A window asked for by name, or ``sealed=True``, includes the sealed windows too:
        each subject's final spend there, state SEALED (its account's ``sealed_at`` set).
        """
        if not isinstance(sealed, bool):
            raise ValueError(f"sealed must be True or False, got {sealed!r}")
        wanted = []
        if window is not None:
            wanted.append(("window", canonical_part("window", window)))
        if tenant is not None:
            wanted.append(("tenant", canonical_part("tenant", tenant)))
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
        with self.reading() as connection:
            rows = list(connection.execute(query))
            policies = self._policy_store.read(connection)
        return [
            AccountStatus.of(row, standing, policy_for(policies, LedgerKey.from_row(row)))
            for row, standing in zip(rows, Standings(self).of_rows(rows), strict=True)
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
            key = self._one_key(key)[0]
        after_seq = whole_number("after_seq", after_seq)
        if limit is not None:
            limit = whole_number("limit", limit)
        if not isinstance(newest_first, bool):
            raise ValueError(f"newest_first must be True or False, got {newest_first!r}")
        order = HistoryEntry.seq.desc() if newest_first else HistoryEntry.seq
        settled = history.settled_seq(self._pool())
        query = select(HistoryEntry).where(HistoryEntry.seq > after_seq).order_by(order)
        if before_seq is not None:
            query = query.where(HistoryEntry.seq < whole_number("before_seq", before_seq))
        if settled is not None:
            query = query.where(HistoryEntry.seq <= settled)
        if key is not None:
            query = query.where(HistoryEntry.seq.in_(concerning.entries(key)))
        if limit is not None:
            query = query.limit(limit)
        with self.reading() as connection:
            rows = list(connection.execute(query))
        return [history.entry_record(row) for row in rows]

    def open_reservations(self) -> list[Reservation]:
        """Every reservation still open, oldest first."""
        with self.reading() as connection:
            rows = list(
                connection.execute(
                    select(ReservationRow)
                    .where(ReservationRow.state == OPEN)
                    .order_by(ReservationRow.created_at)
                )
            )
            return [
                self._reservation_from_row(row, tuple(self._reservation_keys(connection, row.id)))
                for row in rows
            ]


def _refuse_unkept(connection: Connection, keys: Sequence[LedgerKey]) -> None:
    """Refuse keys (found in no account) of a window sealed before final spends were kept
    (revision 0011): the reset deleted their accounts, so whether and how much they were
    charged is only in the history, and reading them as untouched would answer zero."""
    scopes = sorted({(key.tenant, key.query_type, key.window) for key in keys})
    for chunk in statements.chunks(scopes):
        sealed = tuple_(WindowRow.tenant, WindowRow.query_type, WindowRow.window)
        kept = (
            select(func.count())
            .where(
                SealedAccount.tenant == WindowRow.tenant,
                SealedAccount.query_type == WindowRow.query_type,
                SealedAccount.window == WindowRow.window,
            )
            .scalar_subquery()
        )
        unkept = connection.execute(
            select(WindowRow.tenant, WindowRow.query_type, WindowRow.window, WindowRow.sealed_at)
            .where(sealed.in_(chunk), WindowRow.sealed_at.is_not(None), kept == 0)
            .limit(1)
        ).first()
        if unkept is not None:
            tenant, query_type, window, at = unkept
            raise LedgerError(
                f"window {window!r} of tenant {tenant!r}, query type {query_type!r} was sealed "
                f"at {at} by a version that did not keep final spends: its accounts are gone "
                "and its spend is only in the history (dp-budget history)"
            )
