"""Holdings: the account each key is charged to, read without locking, and its receipt.

An account key's own account; a subject key's through its membership, live or, for a
sealed window, its final one; nothing for a subject never charged. What a receipt,
``account_of`` and a repeated commit read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, func, select, tuple_

from dp_budget_provider.ledger.accounts import classes
from dp_budget_provider.ledger.accounts.classes import Scope
from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.accounts.memberships import Arm, in_scope, memberships
from dp_budget_provider.ledger.accounts.pricing import Pricing
from dp_budget_provider.ledger.accounts.spend import Pending, Spend
from dp_budget_provider.ledger.accounts.subject_rows import LIVE, SEALED, Store, on
from dp_budget_provider.ledger.errors import LedgerError
from dp_budget_provider.ledger.records import SpendReceipt
from dp_budget_provider.ledger.storage import statements
from dp_budget_provider.ledger.storage.schema import SealedAccount
from dp_budget_provider.ledger.storage.schema import Window as WindowRow
from dp_budget_provider.ledger.windows.policy_store import PolicyStore


class Holdings:
    """Reads what keys hold, and their receipts, in the caller's transaction."""

    def __init__(self, pricing: Pricing, policies: PolicyStore) -> None:
        self._pricing = pricing
        self._policies = policies

    def held(
        self, connection: Connection, keys: Sequence[LedgerKey]
    ) -> dict[LedgerKey, statements.LockedAccount]:
        """The account each key is charged to (read, not locked): an account key's own, a
        subject key's through its membership, live or, for a sealed window, its final
        one; nothing for a subject never charged.

        Refuses (:class:`LedgerError`) a key of a window sealed before final spends were
        kept (revision 0011): its spend is not stored, and zero would be a lie."""
        found = self.held_in(connection, keys, LIVE)
        missing = [key for key in keys if key not in found]
        if missing:
            found.update(self.held_in(connection, missing, SEALED))
            _refuse_unkept(connection, [key for key in missing if key not in found])
        return found

    def held_in(
        self, connection: Connection, keys: Sequence[LedgerKey], store: Store
    ) -> dict[LedgerKey, statements.LockedAccount]:
        """:meth:`held` in one store (the live accounts or the sealed ones)."""
        found: dict[LedgerKey, statements.LockedAccount] = {}
        size = self._pricing.orders.size
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

    def receipts(self, connection: Connection, keys: list[LedgerKey]) -> list[SpendReceipt]:
        """Receipts of account or subject keys (a subject's: one subject at its class's
        spend; an untouched one's: nothing spent)."""
        held = self.held(connection, keys)
        zero = statements.LockedAccount(0, Spend(), Pending(), 0, 0, None, 1)
        accounts = [held.get(key, zero) for key in keys]
        return self._pricing.receipts(
            keys,
            [account.spend for account in accounts],
            self._policies.read(connection),
            [
                account.size if classes.is_label(key.subject) else 1
                for key, account in zip(keys, accounts, strict=True)
            ],
        )


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
