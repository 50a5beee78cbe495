"""The locks and refusals of every write that adds spend: one gate, one order.

A reservation, a rescope and a correction lock the windows they charge (refusing a
sealed one, a quarantined ledger, a window not yet begun or past its grace period), then
the accounts of their classes in key order; a commit, release or reap locks the accounts
its reservation holds. The budget check asks the same questions without locking
(:meth:`ChargeLocks.refuse_unchargeable`), so both refuse alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar

import numpy as np
from sqlalchemy import Connection, func, select, text, tuple_

from dp_budget_provider.accounting.rounding import ROUND_UP
from dp_budget_provider.ledger.accounts import classes
from dp_budget_provider.ledger.accounts.covered import Charged
from dp_budget_provider.ledger.accounts.held import HeldState
from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.accounts.spend import Spend
from dp_budget_provider.ledger.errors import (
    LedgerCorrupt,
    LedgerError,
    LedgerQuarantined,
    WindowClosed,
    WindowSealed,
)
from dp_budget_provider.ledger.storage import clock, pipeline, statements
from dp_budget_provider.ledger.storage.schema import LedgerConfig, ReservationKey
from dp_budget_provider.ledger.storage.schema import Window as WindowRow
from dp_budget_provider.ledger.windows import scopes
from dp_budget_provider.ledger.windows.calendar import display_window, is_closed, window_bounds
from dp_budget_provider.ledger.windows.policy import Policy
from dp_budget_provider.ledger.windows.policy_store import Policies, PolicyStore, policy_lookup
from dp_budget_provider.ledger.windows.shares import dag_of

_T = TypeVar("_T")
_CLEAR = (
    ": verify found the ledger's tables or history inconsistent. Nothing can be released "
    "until an operator has investigated and cleared it (`dp-budget quarantine clear "
    "--reason ...`, audited); `dp-budget quarantine show` says why"
)


class PoliciesChanged(LedgerError):
    """The policies a charge chose its wider scopes by are not those in force under its
    locks (the last ones read were stale, or an administrator changed them meanwhile):
    the charge's transaction rolls back with nothing written."""


def charged_once_more_if_stale(charge: Callable[[], _T]) -> _T:
    """Run ``charge`` (a whole write transaction); once more if it met
    :class:`PoliciesChanged`: the policies it read under its locks are then the ones
    remembered, so a second change must have happened meanwhile to refuse it again."""
    try:
        return charge()
    except PoliciesChanged:
        return charge()


class ChargeLocks:
    """Locks what a charge touches, refusing what no charge may touch."""

    def __init__(self, grid_size: int, policies: PolicyStore) -> None:
        self._size = grid_size
        self._policies = policies

    # ------------------------------------------------------------------ locking

    def lock_accounts(
        self,
        pipe: pipeline.Pipeline,
        keys: Sequence[LedgerKey],
        now: str,
        reserving: Spend | None = None,
    ) -> tuple[dict[LedgerKey, statements.LockedAccount], int | None]:
        """Create missing accounts and lock all of them in key order.

        ``reserving`` opens a reservation of that cost on every account: the open count
        and the pending rho and mu^2 go up in the same statement (one row version, not
        two); a residual curve, if the cost has one, is the caller's to add. The returned
        rows hold the values after. PostgreSQL: one ``INSERT ... SELECT FROM unnest ...
        ON CONFLICT`` statement, which also opens the transaction and reports the policy
        version. SQLite (already holding the write lock): upserts in chunks; no version.
        """
        size = self._size
        gaussian = reserving is None or reserving.gaussian_mu2 is not None
        added = {
            "add_open": 0 if reserving is None else 1,
            "add_rho": 0.0 if reserving is None else reserving.rho,
            "add_mu2": reserving.gaussian_mu2 if reserving is not None and gaussian else 0.0,
            "add_others": 0 if gaussian else 1,
            "round_up": ROUND_UP,
        }
        rows, version = pipe.dialect.upsert_accounts(pipe, keys, added, now)
        return statements.accounts_by_key(rows, keys, size), version

    def lock_existing(
        self, pipe: pipeline.Pipeline, keys: Sequence[LedgerKey]
    ) -> dict[LedgerKey, statements.LockedAccount]:
        """Lock existing accounts ``keys`` in key order, writing nothing (a decision read
        under the locks of the charge that follows: an account row changed without a
        history entry would fail ``verify``); LedgerCorrupt if one is missing."""
        rows = []
        for key in keys:
            found = pipe.query(
                f"SELECT {statements.ACCOUNT_ROW} FROM dp_accounts WHERE tenant = %(t)s AND "
                'subject = %(s)s AND query_type = %(q)s AND "window" = %(w)s'
                + pipe.dialect.row_lock,
                {"t": key.tenant, "s": key.subject, "q": key.query_type, "w": key.window},
            )
            if len(found) != 1:
                raise LedgerCorrupt(f"account {key} holds subjects but has no row")
            rows.append(found[0])
        return statements.accounts_by_key(rows, keys, self._size)

    def lock_chargeable(
        self,
        pipe: pipeline.Pipeline,
        keys: Sequence[LedgerKey],
        moment: datetime,
        reserving: Spend | None = None,
        cohorts: Sequence[classes.CohortKeys] = (),
        *,
        wider: bool = False,
        attempt: str | None = None,
    ) -> tuple[dict[LedgerKey, statements.LockedAccount], Policies, classes.Charge]:
        """Lock the windows ``keys`` (subject keys) charge and the accounts of their
        classes, refusing any that may not be charged.

        With ``wider`` (a release or a correction: new spend), the subjects' totals at
        every wider scope whose cap applies are charged too (:mod:`scopes`), chosen by
        the policies in force under the locks: if they changed between the choice and
        the locks, the charge is refused (:class:`PoliciesChanged`, which
        :func:`charged_once_more_if_stale` retries once: then it chooses anew). A release
        (its ``attempt`` given) is also charged to its principal's share accounts wherever
        a cap is divided (:mod:`shares`); a correction (none) is not.

        The one gate of every write that adds spend (reserve, rescope, correct): a sealed
        window, a re-scoped account, a label that is not its scope calendar's own, a
        window that has not begun, or (for a new release: ``reserving``) a window past its
        grace period is refused, and the transaction rolls back with nothing written. The
        windows' classes are refined for the subjects first (see :mod:`classes`). Returns
        the locked accounts, the policies in force and the charge (its account keys in
        lock order, and its cohorts for the history entry).
        """
        now = clock.stamp(moment)
        chosen_by = self._policies.current(pipe) if wider else None
        if chosen_by is not None:
            keys, cohorts = scopes.with_wider_scopes(
                keys, cohorts, chosen_by, shared=attempt is not None, dag=dag_of(attempt)
            )
        self.lock_windows(pipe, [*keys, *cohorts], now)
        charge = classes.accounts_for(pipe, keys, now, cohorts)
        locked, version = self.lock_accounts(pipe, charge.keys, now, reserving)
        policies = self._policies.at(pipe, version)
        if (
            chosen_by is not None
            and policies is not chosen_by
            and not scopes.same_wider_scopes(chosen_by, policies, {k.tenant for k in charge.keys})
        ):
            raise PoliciesChanged(
                "the ledger's policies changed while this charge was being made: it was "
                "refused with nothing written; make it again"
            )
        check_windows(
            charge.keys, policy_lookup(policies), moment, new_release=reserving is not None
        )
        for key in charge.keys:
            moved = locked[key].rescoped_to
            if moved is not None:
                raise _rescoped(classes.example_subject(pipe.core(), key), moved)
        return locked, policies, charge

    def lock_windows(self, pipe: pipeline.Pipeline, keys: Sequence[Charged], now: str) -> None:
        """Create and share-lock the window rows ``keys`` charge; refuse a sealed one.

        Every account's scope and window has a row in ``dp_windows``; a reset seals it
        under an exclusive lock before dropping the accounts, so a window is either
        chargeable for this whole transaction or refused here (:class:`WindowSealed`).
        The same statement reads the quarantine: a quarantined ledger charges nothing.
        """
        scopes = sorted({(key.tenant, key.query_type, key.window) for key in keys})
        rows = pipe.dialect.window_rows(pipe, scopes, now)
        if len(rows) != len(scopes):
            raise LedgerCorrupt(f"{len(scopes)} windows charged but {len(rows)} window rows found")
        self.refuse_quarantined(
            *rows[0][4:], reason=lambda: pipe.query(statements.QUARANTINE_REASON)[0][0]
        )
        for tenant, query_type, window, sealed_at, *_ in rows:
            if sealed_at is not None:
                raise _sealed(tenant, query_type, window, sealed_at)

    def refuse_quarantined(
        self,
        since: str | None,
        epoch: int,
        clearance: str | None,
        quarantines: int,
        *,
        reason: Callable[[], str],
    ) -> None:
        """Refuse to charge a quarantined ledger, or one whose last quarantine was lifted
        without its administrator's signature (by SQL, by code without the key, or by
        rolling the counter back to an earlier quarantine's clearing: ``epoch`` below the
        ``quarantines`` the history records).

        The one decision of whether the ledger may charge: every write that adds spend
        reads these columns under its lock and asks here.
        """
        if epoch < quarantines:
            raise LedgerQuarantined(
                f"the ledger's quarantine counter ({epoch}) is below the {quarantines} "
                f"quarantine(s) its history records: rolled back in its database, so its "
                f"last quarantine is still in force{_CLEAR}"
            )
        if since is not None:
            raise LedgerQuarantined(f"the ledger is quarantined since {since} ({reason()}){_CLEAR}")
        if not self._policies.authority.cleared(epoch, clearance):
            raise LedgerQuarantined(
                f"the ledger's quarantine #{epoch} was lifted without its administrator's "
                f"signature (by SQL, or by code without the administrator key): it is still "
                f"in force{_CLEAR}"
            )

    def refuse_if_quarantined(self, connection: Connection) -> None:
        """:meth:`refuse_quarantined` on the state ``connection``'s transaction reads."""
        config = connection.execute(
            select(
                LedgerConfig.quarantined_at,
                LedgerConfig.quarantine_epoch,
                LedgerConfig.clearance,
                text(f"({statements.QUARANTINES})"),
                LedgerConfig.quarantine_reason,
            ).where(LedgerConfig.id == 1)
        ).one()
        self.refuse_quarantined(*config[:4], reason=lambda: config.quarantine_reason)

    def refuse_unchargeable(
        self,
        connection: Connection,
        keys: Sequence[Charged],
        states: Sequence[HeldState],
        policies: Policies,
    ) -> None:
        """Raise what :meth:`lock_chargeable` raises whatever the budget, in its order,
        reading without locking or creating anything: a quarantined ledger, a sealed
        window, a label that is not its calendar's, has not begun or is past its grace
        period, a re-scoped key."""
        self.refuse_if_quarantined(connection)
        scope_keys = refuse_sealed(connection, keys)
        check_windows(
            list(scope_keys.values()), policy_lookup(policies), clock.now(), new_release=True
        )
        for state in states:
            if state.rescoped_to is not None:
                raise _rescoped(state.example, state.rescoped_to)

    def lock_reservation(
        self, connection: Connection, reservation_id: str
    ) -> tuple[list[LedgerKey], dict[LedgerKey, statements.LockedAccount]]:
        """Lock every account a reservation holds, in key order, joined on the server side.

        Its keys are those it reserved and the new parts of any of them that split while
        it was open (see :mod:`classes`). One indexed join instead of key lists.
        """
        rows = connection.execute(
            statements.lock_reservation_accounts(connection),
            {"rid": reservation_id},
        ).all()
        held = connection.execute(
            select(func.count())
            .select_from(ReservationKey)
            .where(ReservationKey.reservation_id == reservation_id)
        ).scalar_one()
        if len(rows) != held:
            raise LedgerCorrupt(
                f"reservation {reservation_id} holds {held} keys but only {len(rows)} "
                "accounts exist"
            )
        keys = [LedgerKey.from_row(row) for row in rows]
        return keys, statements.accounts_by_key(rows, keys, self._size)

    def add_pending_residual(
        self,
        pipe: pipeline.Pipeline,
        keys: Sequence[LedgerKey],
        locked: Mapping[LedgerKey, statements.LockedAccount],
        residual: np.ndarray,
    ) -> None:
        """Add a reservation's residual curve to each locked account's pending spend.

        (Its rho and mu^2 went in with the lock.) One statement per distinct value.
        """
        groups: dict[tuple[Any, ...], tuple[str | None, list[int]]] = {}
        for key in keys:
            pending = locked[key].pending
            group = groups.get(pending.signature)
            if group is None:
                added = pending.add(Spend(0.0, residual, 0.0))
                group = groups[pending.signature] = (added.residual_json(), [])
            group[1].append(locked[key].id)
        for stored, ids in groups.values():
            pipe.dialect.set_pending_residual(pipe, stored, ids)


def _sealed(tenant: str, query_type: str, window: str, sealed_at: str) -> WindowSealed:
    return WindowSealed(
        f"window {window!r} of tenant {tenant!r}, query type {query_type!r} was sealed at "
        f"{sealed_at} (reset after its grace period): nothing can be charged to it any more"
    )


def _closed(key: Charged, grace: timedelta) -> WindowClosed:
    end = window_bounds(key.window)[1]
    return WindowClosed(
        f"window {display_window(key.window)!r} of tenant {key.tenant!r}, query type "
        f"{key.query_type!r} ended at {clock.stamp(end)} and its grace period of {grace} is "
        "over: no new release may be charged to it (the reset seals it once the reservations "
        "it holds are committed, released or reaped)"
    )


def _rescoped(key: object, moved: str) -> WindowSealed:
    return WindowSealed(
        f"{key} was re-scoped to query type {moved!r}: its spend lives there now, and this "
        "key can never be charged again"
    )


def check_windows(
    keys: Sequence[Charged],
    policy_of: Callable[[Any], Policy],
    moment: datetime,
    *,
    new_release: bool,
) -> None:
    """Refuse a window that is not its scope calendar's own name for a period, or that
    has not begun (data that does not exist yet cannot be released); for a
    ``new_release``, also one past its grace period (:class:`WindowClosed`)."""
    seen: set[tuple[str, str, str]] = set()
    for key in keys:
        scope = (key.tenant, key.query_type, key.window)
        if scope in seen:
            continue
        seen.add(scope)
        policy = policy_of(key)
        calendar = policy.calendar
        if not calendar.is_canonical(key.window):
            raise ValueError(
                f"window {key.window!r} is not a window of the {calendar.kind} calendar of "
                f"tenant {key.tenant!r}, query type {key.query_type!r}: expected "
                f"{calendar.expected_form}"
            )
        if window_bounds(key.window)[0] > moment:
            raise ValueError(
                f"window {key.window!r} has not begun: data that does not exist yet "
                "cannot be released"
            )
        if new_release and is_closed(key.window, moment, policy.grace):
            raise _closed(key, policy.grace)


def refuse_sealed(
    connection: Connection, keys: Sequence[Charged]
) -> dict[tuple[str, str, str], Charged]:
    """Raise :class:`WindowSealed` if any of ``keys`` lies in a sealed window; returns
    the keys by scope (tenant, query type, window)."""
    scope_keys = {(key.tenant, key.query_type, key.window): key for key in keys}
    scope = (WindowRow.tenant, WindowRow.query_type, WindowRow.window)
    for chunk in statements.chunks(sorted(scope_keys)):
        sealed = connection.execute(
            select(*scope, WindowRow.sealed_at)
            .where(tuple_(*scope).in_(chunk), WindowRow.sealed_at.is_not(None))
            .limit(1)
        ).first()
        if sealed is not None:
            raise _sealed(*sealed)
    return scope_keys
