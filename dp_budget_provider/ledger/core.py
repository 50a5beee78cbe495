"""What every room of the ledger shares: its database, settings, validation, locks.

:class:`~dp_budget_provider.ledger.ledger.PrivacyBudgetLedger` is a facade over rooms
with one job each (reservations, budget checks, reading, windows, audit); each is a
class over this core, so they share one engine, one policy store and one set of caches.
"""

from __future__ import annotations

import contextlib
import getpass
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import numpy as np
from sqlalchemy import (
    Connection,
    Engine,
    func,
    select,
    text,
    tuple_,
    update,
)

from dp_budget_provider.accounting import (
    DEFAULT_ORDERS,
    Conversion,
    EpsilonBound,
    Mechanism,
)
from dp_budget_provider.accounting.conversion import check_conversion
from dp_budget_provider.accounting.orders import validate_orders
from dp_budget_provider.accounting.rounding import ROUND_UP
from dp_budget_provider.ledger.accounts import classes
from dp_budget_provider.ledger.accounts.held import HeldState
from dp_budget_provider.ledger.accounts.keys import (
    LedgerKey,
    canonical_part,
    free_text,
    plain_text,
)
from dp_budget_provider.ledger.accounts.spend import Spend
from dp_budget_provider.ledger.audit.authority import AdminKey, AdminPublicKey
from dp_budget_provider.ledger.errors import (
    LedgerCorrupt,
    LedgerError,
    LedgerQuarantined,
    WindowClosed,
    WindowSealed,
)
from dp_budget_provider.ledger.opening import NewLedger, open_ledger
from dp_budget_provider.ledger.releases.lease import DEFAULT_LEASE, check_lease
from dp_budget_provider.ledger.storage import clock, database, history, pipeline, statements
from dp_budget_provider.ledger.storage.schema import (
    Account,
    LedgerConfig,
    ReservationKey,
)
from dp_budget_provider.ledger.storage.schema import Window as WindowRow
from dp_budget_provider.ledger.windows import maintenance
from dp_budget_provider.ledger.windows.calendar import (
    WindowCalendar,
    display_window,
    is_closed,
    window_bounds,
)
from dp_budget_provider.ledger.windows.policy import ANY, BudgetCap, Policy
from dp_budget_provider.ledger.windows.policy_store import (
    Policies,
    PolicyStore,
    policy_lookup,
    policy_of_scope,
    write_policy,
)

# What a charge covers in a window: subject keys, or a registered cohort's keys there.
Charged = LedgerKey | classes.CohortKeys
# What reserve and the budget checks take: keys, or cohorts' keys in their windows.
Covered = LedgerKey | classes.CohortKeys | Iterable[LedgerKey] | Sequence[classes.CohortKeys]

# How many converted spends a ledger keeps (epsilon bounds, costs) before starting afresh.
BOUND_CACHE_SIZE = 100_000
_CLEAR = (
    ": verify found the ledger's tables or history inconsistent. Nothing can be released "
    "until an operator has investigated and cleared it (`dp-budget quarantine clear "
    "--reason ...`, audited); `dp-budget quarantine show` says why"
)


def _default_actor() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _not_a_key(admin: object) -> AdminKey:
    raise ValueError(f"admin must be an AdminKey, got {type(admin).__name__}")


def _pin(key: str | AdminPublicKey | None) -> AdminPublicKey | None:
    """The administrator key an opener requires (its text, as a connection holds it)."""
    return key if key is None or isinstance(key, AdminPublicKey) else AdminPublicKey(key)


class LedgerCore:
    """The ledger's database, settings and the helpers every room uses."""

    def __init__(
        self,
        cap: BudgetCap | None = None,
        url: str | None = None,
        orders: Sequence[float] | np.ndarray = DEFAULT_ORDERS,
        conversion: Conversion = "improved",
        *,
        actor: str | None = None,
        if_new: BudgetCap | None = None,
        calendar: WindowCalendar | None = None,
        chain_key: str | bytes | None = None,
        lease: timedelta = DEFAULT_LEASE,
        admin: AdminKey | None = None,
        admin_public_key: str | AdminPublicKey | None = None,
        clock_skew: timedelta = clock.DEFAULT_CLOCK_SKEW,
    ) -> None:
        for name, value in (("cap", cap), ("if_new", if_new)):
            if value is not None and not isinstance(value, BudgetCap):
                raise ValueError(f"{name} must be a BudgetCap, got {value!r}")
        self._bound_cache: dict[tuple[Any, ...], EpsilonBound] = {}
        self._cost_cache: dict[tuple[Any, int], Spend] = {}
        self._orders = validate_orders(orders)
        self._conversion: Conversion = check_conversion(conversion)
        self._lease = check_lease(lease)
        self._clock_skew = clock.check_clock_skew(clock_skew)
        self.actor = _default_actor() if actor is None else plain_text("actor", actor)
        self._key = history.ChainKey(chain_key)
        self._engine = database.make_engine(url)
        self._policy_store = PolicyStore(self.reading)
        new = NewLedger(
            self._orders,
            self._conversion,
            calendar or WindowCalendar(),
            self.actor,
            self._key,
            admin if admin is None or isinstance(admin, AdminKey) else _not_a_key(admin),
            _pin(admin_public_key),
        )
        try:
            settings = open_ledger(
                self.reading,
                lambda: database.migrating(self._pool()),
                self._clock_skew,
                self._policy_store,
                new,
                cap,
                if_new,
            )
        except BaseException:
            self._engine.dispose()
            raise
        self._delta, self._chains = settings.delta, settings.chains
        self._authority = settings.authority

    def _log_keyless(
        self, connection: Connection, action: str, now: str, payload: dict[str, Any]
    ) -> int:
        """Append an entry about no key (a reset, a quarantine) on the keyless chain."""
        return history.append(
            connection,
            self._key,
            chain=history.KEYLESS_CHAIN,
            at=now,
            action=action,
            actor=self.actor,
            payload=payload,
        )

    def _ran(self, job: str) -> str:
        """Record that maintenance ``job`` completed now, by the ledger's clock (its own
        small write transaction: the job's work may span many); returns the stamp."""
        with self._write() as connection:
            at = clock.stamp(clock.now())
            maintenance.record(connection, job, at, self.actor)
        return at

    def _chain(self, key: LedgerKey) -> int:
        """The history chain of entries about ``key`` (or a release whose first key it is)."""
        return history.chain_of(key, self._chains)

    def _pool(self) -> Engine:
        """The engine every transaction of this ledger runs on."""
        return self._engine

    def _write(self) -> contextlib.AbstractContextManager[Connection]:
        """A write transaction: it proves its schema revision first and, on PostgreSQL,
        takes the ledger's time from the server (:func:`database.proven`)."""
        return database.transaction(self._pool(), write=True, clock_skew=self._clock_skew)

    def _pipelined(self) -> contextlib.AbstractContextManager[pipeline.Pipeline]:
        """A pipelined write transaction (see :mod:`pipeline`) on a pooled connection."""
        return pipeline.write(self._pool(), self._clock_skew)

    def reading(self) -> contextlib.AbstractContextManager[Connection]:
        """A read-only transaction on the ledger's tables, for reports and the UI.

        The schema (``ledger.schema``) is the contract; writes must go through the
        methods of this class, which keep locks, pending spend and the history chain.
        """
        return database.transaction(self._pool(), write=False)

    def close(self) -> None:
        """Release the database connections."""
        self._engine.dispose()

    @property
    def delta(self) -> float:
        """The ledger's fixed delta."""
        return self._delta

    @property
    def orders(self) -> np.ndarray:
        """The ledger's fixed grid of Rényi orders."""
        return self._orders

    @property
    def conversion(self) -> Conversion:
        """The RDP to (eps, delta) conversion the ledger reports with."""
        return self._conversion

    @property
    def url(self) -> str:
        """The database URL without password."""
        return database.safe_url(self._engine)

    @property
    def lease(self) -> timedelta:
        """How long a reservation made or renewed here is safe from ``reap`` unrenewed."""
        return self._lease

    # ------------------------------------------------------------------ policies

    def set_policy(self, policy: Policy) -> None:
        """Create or replace the policy of ``policy.scope`` (an audited history entry).

        An administrator's act: the ledger must have been opened with its administrator
        key (``admin=``), which signs the policy; no worker holds it (:mod:`authority`).

        A scope that has been charged keeps its calendar for the ledger's life: a second
        calendar would cut the same time into a second set of windows, each with a full
        cap. So a policy that would change the calendar of any charged (tenant, query
        type) is refused; give new query types a calendar of their own instead.
        """
        if not isinstance(policy, Policy):
            raise ValueError(f"policy must be a Policy, got {policy!r}")
        free_text("compliance_clause", policy.compliance_clause)
        self._authority.sign_policy(policy.as_record())  # refused without the admin key
        with self._write() as connection:
            stored = self._policy_store.read(connection, honoured=False)
            before, after = policy_lookup(stored), policy_lookup({**stored, policy.scope: policy})
            charged = connection.execute(
                select(WindowRow.tenant, WindowRow.query_type).distinct()
            ).all()
            for tenant, query_type in charged:
                probe = LedgerKey.from_canonical(tenant, "-", query_type, "-")
                was, becomes = before(probe).calendar, after(probe).calendar
                if was != becomes:
                    raise LedgerError(
                        f"tenant {tenant!r}, query type {query_type!r} has been charged in "
                        f"{was.kind} windows; a policy giving it {becomes.kind} windows would "
                        "open a second set of windows over the same time. Keep its calendar "
                        "(or use a new query type)"
                    )
            write_policy(
                connection,
                self._key,
                self._authority,
                policy,
                clock.stamp(clock.now()),
                self.actor,
            )

    def policies(self) -> list[Policy]:
        """Every stored policy, default first."""
        with self.reading() as connection:
            stored = self._policy_store.read(connection)
        return sorted(stored.values(), key=lambda p: (p.scope != (ANY, ANY), p.scope))

    def policy_for(self, key: LedgerKey) -> Policy:
        """The policy that applies to ``key``."""
        key = self._one_key(key)[0]
        return self.policy_for_scope(key.tenant, key.query_type)

    def policy_for_scope(self, tenant: str, query_type: str) -> Policy:
        """The policy for a tenant and query type (what decides a key's window calendar)."""
        tenant = canonical_part("tenant", tenant)
        query_type = canonical_part("query_type", query_type)
        with self.reading() as connection:
            return policy_of_scope(self._policy_store.read(connection), tenant, query_type)

    # ------------------------------------------------------------------ validation helpers

    @classmethod
    def _covered(cls, keys: Covered) -> tuple[list[LedgerKey], list[classes.CohortKeys]]:
        """What a charge covers: subject keys in lock order, or registered cohorts' keys
        in their windows (see ``cohort``)."""
        cohorts = cls._cohorts(keys)
        return ([], cohorts) if cohorts else (cls._keys(keys), [])  # type: ignore[arg-type]

    @staticmethod
    def _cohorts(keys: object) -> list[classes.CohortKeys]:
        """``keys`` as cohorts' keys in their windows, or [] when they are not that."""
        if isinstance(keys, classes.CohortKeys):
            return [keys]
        if (
            isinstance(keys, list | tuple)
            and keys
            and all(isinstance(item, classes.CohortKeys) for item in keys)
        ):
            return list(keys)
        return []

    @classmethod
    def _keys(cls, keys: LedgerKey | Iterable[LedgerKey]) -> list[LedgerKey]:
        """Distinct keys in lock order (see ``statements.lock_order``)."""
        by_parts = cls._key_parts(keys)
        return [by_parts[parts] for parts in sorted(by_parts)]

    @classmethod
    def _distinct_keys(cls, keys: LedgerKey | Iterable[LedgerKey]) -> list[LedgerKey]:
        """Distinct keys in the order given."""
        return list(cls._key_parts(keys).values())

    @staticmethod
    def _key_parts(keys: LedgerKey | Iterable[LedgerKey]) -> dict[tuple[str, ...], LedgerKey]:
        """``keys`` validated (LedgerKey objects, at least one, none twice) by their parts."""
        if isinstance(keys, LedgerKey):
            listed = [keys]
        elif isinstance(keys, Iterable) and not isinstance(keys, str | bytes | Mapping):
            listed = list(keys)
        else:
            raise ValueError(f"keys must be a LedgerKey or LedgerKeys (see key_for), got {keys!r}")
        if not listed:
            raise ValueError("a reservation needs at least one key")
        for key in listed:
            if not isinstance(key, LedgerKey):
                raise ValueError(f"keys must be LedgerKey objects (see key_for), got {key!r}")
        by_parts = {statements.key_tuple(key): key for key in listed}  # tuples sort and hash in C
        if len(by_parts) != len(listed):
            raise ValueError("the same key appears more than once in one release")
        return by_parts

    @staticmethod
    def _one_key(key: LedgerKey) -> list[LedgerKey]:
        if not isinstance(key, LedgerKey):
            raise ValueError(f"expected one LedgerKey (see key_for), got {key!r}")
        return [key]

    @staticmethod
    def _mechanism(mechanism: Mechanism | Mapping[str, Any]) -> Mechanism:
        if isinstance(mechanism, Mechanism):
            return mechanism
        return Mechanism.from_spec(mechanism)

    # ------------------------------------------------------------------ locking

    def _lock_accounts(
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
        size = self._orders.size
        gaussian = reserving is None or reserving.gaussian_mu2 is not None
        added = {
            "add_open": 0 if reserving is None else 1,
            "add_rho": 0.0 if reserving is None else reserving.rho,
            "add_mu2": reserving.gaussian_mu2 if reserving is not None and gaussian else 0.0,
            "add_others": 0 if gaussian else 1,
            "round_up": ROUND_UP,
        }
        if pipe.postgresql:
            rows = pipe.query(
                statements.PG_UPSERT, {**added, "now": now, **statements.key_parts(keys)}
            )
            return statements.accounts_by_key(rows, keys, size), rows[0][16]
        rows = []
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
        return statements.accounts_by_key(rows, keys, size), None

    def _lock_chargeable(
        self,
        pipe: pipeline.Pipeline,
        keys: Sequence[LedgerKey],
        moment: datetime,
        reserving: Spend | None = None,
        cohorts: Sequence[classes.CohortKeys] = (),
    ) -> tuple[dict[LedgerKey, statements.LockedAccount], Policies, classes.Charge]:
        """Lock the windows ``keys`` (subject keys) charge and the accounts of their
        classes, refusing any that may not be charged.

        The one gate of every write that adds spend (reserve, rescope, correct): a sealed
        window, a re-scoped account, a label that is not its scope calendar's own, a
        window that has not begun, or (for a new release: ``reserving``) a window past its
        grace period is refused, and the transaction rolls back with nothing written. The
        windows' classes are refined for the subjects first (see :mod:`classes`). Returns
        the locked accounts, the policies in force and the charge (its account keys in
        lock order, and its cohorts for the history entry).
        """
        now = clock.stamp(moment)
        self._lock_windows(pipe, [*keys, *cohorts], now)
        charge = classes.accounts_for(pipe, keys, now, cohorts)
        locked, version = self._lock_accounts(pipe, charge.keys, now, reserving)
        policies = self._policy_store.at(pipe, version)
        self._check_windows(
            charge.keys, policy_lookup(policies), moment, new_release=reserving is not None
        )
        for key in charge.keys:
            moved = locked[key].rescoped_to
            if moved is not None:
                raise _rescoped(classes.example_subject(pipe.core(), key), moved)
        return locked, policies, charge

    def _lock_windows(self, pipe: pipeline.Pipeline, keys: Sequence[Charged], now: str) -> None:
        """Create and share-lock the window rows ``keys`` charge; refuse a sealed one.

        Every account's scope and window has a row in ``dp_windows``; a reset seals it
        under an exclusive lock before dropping the accounts, so a window is either
        chargeable for this whole transaction or refused here (:class:`WindowSealed`).
        The same statement reads the quarantine: a quarantined ledger charges nothing.
        """
        scopes = sorted({(key.tenant, key.query_type, key.window) for key in keys})
        if pipe.postgresql:
            parts = {
                "tenants": statements.newline_joined([scope[0] for scope in scopes]),
                "query_types": statements.newline_joined([scope[1] for scope in scopes]),
                "windows": statements.newline_joined([scope[2] for scope in scopes]),
            }
            rows = pipe.query(statements.PG_LOCK_WINDOWS, {**parts, "now": now})
        else:
            rows = []
            for tenant, query_type, window in scopes:
                scope = {"tenant": tenant, "query_type": query_type, "window": window}
                pipe.query(statements.SQLITE_NEW_WINDOW, {**scope, "now": now})
                rows += pipe.query(statements.SQLITE_WINDOW, scope)
        if len(rows) != len(scopes):
            raise LedgerCorrupt(f"{len(scopes)} windows charged but {len(rows)} window rows found")
        self._refuse_quarantined(
            *rows[0][4:], reason=lambda: pipe.query(statements.QUARANTINE_REASON)[0][0]
        )
        for tenant, query_type, window, sealed_at, *_ in rows:
            if sealed_at is not None:
                raise _sealed(tenant, query_type, window, sealed_at)

    @staticmethod
    def _check_windows(
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

    def _refuse_quarantined(
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
        if not self._authority.cleared(epoch, clearance):
            raise LedgerQuarantined(
                f"the ledger's quarantine #{epoch} was lifted without its administrator's "
                f"signature (by SQL, or by code without the administrator key): it is still "
                f"in force{_CLEAR}"
            )

    def _refuse_if_quarantined(self, connection: Connection) -> None:
        """:meth:`_refuse_quarantined` on the state ``connection``'s transaction reads."""
        config = connection.execute(
            select(
                LedgerConfig.quarantined_at,
                LedgerConfig.quarantine_epoch,
                LedgerConfig.clearance,
                text(f"({statements.QUARANTINES})"),
                LedgerConfig.quarantine_reason,
            ).where(LedgerConfig.id == 1)
        ).one()
        self._refuse_quarantined(*config[:4], reason=lambda: config.quarantine_reason)

    def _refuse_unchargeable(
        self,
        connection: Connection,
        keys: Sequence[Charged],
        states: Sequence[HeldState],
        policies: Policies,
    ) -> None:
        """Raise what :meth:`_lock_chargeable` raises whatever the budget, in its order,
        reading without locking or creating anything: a quarantined ledger, a sealed
        window, a label that is not its calendar's, has not begun or is past its grace
        period, a re-scoped key."""
        self._refuse_if_quarantined(connection)
        scope_keys = self._refuse_sealed(connection, keys)
        self._check_windows(
            list(scope_keys.values()), policy_lookup(policies), clock.now(), new_release=True
        )
        for state in states:
            if state.rescoped_to is not None:
                raise _rescoped(state.example, state.rescoped_to)

    @staticmethod
    def _refuse_sealed(
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

    def _lock_reservation(
        self, connection: Connection, reservation_id: str
    ) -> tuple[list[LedgerKey], dict[LedgerKey, statements.LockedAccount]]:
        """Lock every account a reservation holds, in key order, joined on the server side.

        Its keys are those it reserved and the new parts of any of them that split while
        it was open (see :mod:`classes`). One indexed join instead of key lists.
        """
        rows = connection.execute(
            statements.lock_reservation_accounts(connection.dialect.name == "postgresql"),
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
        return keys, statements.accounts_by_key(rows, keys, self._orders.size)

    def _add_pending_residual(
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
            if pipe.postgresql:
                pipe.send(statements.PG_SET_PENDING_RESIDUAL, {"residual": stored, "ids": ids})
                continue
            for chunk in statements.chunks(ids):
                pipe.connection.execute(
                    update(Account).where(Account.id.in_(chunk)).values(pending_residual=stored)
                )

    # ------------------------------------------------------------------ epsilon

    def _bounds(self, spends: Sequence[Spend]) -> list[EpsilonBound]:
        """Epsilon of many spends, converting each distinct spend once.

        The conversion is a pure function of the spend (delta, grid and conversion are
        fixed for the ledger's life), so results are kept across calls: a one-step spend
        converts its prospective total once, for the check and for the receipt.
        """
        cache = self._bound_cache
        if len(cache) > BOUND_CACHE_SIZE:
            cache.clear()
        bounds = []
        for spend in spends:
            signature = spend.signature
            if signature not in cache:
                cache[signature] = spend.epsilon(self._orders, self._delta, self._conversion)
            bounds.append(cache[signature])
        return bounds

    @staticmethod
    def _receipt_fields(bound: EpsilonBound, policy: Policy) -> tuple[Any, ...]:
        """A receipt's values after its key (SpendReceipt's field order)."""
        return (
            bound.epsilon,
            max(0.0, policy.cap_epsilon - bound.epsilon),
            bound.epsilon / policy.cap_epsilon,
            policy.warns_at(bound.epsilon),
            policy.cap_epsilon,
            bound.method,
        )


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
