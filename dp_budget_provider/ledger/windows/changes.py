"""Windows and re-scoring: reset of closed windows, rescope and correction of accounts."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import (
    delete,
    insert,
    literal,
    select,
    tuple_,
    update,
)

from dp_budget_provider.accounting import (
    Mechanism,
)
from dp_budget_provider.accounting import validation as check
from dp_budget_provider.ledger.accounts.classes import Charge
from dp_budget_provider.ledger.accounts.covered import mechanism_of, one_key
from dp_budget_provider.ledger.accounts.keys import (
    LedgerKey,
    canonical_part,
    free_text,
)
from dp_budget_provider.ledger.accounts.pricing import Pricing
from dp_budget_provider.ledger.accounts.spend import Spend
from dp_budget_provider.ledger.errors import LedgerError, WindowBusy
from dp_budget_provider.ledger.records import (
    SpendReceipt,
)
from dp_budget_provider.ledger.releases.locks import ChargeLocks, charged_once_more_if_stale
from dp_budget_provider.ledger.storage import clock, statements
from dp_budget_provider.ledger.storage.entries import CorrectionEntry, RescopeEntry, ResetEntry
from dp_budget_provider.ledger.storage.journal import Journal
from dp_budget_provider.ledger.storage.schema import (
    Account,
    SealedAccount,
)
from dp_budget_provider.ledger.storage.schema import Window as WindowRow
from dp_budget_provider.ledger.storage.transactions import LedgerDatabase
from dp_budget_provider.ledger.windows import maintenance, scopes
from dp_budget_provider.ledger.windows.calendar import NEVER, is_closed, window_bounds
from dp_budget_provider.ledger.windows.policies import Policies
from dp_budget_provider.ledger.windows.policy import SCOPE_ACCOUNTS
from dp_budget_provider.ledger.windows.policy_store import PolicyStore, policy_lookup


class WindowChanges:
    """Windows and re-scoring: reset of closed windows, rescope and correction of accounts."""

    def __init__(
        self,
        database: LedgerDatabase,
        journal: Journal,
        pricing: Pricing,
        locks: ChargeLocks,
        policies: Policies,
        store: PolicyStore,
    ) -> None:
        self._database = database
        self._journal = journal
        self._pricing = pricing
        self._locks = locks
        self._policies = policies
        self._store = store

    # ------------------------------------------------------------------ windows and re-scoring

    def windows_for(
        self, tenant: str, query_type: str, start: datetime, end: datetime | None = None
    ) -> list[str]:
        """The windows a release reading the data interval [start, end) is charged to.

        The scope's calendar decides (``end`` omitted: the moment ``start``); the
        reservation checks the labels again against the policy in force when it is made.
        """
        calendar = self._policies.policy_for_scope(tenant, query_type).calendar
        return calendar.windows_overlapping(start, start if end is None else end)

    def reset(self, window: str) -> int:
        """Seal a closed window and move its accounts out of the live ones; returns how
        many subjects they held. History is kept, and so is each subject's final spend.

        A window may be reset once it has ended and every scope charged in it is past
        its policy's grace period, by the ledger's own clock. Sealing comes first and is
        final: a sealed window is never charged again (a late, retried or backfilled run
        is refused), so moving its accounts out never refunds anything. They move, one row
        per class, to ``dp_sealed_accounts`` with their members left where they are (a
        class's cohort, or its ``dp_members`` rows and its cohorts' listings), so the final
        spend of every subject stays readable, state SEALED, while what reservations lock
        and scan holds the live windows only. Refuses a window
        that is open, within its grace period, not a calendar label at all (it can never
        be proven closed), or that still has open reservations (reap them first).
        Resetting a sealed, or a closed never-charged, window does nothing; a window that
        has not ended is refused whether or not anything was charged in it yet.
        """
        label = canonical_part("window", window)
        try:
            _, end = window_bounds(label)
        except ValueError as error:
            raise LedgerError(
                f"window {label!r} is not a calendar window, so it can never be proven closed"
            ) from error
        with self._database.write() as connection:
            moment = clock.now()
            now = clock.stamp(moment)
            if not is_closed(label, moment):
                # Refused even where nothing is charged yet: "0 accounts dropped" would read
                # as done, and the window's runs are still to come.
                ends = "never ends" if end == NEVER else f"ends at {clock.stamp(end)}"
                raise LedgerError(
                    f"window {label!r} is open, it has not closed: it {ends} (now {now})"
                )
            policy_of = policy_lookup(self._store.read(connection))
            scopes = [
                (row.tenant, row.query_type)
                for row in connection.execute(
                    select(WindowRow.tenant, WindowRow.query_type)
                    .where(WindowRow.window == label, WindowRow.sealed_at.is_(None))
                    .order_by(
                        *statements.lock_order(connection, (WindowRow.tenant, WindowRow.query_type))
                    )
                    .with_for_update()
                )
            ]
            for tenant, query_type in scopes:
                grace = policy_of(LedgerKey.from_canonical(tenant, "-", query_type, label)).grace
                if not is_closed(label, moment, grace):
                    raise LedgerError(
                        f"window {label!r} of tenant {tenant!r}, query type {query_type!r} is "
                        f"open or within its grace period of {grace} at {now}; resetting it "
                        "would cut off the runs still due to charge it"
                    )
            if not scopes:
                return 0
            scoped = tuple_(Account.tenant, Account.query_type).in_(scopes)
            rows = list(
                connection.execute(
                    select(Account.id, Account.open_reservations, Account.size)
                    .where(Account.window == label, scoped)
                    .order_by(*statements.lock_order(connection))
                    .with_for_update()
                )
            )
            busy = sum(1 for row in rows if row.open_reservations)
            if busy:
                raise WindowBusy(
                    f"window {label!r} has {busy} account(s) with open reservations; reap first"
                )
            connection.execute(
                update(WindowRow)
                .where(
                    WindowRow.window == label,
                    tuple_(WindowRow.tenant, WindowRow.query_type).in_(scopes),
                )
                .values(sealed_at=now)
            )
            moved = [column.key for column in Account.__table__.columns if column.key != "id"]
            for chunk in statements.chunks([row.id for row in rows]):
                connection.execute(
                    insert(SealedAccount).from_select(
                        [*moved, "sealed_at"],
                        select(*(getattr(Account, key) for key in moved), literal(now)).where(
                            Account.id.in_(chunk)
                        ),
                    )
                )
                connection.execute(delete(Account).where(Account.id.in_(chunk)))
            self._journal.append(
                connection,
                ResetEntry(
                    window=label,
                    accounts=len(rows),
                    subjects=sum(row.size for row in rows),
                    sealed=tuple(scopes),
                    kept=True,  # the final spend moved to dp_sealed_accounts
                ),
                at=now,
            )
        return sum(row.size for row in rows)

    def reset_closed(self) -> dict[str, int]:
        """Reset every window past its grace period (the ledger's clock); accounts dropped per
        window (subjects, see :meth:`reset`). Windows that can never close (not calendar
        labels, or ending past the year 9999) are left alone, as are those still within a
        scope's grace period.

        A closed window that still holds open reservations does not hold up the others:
        every other due window is reset, then :class:`WindowBusy` names what was reset and
        what must wait for its reservations to close. Only a run that left no due window
        unsealed counts as the reset job's run (:mod:`maintenance`)."""
        moment = clock.now()
        with self._database.reading() as connection:
            policy_of = policy_lookup(self._store.read(connection))
            rows = connection.execute(
                select(WindowRow.tenant, WindowRow.query_type, WindowRow.window).where(
                    WindowRow.sealed_at.is_(None)
                )
            ).all()
        due: dict[str, bool] = {}
        for tenant, query_type, label in rows:
            grace = policy_of(LedgerKey.from_canonical(tenant, "-", query_type, label)).grace
            due[label] = due.get(label, True) and is_closed(label, moment, grace)
        done: dict[str, int] = {}
        waiting: list[str] = []
        for label in sorted(label for label, closed in due.items() if closed):
            try:
                done[label] = self.reset(label)
            except WindowBusy as busy:
                waiting.append(str(busy))
        if waiting:
            reset = ", ".join(f"{label} ({n} accounts)" for label, n in done.items()) or "none"
            raise WindowBusy(f"reset {reset}; not yet: {'; '.join(waiting)}")
        maintenance.ran(self._database, maintenance.RESET, self._journal.actor)
        return done

    def rescope(self, old: LedgerKey, new: LedgerKey, reason: str = "") -> SpendReceipt:
        """Re-classify ``old``'s releases as query type ``new`` (snapshot -> trajectory).

        Only the query type changes: tenant, subject and window stay, so a rescope can
        never move spend onto another person or out of its window. The spend already
        charged to ``old`` is added to ``new`` (the subject's cumulative loss is unchanged
        at the moment of re-classification; only later releases cost more), and ``old``
        is sealed: its row stays, naming ``new``'s query type, and it is never charged
        again, so it can never restart from zero.
        """
        if not isinstance(old, LedgerKey) or not isinstance(new, LedgerKey):
            raise ValueError("rescope takes two LedgerKey objects")
        if (old.tenant, old.subject, old.window) != (new.tenant, new.subject, new.window):
            raise ValueError(
                "rescope re-classifies one subject's window: tenant, subject and window stay, "
                "only the query type changes"
            )
        if old.query_type == new.query_type:
            raise ValueError("rescope needs a different query type")
        scopes.refuse_scope_names({old.query_type, new.query_type})
        reason = free_text("reason", reason, limit=2000)
        keys = sorted([old, new])
        with self._database.pipelined() as pipe:
            moment = clock.now()
            now = clock.stamp(moment)
            locked, policies, charge = self._locks.lock_chargeable(pipe, keys, moment)
            policy_of = policy_lookup(policies)
            divided = [key.query_type for key in (old, new) if policy_of(key).shares]
            if divided:
                raise LedgerError(
                    f"query type {divided[0]!r} of tenant {old.tenant!r} has its cap divided "
                    "among principals: a rescope would move every principal's spend through "
                    "the scope's own accounts and seal the key for all of them, which one "
                    "principal's task may not do; release under the new query type instead"
                )
            source, target = charge.account_of(old), charge.account_of(new)
            if locked[source].open_reservations:
                raise LedgerError(f"{old} has open reservations; commit or reap them first")
            carried = locked[source].spend
            merged = locked[target].spend.plus(carried)
            connection = pipe.core()
            statements.store_spend(
                connection, locked[target].id, merged, locked[source].releases, now
            )
            connection.execute(
                update(Account)
                .where(Account.id == locked[source].id)
                .values(rescoped_to=new.query_type, updated_at=now)
            )
            seq = self._journal.append_piped(
                pipe,
                RescopeEntry(
                    source=source,
                    subject=old.subject,
                    carried=carried,
                    reason=reason,
                    cohorts=charge.recorded(),
                ),
                at=now,
                keys=[target],
            )
            charge.link(pipe, seq)
            return self._pricing.receipts([new], [merged], policies, [1])[0]

    def correct(
        self,
        key: LedgerKey,
        mechanism: Mechanism | Mapping[str, Any],
        count: int = 1,
        reason: str = "",
    ) -> SpendReceipt:
        """Charge a release the ledger missed, as a new audited entry (never an edit).

        Corrections only add spend: an under-count is fixed by charging, and nothing
        is ever refunded. The cap is not checked: the release already happened. A sealed
        window or re-scoped key is refused like a release (its accounts are gone or moved);
        record such a correction on the key its spend lives on. Like a release, it is
        charged to the subject's totals at every wider scope whose cap applies
        (:mod:`scopes`): one entry per account, each naming its own.
        """
        keys = one_key(key)
        mechanism = mechanism_of(mechanism)
        count = check.count("count", count)
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError("a correction needs a reason")
        free_text("reason", reason, limit=2000)
        cost = self._pricing.cost(mechanism, count)

        return charged_once_more_if_stale(
            lambda: self._corrected(keys, mechanism, count, cost, reason)
        )

    def _corrected(
        self, keys: list[LedgerKey], mechanism: Mechanism, count: int, cost: Spend, reason: str
    ) -> SpendReceipt:
        """A correction's transaction: its key's account and the subject's totals at every
        wider scope charged, one history entry per account."""
        with self._database.pipelined() as pipe:
            moment = clock.now()
            now = clock.stamp(moment)
            locked, policies, charge = self._locks.lock_chargeable(pipe, keys, moment, wider=True)
            connection = pipe.core()
            spent = {}
            # The key's own account first, naming the totals that follow it.
            cohorts = sorted(charge.cohorts, key=lambda c: c.scope[1] in SCOPE_ACCOUNTS)
            totals = tuple(c.scope[1] for c in cohorts if c.scope[1] in SCOPE_ACCOUNTS)
            for cohort in cohorts:  # the subject alone in each scope: one account
                tenant, query_type, window = cohort.scope
                account = LedgerKey.from_canonical(tenant, cohort.accounts[0], query_type, window)
                held = locked[account]
                spent[account] = held.spend.plus(cost)
                statements.store_spend(connection, held.id, spent[account], count, now)
                seq = self._journal.append_piped(
                    pipe,
                    CorrectionEntry(
                        mechanism=mechanism.to_spec(),
                        count=count,
                        cost=cost,
                        reason=reason,
                        cohorts=(cohort.recorded(),),
                        totals=None if cohort.scope[1] in SCOPE_ACCOUNTS or not totals else totals,
                    ),
                    at=now,
                    keys=[account],
                )
                Charge(keys=[account], cohorts=[cohort]).link(pipe, seq)
            after = spent[charge.account_of(keys[0])]
            return self._pricing.receipts(keys, [after], policies, [1])[0]
