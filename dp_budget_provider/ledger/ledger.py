"""The persistent privacy budget ledger.

Every release is a two-phase spend: ``reserve`` (the prospective check, counting
committed spend *and* every open reservation, made in the same transaction as the
reservation under row locks taken in key order), then ``commit`` once the release
happened, or ``release`` if the data was never touched. A refused release writes
nothing. Commits are idempotent per attempt id. A reservation's lease is renewed by its
attempt while it runs (:mod:`lease`); reservations abandoned by dead workers stay counted
until ``reap`` charges them, once their lease has run out; nothing is ever silently
refunded.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import hmac
import json
import math
import secrets
import socket
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

import numpy as np
from sqlalchemy import (
    Connection,
    Engine,
    and_,
    delete,
    insert,
    or_,
    select,
    tuple_,
    update,
)

from dp_budget_provider.accounting import (
    DEFAULT_ORDERS,
    Conversion,
    EpsilonBound,
    Mechanism,
    RDPAccountant,
)
from dp_budget_provider.accounting import validation as check
from dp_budget_provider.accounting.conversion import check_conversion
from dp_budget_provider.accounting.orders import validate_orders
from dp_budget_provider.accounting.rounding import ROUND_UP
from dp_budget_provider.ledger import (
    audit,
    database,
    history,
    pipeline,
    statements,
)
from dp_budget_provider.ledger.checkpoints import Checkpoint
from dp_budget_provider.ledger.errors import (
    BudgetExhausted,
    LedgerConfigMismatch,
    LedgerCorrupt,
    LedgerError,
    LedgerQuarantined,
    LedgerUnavailable,
    ReservationClosed,
    ReservationStateError,
    WindowSealed,
)
from dp_budget_provider.ledger.held import HeldState, held_states
from dp_budget_provider.ledger.keys import (
    LedgerKey,
    canonical_part,
    free_text,
    plain_text,
    whole_number,
)
from dp_budget_provider.ledger.lease import DEFAULT_LEASE, LeaseKeeper, WarningLog, check_lease
from dp_budget_provider.ledger.opening import NewLedger, open_ledger
from dp_budget_provider.ledger.policy import ANY, BudgetCap, Policy
from dp_budget_provider.ledger.policy_store import (
    Policies,
    PolicyStore,
    policy_for,
    policy_lookup,
    write_policy,
)
from dp_budget_provider.ledger.records import (
    COMMITTED,
    OPEN,
    REAPED,
    RELEASED,
    AccountStatus,
    BudgetCheck,
    Reservation,
    SpendReceipt,
    VerifyReport,
)
from dp_budget_provider.ledger.schema import (
    Account,
    ChainHead,
    HistoryEntry,
    LedgerConfig,
    ReservationKey,
)
from dp_budget_provider.ledger.schema import Reservation as ReservationRow
from dp_budget_provider.ledger.schema import Window as WindowRow
from dp_budget_provider.ledger.spend import Pending, Spend, prospective
from dp_budget_provider.ledger.standing import Standings
from dp_budget_provider.ledger.windows import WindowCalendar, is_closed, window_bounds

_CHUNK = 1000
_QUARANTINE_LISTED = 20
_BOUND_CACHE_SIZE = 100_000
_KEY_COLUMNS = statements.KEY_COLUMNS
_CLEAR = (
    ": verify found the ledger's tables or history inconsistent. Nothing can be released "
    "until an operator has investigated and cleared it (`dp-budget quarantine clear "
    "--reason ...`, audited); `dp-budget quarantine show` says why"
)


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _stamp(moment: datetime) -> str:
    """Fixed-width UTC timestamps: they sort as strings (the year zero-padded too, which
    ``strftime`` does not do below the year 1000)."""
    utc = moment.astimezone(timezone.utc)
    return f"{utc.year:04d}" + utc.strftime("-%m-%dT%H:%M:%S.%fZ")


def token_digest(token: str) -> str:
    """What the ledger stores of a reservation's token (never the token itself)."""
    return hashlib.sha256(token.encode()).hexdigest()


def _default_actor() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _chunks(items: Sequence[Any], size: int = _CHUNK) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


_key_of = audit._key_of  # one way to turn a stored row into a key


def _lock_order(connection: Connection) -> list[Any]:
    """ORDER BY clauses that sort keys exactly like Python's ``sorted`` (code points).

    Every writer locks accounts in this one order, so two transactions can never wait on
    each other in a cycle. PostgreSQL must compare bytes (collation "C"): a linguistic
    collation would order some keys differently from the upsert path and deadlock.
    """
    if connection.dialect.name == "postgresql":
        return [column.collate("C") for column in _KEY_COLUMNS]
    return list(_KEY_COLUMNS)


class PrivacyBudgetLedger:
    """Cumulative privacy spend per (tenant, subject, query_type, window), with caps.

    ``url=None`` is a private in-memory SQLite ledger, ``sqlite:///path`` the embedded
    file, ``postgresql+psycopg2://...`` production. A new database is created with
    ``cap`` as its default policy and with the given delta, grid and conversion; an
    existing one must be opened with the same (``cap`` may be omitted to take what is
    stored), otherwise :class:`LedgerConfigMismatch`. ``if_new``'s default cap (and
    ``calendar``) only apply when the database is new: open what exists, else create with
    these; its delta must match an existing ledger's all the same.

    ``chain_key`` (at least 16 bytes, kept outside the ledger database) makes every
    history link an HMAC under it: a ledger created with a key can only be opened with
    it, and nobody who can only write the database can forge its history.

    ``lease`` (1 s to 1 day, default 5 minutes) is how long a reservation this ledger
    makes or renews stays safe from ``reap`` without a renewal (:mod:`lease`).
    """

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
    ) -> None:
        for name, value in (("cap", cap), ("if_new", if_new)):
            if value is not None and not isinstance(value, BudgetCap):
                raise ValueError(f"{name} must be a BudgetCap, got {value!r}")
        self._bound_cache: dict[tuple[Any, ...], EpsilonBound] = {}
        self._cost_cache: dict[tuple[Any, int], Spend] = {}
        self._orders = validate_orders(orders)
        self._conversion: Conversion = check_conversion(conversion)
        self._lease = check_lease(lease)
        self.actor = _default_actor() if actor is None else plain_text("actor", actor)
        self._key = history.ChainKey(chain_key)
        self._engine = database.make_engine(url)
        self._policy_store = PolicyStore(self.reading)
        new = NewLedger(
            self._orders,
            self._conversion,
            calendar or WindowCalendar(),
            self.actor,
            _stamp(_now()),
            self._key,
        )
        try:
            settings = open_ledger(self.reading, self._write, self._policy_store, new, cap, if_new)
        except BaseException:
            self._engine.dispose()
            raise
        self._delta, self._chains = settings.delta, settings.chains

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

    def _chain(self, key: LedgerKey) -> int:
        """The history chain of entries about ``key`` (or a release whose first key it is)."""
        return history.chain_of(key, self._chains)

    def _pool(self) -> Engine:
        """The engine every transaction of this ledger runs on."""
        return self._engine

    def _write(self) -> Any:
        return database.transaction(self._pool(), write=True)

    def _pipelined(self) -> contextlib.AbstractContextManager[pipeline.Pipeline]:
        """A pipelined write transaction (see :mod:`pipeline`) on a pooled connection."""
        return pipeline.write(self._pool())

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

        A scope that has been charged keeps its calendar for the ledger's life: a second
        calendar would cut the same time into a second set of windows, each with a full
        cap. So a policy that would change the calendar of any charged (tenant, query
        type) is refused; give new query types a calendar of their own instead.
        """
        if not isinstance(policy, Policy):
            raise ValueError(f"policy must be a Policy, got {policy!r}")
        free_text("compliance_clause", policy.compliance_clause)
        with self._write() as connection:
            stored = self._policy_store.read(connection)
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
            write_policy(connection, self._key, policy, _stamp(_now()), self.actor)

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
        probe = LedgerKey(tenant, "-", query_type, "-")
        with self.reading() as connection:
            return policy_for(self._policy_store.read(connection), probe)

    # ------------------------------------------------------------------ validation helpers

    @classmethod
    def _keys(cls, keys: LedgerKey | Iterable[LedgerKey]) -> list[LedgerKey]:
        """Distinct keys in lock order (see ``_lock_order``)."""
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
            return statements.accounts_by_key(rows, keys, size), rows[0][15]
        rows = []
        for chunk in _chunks(keys):
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
    ) -> tuple[dict[LedgerKey, statements.LockedAccount], Policies]:
        """Lock the windows and accounts ``keys`` charge, refusing any that may not be charged.

        The one gate of every write that adds spend (reserve, rescope, correct): a sealed
        window, a re-scoped key, a label that is not its scope calendar's own, or a window
        that has not begun is refused, and the transaction rolls back with nothing written.
        Returns the locked accounts and the policies in force.
        """
        now = _stamp(moment)
        self._lock_windows(pipe, keys, now)
        locked, version = self._lock_accounts(pipe, keys, now, reserving)
        policies = self._policy_store.at(pipe, version)
        self._check_windows(keys, policy_lookup(policies), moment)
        self._check_not_rescoped(keys, locked)
        return locked, policies

    @staticmethod
    def _lock_windows(pipe: pipeline.Pipeline, keys: Sequence[LedgerKey], now: str) -> None:
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
        if rows[0][4] is not None:
            raise _quarantined(rows[0][4], pipe.query(statements.QUARANTINE_REASON)[0][0])
        for tenant, query_type, window, sealed_at, _ in rows:
            if sealed_at is not None:
                raise _sealed(tenant, query_type, window, sealed_at)

    @staticmethod
    def _check_windows(
        keys: Sequence[LedgerKey], policy_of: Callable[[LedgerKey], Policy], moment: datetime
    ) -> None:
        """Refuse a window that is not its scope calendar's own name for a period, or that
        has not begun (data that does not exist yet cannot be released)."""
        seen: set[tuple[str, str, str]] = set()
        for key in keys:
            scope = (key.tenant, key.query_type, key.window)
            if scope in seen:
                continue
            seen.add(scope)
            calendar = policy_of(key).calendar
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

    @staticmethod
    def _check_not_rescoped(
        keys: Sequence[LedgerKey], locked: Mapping[LedgerKey, statements.LockedAccount]
    ) -> None:
        for key in keys:
            moved = locked[key].rescoped_to
            if moved is not None:
                raise _rescoped(key, moved)

    def _refuse_unchargeable(
        self,
        connection: Connection,
        keys: Sequence[LedgerKey],
        states: Sequence[HeldState],
        policies: Policies,
    ) -> None:
        """Raise what :meth:`_lock_chargeable` raises whatever the budget, in its order,
        reading without locking or creating anything: a quarantined ledger, a sealed
        window, a label that is not its calendar's or has not begun, a re-scoped key."""
        config = connection.execute(
            select(LedgerConfig.quarantined_at, LedgerConfig.quarantine_reason)
        ).one()
        if config.quarantined_at is not None:
            raise _quarantined(config.quarantined_at, config.quarantine_reason)
        scope_keys = {(key.tenant, key.query_type, key.window): key for key in keys}
        scope = (WindowRow.tenant, WindowRow.query_type, WindowRow.window)
        for chunk in _chunks(sorted(scope_keys)):
            sealed = connection.execute(
                select(*scope, WindowRow.sealed_at)
                .where(tuple_(*scope).in_(chunk), WindowRow.sealed_at.is_not(None))
                .limit(1)
            ).first()
            if sealed is not None:
                raise _sealed(*sealed)
        self._check_windows(list(scope_keys.values()), policy_lookup(policies), _now())
        for state in states:
            if state.rescoped_to is not None:
                raise _rescoped(state.example, state.rescoped_to)

    def _lock_reservation(
        self, connection: Connection, reservation_id: str, key_count: int
    ) -> tuple[list[LedgerKey], dict[LedgerKey, statements.LockedAccount]]:
        """Lock every account a reservation holds, in key order, joined on the server side.

        One indexed join instead of key lists: a release over 10^5 subjects locks its
        accounts with one statement.
        """
        rows = connection.execute(
            statements.lock_reservation_accounts(), {"rid": reservation_id}
        ).all()
        if len(rows) != key_count:
            raise LedgerCorrupt(
                f"reservation {reservation_id} holds {key_count} keys but only {len(rows)} "
                "accounts exist"
            )
        keys = [_key_of(row) for row in rows]
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
            for chunk in _chunks(ids):
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
        if len(cache) > _BOUND_CACHE_SIZE:
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

    # ------------------------------------------------------------------ two-phase spend

    def reserve(
        self,
        keys: LedgerKey | Iterable[LedgerKey],
        mechanism: Mechanism | Mapping[str, Any],
        count: int = 1,
        attempt: str | None = None,
    ) -> Reservation:
        """Check and hold the cost of a release on every key, all or nothing.

        Raises :class:`BudgetExhausted` (writing nothing) when any key would pass its
        cap counting its committed spend and all open reservations. ``attempt`` names
        the task attempt: an attempt reserves once, ever. Reserving again with an attempt
        that already reserved (open, committed, released or reaped) is refused with
        :class:`ReservationStateError`, so one attempt never authorises two releases.
        The returned reservation carries a secret token: only its holder can commit,
        release or renew it. Its lease runs for :attr:`lease` from now: keep it alive
        with :meth:`keep_alive` (or :meth:`renew`) while the release works on the data.
        """
        ordered = self._keys(keys)
        mechanism, count, attempt_id, cost = self._release(mechanism, count, attempt)
        if not cost.finite:  # beyond every cap (a noise multiplier of 1e-200): no row touched
            raise BudgetExhausted(ordered[0], math.inf, self.policy_for(ordered[0]).cap_epsilon)
        try:
            with self._pipelined() as pipe:
                return self._reserve(pipe, ordered, mechanism, count, attempt_id, cost)
        except pipeline.UniqueViolation as error:
            if "attempt_id" not in str(error):
                raise
            with self.reading() as connection:
                existing = self._reservation_by_attempt(connection, attempt_id)
            state = "" if existing is None else f" ({existing.id}, {existing.state})"
            raise ReservationStateError(
                f"attempt {attempt_id!r} has already reserved{state}: an attempt releases at "
                "most once, and a new try of a task needs a new attempt id"
            ) from error

    def _release(
        self, mechanism: Mechanism | Mapping[str, Any], count: int, attempt: str | None
    ) -> tuple[Mechanism, int, str, Spend]:
        """Validate a release's arguments (before any database work) and price it."""
        mechanism = self._mechanism(mechanism)
        count = check.count("count", count)
        return mechanism, count, self._attempt(attempt), self._cost(mechanism, count)

    def _cost(self, mechanism: Mechanism, count: int) -> Spend:
        """The cost of a release on the ledger's grid (kept: tasks repeat the same release).

        Mechanisms are frozen value objects with validated float fields, so equal ones
        describe the same release; one that is not hashable is known by its spec.
        """
        signature: tuple[Any, int] = (mechanism, count)
        try:
            hash(signature)
        except TypeError:
            signature = (history.canonical_json(mechanism.to_spec()), count)
        cost = self._cost_cache.get(signature)
        if cost is None:
            if len(self._cost_cache) > _BOUND_CACHE_SIZE:
                self._cost_cache.clear()
            cost = self._cost_cache[signature] = Spend.of_release(mechanism, count, self._orders)
        return cost

    @staticmethod
    def _attempt(attempt: str | None) -> str:
        if attempt is None:
            return f"anonymous:{uuid.uuid4()}"
        if not isinstance(attempt, str) or not attempt.strip() or len(attempt) > 1024:
            raise ValueError(
                f"attempt must be a non-empty string of <= 1024 chars, got {attempt!r}"
            )
        return free_text("attempt", attempt)

    def _reserve(
        self,
        pipe: pipeline.Pipeline,
        keys: list[LedgerKey],
        mechanism: Mechanism,
        count: int,
        attempt_id: str,
        cost: Spend,
    ) -> Reservation:
        moment = _now()
        now = _stamp(moment)
        lease_expires_at = _stamp(moment + self._lease)
        locked, policies = self._lock_chargeable(pipe, keys, moment, reserving=cost)
        # The pending spend read back includes this cost but for its residual curve.
        residual = Spend(0.0, cost.residual, 0.0)
        # Accounts holding equal values share their Spend objects: convert each once.
        bounds: dict[tuple[int, int], EpsilonBound] = {}
        worst = 0.0
        policy_of = policy_lookup(policies)
        for key in keys:
            held = locked[key]
            marker = (id(held.spend), id(held.pending))
            bound = bounds.get(marker)
            if bound is None:
                total = held.spend.plus(held.pending.as_spend()).plus(residual)
                bound = bounds[marker] = self._bounds([total])[0]
            cap = policy_of(key).cap_epsilon
            if bound.epsilon > cap:
                raise BudgetExhausted(key, bound.epsilon, cap)
            worst = max(worst, bound.epsilon)
        if cost.residual is not None:
            self._add_pending_residual(pipe, keys, locked, cost.residual)
        reservation_id = str(uuid.uuid4())
        token = secrets.token_urlsafe(32)
        token_hash = token_digest(token)
        digest = history.keys_digest(keys)
        spec = mechanism.to_spec()
        pipe.send(
            statements.INSERT_RESERVATION,
            {
                "id": reservation_id,
                "attempt_id": attempt_id,
                "token_hash": token_hash,
                "state": OPEN,
                "mechanism": history.canonical_json(spec),
                "count": count,
                "cost_rho": cost.rho,
                "cost_residual": cost.residual_json(),
                "cost_gaussian_mu2": cost.gaussian_mu2,
                "key_count": len(keys),
                "keys_digest": digest,
                "prospective_epsilon": worst,
                "actor": self.actor,
                "created_at": now,
                "lease_expires_at": lease_expires_at,
            },
        )
        self._insert_reservation_keys(pipe, reservation_id, keys)
        pipe.append_history(
            self._key,
            chain=self._chain(keys[0]),
            at=now,
            action="reserve",
            actor=self.actor,
            reservation_id=reservation_id,
            key=keys[0] if len(keys) == 1 else None,
            payload={
                "attempt_id": attempt_id,
                "mechanism": spec,
                "count": count,
                "cost": cost.as_payload(),
                "key_count": len(keys),
                "keys_digest": digest,
                "prospective_epsilon": worst,
                "token_hash": token_hash,
            },
        )
        return Reservation(
            id=reservation_id,
            attempt_id=attempt_id,
            keys=tuple(keys),
            mechanism=mechanism,
            count=count,
            state=OPEN,
            prospective_epsilon=worst,
            created_at=now,
            token=token,
            lease_expires_at=lease_expires_at,
        )

    def _prospective_epsilon(self, rho: float, mu2: float | None) -> float:
        """The epsilon of a prospective spend the server recorded (validated as stored)."""
        spend = Spend.from_columns(rho, None, mu2, self._orders.size)
        return self._bounds([spend])[0].epsilon

    @staticmethod
    def _insert_reservation_keys(
        pipe: pipeline.Pipeline, reservation_id: str, keys: Sequence[LedgerKey]
    ) -> None:
        if pipe.postgresql:
            pipe.send(
                statements.PG_RESERVATION_KEYS,
                {"reservation_id": reservation_id, **statements.key_parts(keys)},
            )
            return
        for offset, chunk in enumerate(_chunks(keys)):
            pipe.connection.execute(
                insert(ReservationKey),
                [
                    {
                        "reservation_id": reservation_id,
                        "position": offset * _CHUNK + i,
                        **k.as_dict(),
                    }
                    for i, k in enumerate(chunk)
                ],
            )

    def _reservation_by_attempt(self, connection: Connection, attempt_id: str) -> Any:
        return connection.execute(
            select(ReservationRow).where(ReservationRow.attempt_id == attempt_id)
        ).one_or_none()

    def _reservation_from_row(self, row: Any, keys: tuple[LedgerKey, ...]) -> Reservation:
        prospective = row.prospective_epsilon
        if prospective is None:  # decided by the server: it recorded the spend
            prospective = self._prospective_epsilon(row.prospective_rho, row.prospective_mu2)
        return Reservation(
            id=row.id,
            attempt_id=row.attempt_id,
            keys=keys,
            mechanism=Mechanism.from_spec(json.loads(row.mechanism)),
            count=row.count,
            state=row.state,
            prospective_epsilon=prospective,
            created_at=row.created_at,
            lease_expires_at=row.lease_expires_at,
        )

    def _reservation_keys(self, connection: Connection, reservation_id: str) -> list[LedgerKey]:
        rows = connection.execute(
            select(ReservationKey)
            .where(ReservationKey.reservation_id == reservation_id)
            .order_by(ReservationKey.position)
        )
        return [_key_of(row) for row in rows]

    def _charge(
        self,
        connection: Connection,
        row: Any,
        *,
        state: str,
        action: str,
        extra: dict[str, Any] | None = None,
    ) -> list[SpendReceipt]:
        """Turn an open reservation into committed spend on each of its keys (general path)."""
        now = _stamp(_now())
        cost = Spend.from_columns(
            row.cost_rho, row.cost_residual, row.cost_gaussian_mu2, self._orders.size
        )
        policies = self._policy_store.read(
            connection
        )  # before the locks: held as briefly as possible
        keys, accounts = self._lock_reservation(connection, row.id, row.key_count)
        after = self._close_reservation(connection, keys, accounts, cost, now, charge=row.count)
        connection.execute(
            update(ReservationRow)
            .where(ReservationRow.id == row.id)
            .values(state=state, resolved_at=now)
        )
        history.append(
            connection,
            self._key,
            chain=self._chain(keys[0]),
            at=now,
            action=action,
            actor=self.actor,
            reservation_id=row.id,
            key=keys[0] if len(keys) == 1 else None,
            payload=self._charge_payload(
                row.attempt_id, cost, row.count, len(keys), row.keys_digest, extra
            ),
        )
        return self._receipts_of(keys, after, policies)

    @staticmethod
    def _charge_payload(
        attempt_id: str,
        cost: Spend,
        count: int,
        key_count: int,
        keys_digest: str,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The history payload of a commit or reap."""
        return {
            "attempt_id": attempt_id,
            "cost": cost.as_payload(),
            "count": count,
            "key_count": key_count,
            "keys_digest": keys_digest,
            **(extra or {}),
        }

    def _receipts_of(
        self,
        keys: Sequence[LedgerKey],
        spends: Sequence[Spend],
        policies: Mapping[tuple[str, str], Policy],
    ) -> list[SpendReceipt]:
        """Receipts of ``keys`` holding ``spends``; each distinct (spend, policy) pair is
        converted once (a release over 10^5 new subjects leaves them all equal)."""
        policy_of = policy_lookup(policies)
        made: dict[tuple[int, int], tuple[Any, ...]] = {}
        receipts = []
        for key, spend in zip(keys, spends, strict=True):
            policy = policy_of(key)
            marker = (id(spend), id(policy))
            fields = made.get(marker)
            if fields is None:
                fields = made[marker] = self._receipt_fields(self._bounds([spend])[0], policy)
            receipts.append(SpendReceipt(key, *fields))
        return receipts

    def _close_reservation(
        self,
        connection: Connection,
        keys: list[LedgerKey],
        locked: Mapping[LedgerKey, statements.LockedAccount],
        cost: Spend,
        now: str,
        *,
        charge: int | None,
    ) -> list[Spend]:
        """Close one open reservation of ``cost`` on every locked account.

        The cost leaves the accounts' pending spend (exactly zero once nothing is open);
        with ``charge`` (its release count) it is added to their committed spend, as a
        commit or reap does, while a release adds nothing. Returns the committed spends
        in key order.
        """
        after = [locked[key].spend.plus(cost) if charge else locked[key].spend for key in keys]
        if cost.residual is None:
            statement = statements.close_accounts(
                gaussian=cost.gaussian_mu2 is not None, charge=bool(charge)
            )
            params = {
                "cost_rho": cost.rho,
                "cost_mu2": cost.gaussian_mu2,
                "count": charge or 0,
                "now": now,
            }
            for chunk in _chunks([locked[key].id for key in keys]):
                connection.execute(statement, {**params, "ids": list(chunk)})
            return after
        for key, spend in zip(keys, after, strict=True):
            held = locked[key]
            pending = Pending() if held.open_reservations <= 1 else held.pending.remove(cost)
            self._store_spend(connection, held.id, spend, charge or 0, now, pending=pending)
        return after

    @staticmethod
    def _store_spend(
        connection: Connection,
        account_id: int,
        spend: Spend,
        releases_added: int,
        now: str,
        *,
        pending: Pending | None = None,
    ) -> None:
        """Write one locked account's new spend (its full curve, not an increment).

        With ``pending``, one of its open reservations closes: the count drops and the
        pending spend becomes ``pending``.
        """
        values: dict[str, Any] = {
            "rho": spend.rho,
            "residual": spend.residual_json(),
            "gaussian_mu2": spend.gaussian_mu2,
            "releases": Account.releases + releases_added,
            "updated_at": now,
        }
        if pending is not None:
            values["open_reservations"] = Account.open_reservations - 1
            values["pending_rho"] = pending.rho
            values["pending_residual"] = pending.residual_json()
            values["pending_mu2"] = pending.mu2
            values["pending_others"] = pending.others
        connection.execute(update(Account).where(Account.id == account_id).values(**values))

    @staticmethod
    def _open_row(connection: Connection, reservation_id: str) -> Any:
        """The reservation row, locked for the rest of the transaction."""
        row = connection.execute(
            statements.reservation_for_update(), {"rid": reservation_id}
        ).one_or_none()
        if row is None:
            raise ReservationStateError(f"no reservation {reservation_id!r} in this ledger")
        return row

    def _owned_row(self, connection: Connection, reservation: Reservation, what: str) -> Any:
        """The reservation row, locked, if ``reservation`` is its holder's (token matches).

        Reservation ids and attempt ids are visible in the UI, XCom and the history, so
        neither proves that the caller is the attempt that reserved: only the token that
        ``reserve`` handed to that attempt does (the ledger keeps its digest only).
        """
        if (
            not isinstance(reservation, Reservation)
            or not isinstance(reservation.id, str)
            or not isinstance(reservation.token, str)
            or not (reservation.id + reservation.token).isprintable()
        ):
            raise ValueError(
                f"{what} takes the Reservation that reserve() returned, got {_shown(reservation)}"
            )
        row = self._open_row(connection, reservation.id)
        if row.token_hash is None or not hmac.compare_digest(
            row.token_hash, token_digest(reservation.token)
        ):
            raise ReservationStateError(
                f"reservation {row.id} belongs to attempt {row.attempt_id!r}; only the attempt "
                f"that reserved it may {what} it"
            )
        return row

    def commit(self, reservation: Reservation) -> list[SpendReceipt]:
        """Charge a reservation (the release happened); a second commit charges nothing.

        Only the attempt that reserved may commit (see :meth:`_owned_row`).
        """
        with self._write() as connection:
            row = self._owned_row(connection, reservation, "commit")
            quarantined = connection.execute(
                select(LedgerConfig.quarantined_at).where(LedgerConfig.id == 1)
            ).scalar_one()
            if quarantined is not None:
                raise LedgerQuarantined(
                    f"the ledger is quarantined since {quarantined}, so reservation {row.id} "
                    f"is not committed and its release must not be published{_CLEAR}; the "
                    "reservation stays open and is charged when it is reaped"
                )
            if row.state in (COMMITTED, REAPED):
                return self._receipts(connection, self._reservation_keys(connection, row.id))
            if row.state != OPEN:
                raise ReservationStateError(
                    f"reservation {row.id} was {row.state}; it cannot be committed"
                )
            return self._charge(connection, row, state=COMMITTED, action="commit")

    def release(self, reservation: Reservation, reason: str = "") -> None:
        """Drop a reservation whose release never touched the data (nothing is charged).

        Only the attempt that reserved may release, and only before it touched the data:
        anyone else holding an id could otherwise void the charge of a release that ran.
        """
        reason = free_text("reason", reason, limit=2000)
        with self._write() as connection:
            row = self._owned_row(connection, reservation, "release")
            if row.state == RELEASED:
                return
            if row.state != OPEN:
                raise ReservationStateError(
                    f"reservation {row.id} was {row.state}; it cannot be released"
                )
            keys, locked = self._lock_reservation(connection, row.id, row.key_count)
            now = _stamp(_now())
            cost = Spend.from_columns(
                row.cost_rho, row.cost_residual, row.cost_gaussian_mu2, self._orders.size
            )
            self._close_reservation(connection, keys, locked, cost, now, charge=None)
            connection.execute(
                update(ReservationRow)
                .where(ReservationRow.id == row.id)
                .values(state=RELEASED, resolved_at=now)
            )
            history.append(
                connection,
                self._key,
                chain=self._chain(keys[0]),
                at=now,
                action="release",
                actor=self.actor,
                reservation_id=row.id,
                key=keys[0] if len(keys) == 1 else None,
                payload={"attempt_id": row.attempt_id, "reason": reason},
            )

    def renew(self, reservation: Reservation) -> datetime:
        """Extend an open reservation's lease to :attr:`lease` from now; returns its end.

        Only the attempt that reserved may renew (the token, as for :meth:`commit`), and
        only an open reservation: a committed, released or reaped one is refused with
        :class:`ReservationClosed` and nothing changes. A renewal is no history entry: it
        changes no spend, and the charge a lease that runs out leads to is (see
        :mod:`lease`). Renewing works in quarantine too: it keeps a live attempt from
        being reaped, never lets it publish (its commit is refused).
        """
        with self._write() as connection:
            row = self._owned_row(connection, reservation, "renew")
            if row.state != OPEN:
                raise ReservationClosed(
                    f"reservation {row.id} was {row.state} at {row.resolved_at}; only an open "
                    "reservation's lease can be renewed"
                )
            expires = _now() + self._lease
            connection.execute(
                update(ReservationRow)
                .where(ReservationRow.id == row.id)
                .values(lease_expires_at=_stamp(expires))
            )
        return expires

    def keep_alive(
        self,
        reservation: Reservation,
        log: WarningLog | None = None,
    ) -> LeaseKeeper:
        """A context manager renewing ``reservation``'s lease every third of :attr:`lease`
        (a daemon thread) until its block ends: wrap the work on the data in it.

        A renewal that fails is a warning on ``log`` and the block goes on: if the lease
        runs out, the next reap charges the reservation, which is what its commit would
        have done (see :class:`~dp_budget_provider.ledger.lease.LeaseKeeper`).
        """
        if not isinstance(reservation, Reservation) or not isinstance(reservation.id, str):
            raise ValueError(
                "keep_alive takes the Reservation that reserve() returned, got "
                f"{_shown(reservation)}"
            )
        return LeaseKeeper(lambda: self.renew(reservation), self._lease, reservation.id, log)

    def reap(self, older_than: timedelta | None = None, now: datetime | None = None) -> list[str]:
        """Charge every open reservation whose lease has run out (its attempt stopped
        renewing: the worker died), and with ``older_than`` every one open longer than
        that, renewed or not (a hard bound on how long budget is held).

        Such a reservation may have touched the data, so it is charged, never refunded;
        the history records why (the lease that ran out, or the age). ``now`` (default:
        the ledger's clock, which stamped the leases) is for tests and audits. Each
        reservation is decided again under its row lock, so one renewed meanwhile is
        left alone. Returns the reaped reservation ids, oldest first.
        """
        if older_than is not None and (
            not isinstance(older_than, timedelta) or older_than < timedelta(0)
        ):
            raise ValueError(
                f"older_than must be a non-negative timedelta, got {_shown(older_than)}"
            )
        if now is not None and (not isinstance(now, datetime) or now.utcoffset() is None):
            raise ValueError(f"now must be a timezone-aware datetime, got {_shown(now)}")
        moment = now or _now()
        at = _stamp(moment)
        cutoff = None
        if older_than is not None:
            with contextlib.suppress(OverflowError):  # before the first moment: none so old
                cutoff = _stamp(moment - older_than)
        due = [ReservationRow.lease_expires_at.is_(None), ReservationRow.lease_expires_at <= at]
        if cutoff is not None:
            due.append(ReservationRow.created_at <= cutoff)
        with self.reading() as connection:
            stale = list(
                connection.execute(
                    select(ReservationRow.id)
                    .where(ReservationRow.state == OPEN, or_(*due))
                    .order_by(ReservationRow.created_at, ReservationRow.id)
                ).scalars()
            )
        reaped = []
        for reservation_id in stale:
            with self._write() as connection:
                row = self._open_row(connection, reservation_id)
                lease = _lease_of(row)
                why = _reap_reason(row, lease, at, cutoff, older_than)
                if row.state != OPEN or why is None:
                    continue
                self._charge(
                    connection,
                    row,
                    state=REAPED,
                    action="reap",
                    extra={"reason": why, "lease_expires_at": lease},
                )
                reaped.append(row.id)
        return reaped

    # ------------------------------------------------------------------ one-step spend

    def spend(
        self,
        key: LedgerKey,
        mechanism: Mechanism | Mapping[str, Any],
        count: int = 1,
        attempt: str | None = None,
    ) -> SpendReceipt:
        """Reserve and commit one release on one key (what a task does, in one call)."""
        return self.commit(self.reserve(self._one_key(key), mechanism, count, attempt))[0]

    def budget_check(
        self,
        keys: LedgerKey | Iterable[LedgerKey],
        mechanism: Mechanism | Mapping[str, Any],
        count: int = 1,
    ) -> BudgetCheck:
        """Would this release fit every one of ``keys`` now, and which key fits it worst?

        Committed spend and every open reservation count, summed as the reservation's own
        check sums them, so a release this finds fitting is refused only if something
        else is reserved or committed first. What the reservation refuses whatever the
        budget (a quarantined ledger, a sealed window or re-scoped key, a window label
        that is not its calendar's or has not begun) this raises as the reservation
        raises it. One grouped read per window (and 10^6 subjects) and one conversion per
        distinct held state: the subjects of a cohort that has had the same releases hold
        one state, however many they are.
        """
        return self._check(keys, mechanism, count, chargeable=True)

    def _check(
        self,
        keys: LedgerKey | Iterable[LedgerKey],
        mechanism: Mechanism | Mapping[str, Any],
        count: int,
        *,
        chargeable: bool,
    ) -> BudgetCheck:
        """:meth:`budget_check`; with ``chargeable`` False, keys no release may charge
        are priced all the same (what a key would reach, as a number to look at)."""
        distinct = self._distinct_keys(keys)
        cost = self._cost(self._mechanism(mechanism), check.count("count", count))
        with self.reading() as connection:
            states = held_states(connection, distinct, self._orders.size)
            policies = self._policy_store.read(connection)
            if chargeable:
                self._refuse_unchargeable(connection, distinct, states, policies)
        worst: tuple[float, bool, LedgerKey, float, float] | None = None
        for state in states:
            cap = policy_for(policies, LedgerKey(state.tenant, "-", state.query_type, "-"))
            epsilon = self._bounds([prospective(state.spend, state.pending, cost)])[0].epsilon
            # Ties go to a state with a named key (see HeldState.example).
            rank = (epsilon / cap.cap_epsilon, state.example is not None)
            if state.example is not None and (worst is None or rank > worst[:2]):
                worst = (*rank, state.example, epsilon, cap.cap_epsilon)
        assert worst is not None  # every window has a named state: see held_states
        return BudgetCheck(len(distinct), worst[2], worst[3], worst[4], len(states))

    def would_exceed(
        self,
        keys: LedgerKey | Iterable[LedgerKey],
        mechanism: Mechanism | Mapping[str, Any],
        count: int = 1,
    ) -> bool:
        """True if this release would pass the cap of any of ``keys`` now (counting open
        reservations): :meth:`budget_check` without the details."""
        return self.budget_check(keys, mechanism, count).exceeds

    def prospective_accountants(
        self, keys: LedgerKey | Iterable[LedgerKey]
    ) -> list[tuple[RDPAccountant, Policy]]:
        """Each distinct committed-plus-reserved spend among ``keys`` as an accountant, with
        the policy over it (for noise planning: one entry per state, not per key)."""
        distinct = self._distinct_keys(keys)
        with self.reading() as connection:
            states = held_states(connection, distinct, self._orders.size)
            policies = self._policy_store.read(connection)
        planned: dict[tuple[Any, ...], tuple[RDPAccountant, Policy]] = {}
        for state in states:
            policy = policy_for(policies, LedgerKey(state.tenant, "-", state.query_type, "-"))
            total = state.spend.plus(state.pending.as_spend())
            planned.setdefault(
                (total.signature, policy.cap_epsilon), (total.to_accountant(self._orders), policy)
            )
        return list(planned.values())

    def prospective_accountant(self, key: LedgerKey) -> RDPAccountant:
        """An accountant holding ``key``'s committed and reserved spend."""
        return self.prospective_accountants(self._one_key(key))[0][0]

    def prospective_epsilon(
        self, key: LedgerKey, mechanism: Mechanism | Mapping[str, Any], count: int = 1
    ) -> float:
        """The eps ``key`` would reach with this release on top of committed and reserved
        spend (also for a key no release may charge any more: see :meth:`budget_check`)."""
        return self._check(self._one_key(key), mechanism, count, chargeable=False).epsilon

    # ------------------------------------------------------------------ reading

    def _held(
        self, connection: Connection, keys: Sequence[LedgerKey]
    ) -> dict[LedgerKey, tuple[Spend, Pending]]:
        """(committed, pending) spend of each key; nothing for an untouched key."""
        found: dict[LedgerKey, tuple[Spend, Pending]] = defaultdict(lambda: (Spend(), Pending()))
        for chunk in _chunks(keys):
            rows = connection.execute(
                select(*statements.ACCOUNT_COLUMNS).where(
                    tuple_(*_KEY_COLUMNS).in_([statements.key_tuple(k) for k in chunk])
                )
            )
            for key, held in statements.accounts_by_key(rows, chunk, self._orders.size).items():
                found[key] = (held.spend, held.pending)
        return found

    def _receipts(self, connection: Connection, keys: list[LedgerKey]) -> list[SpendReceipt]:
        held = self._held(connection, keys)
        return self._receipts_of(
            keys, [held[key][0] for key in keys], self._policy_store.read(connection)
        )

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
    ) -> list[AccountStatus]:
        """Live accounts in key order, optionally filtered, with their status (committed
        and held spend, state: :mod:`~dp_budget_provider.ledger.standing`)."""
        query = select(Account).order_by(*_KEY_COLUMNS).offset(whole_number("offset", offset))
        if window is not None:
            query = query.where(Account.window == canonical_part("window", window))
        if tenant is not None:
            query = query.where(Account.tenant == canonical_part("tenant", tenant))
        if limit is not None:
            query = query.limit(whole_number("limit", limit))
        with self.reading() as connection:
            rows = list(connection.execute(query))
            policies = self._policy_store.read(connection)
        return [
            AccountStatus.of(row, standing, policy_for(policies, _key_of(row)))
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
            touching = select(ReservationKey.reservation_id).where(
                ReservationKey.tenant == key.tenant,
                ReservationKey.subject == key.subject,
                ReservationKey.query_type == key.query_type,
                ReservationKey.window == key.window,
            )
            query = query.where(
                or_(
                    and_(
                        HistoryEntry.tenant == key.tenant,
                        HistoryEntry.subject == key.subject,
                        HistoryEntry.query_type == key.query_type,
                        HistoryEntry.window == key.window,
                    ),
                    HistoryEntry.reservation_id.in_(touching),
                )
            )
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

    # ------------------------------------------------------------------ windows and re-scoring

    def windows_for(
        self, tenant: str, query_type: str, start: datetime, end: datetime | None = None
    ) -> list[str]:
        """The windows a release reading the data interval [start, end) is charged to.

        The scope's calendar decides (``end`` omitted: the moment ``start``); the
        reservation checks the labels again against the policy in force when it is made.
        """
        calendar = self.policy_for_scope(tenant, query_type).calendar
        return calendar.windows_overlapping(start, start if end is None else end)

    def reset(self, window: str) -> int:
        """Seal a closed window and drop its live accounts; returns how many. History is kept.

        A window may be reset once it has ended and every scope charged in it is past
        its policy's grace period, by the ledger's own clock. Sealing comes first and is
        final: a sealed window is never charged again (a late, retried or backfilled run
        is refused), so dropping its accounts never refunds anything. Refuses a window
        that is open, within its grace period, not a calendar label at all (it can never
        be proven closed), or that still has open reservations (reap them first).
        Resetting a sealed or never-charged window does nothing.
        """
        label = canonical_part("window", window)
        try:
            window_bounds(label)
        except ValueError as error:
            raise LedgerError(
                f"window {label!r} is not a calendar window, so it can never be proven closed"
            ) from error
        moment = _now()
        now = _stamp(moment)
        with self._write() as connection:
            policy_of = policy_lookup(self._policy_store.read(connection))
            scopes = [
                (row.tenant, row.query_type)
                for row in connection.execute(
                    select(WindowRow.tenant, WindowRow.query_type)
                    .where(WindowRow.window == label, WindowRow.sealed_at.is_(None))
                    .order_by(WindowRow.tenant, WindowRow.query_type)
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
                    select(Account.id, Account.open_reservations)
                    .where(Account.window == label, scoped)
                    .order_by(*_lock_order(connection))
                    .with_for_update()
                )
            )
            busy = sum(1 for row in rows if row.open_reservations)
            if busy:
                raise LedgerError(
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
            for chunk in _chunks([row.id for row in rows]):
                connection.execute(delete(Account).where(Account.id.in_(chunk)))
            self._log_keyless(
                connection,
                "reset",
                now,
                {
                    "window": label,
                    "accounts": len(rows),
                    "sealed": [list(scope) for scope in scopes],
                },
            )
        return len(rows)

    def reset_closed(self) -> dict[str, int]:
        """Reset every window past its grace period (the ledger's clock); accounts dropped per
        window. Windows that can never close (not calendar labels, or ending past the year
        9999) are left alone, as are those still within a scope's grace period."""
        moment = _now()
        with self.reading() as connection:
            policy_of = policy_lookup(self._policy_store.read(connection))
            rows = connection.execute(
                select(WindowRow.tenant, WindowRow.query_type, WindowRow.window).where(
                    WindowRow.sealed_at.is_(None)
                )
            ).all()
        due: dict[str, bool] = {}
        for tenant, query_type, label in rows:
            grace = policy_of(LedgerKey.from_canonical(tenant, "-", query_type, label)).grace
            due[label] = due.get(label, True) and is_closed(label, moment, grace)
        return {label: self.reset(label) for label in sorted(due) if due[label]}

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
        reason = free_text("reason", reason, limit=2000)
        moment = _now()
        now = _stamp(moment)
        keys = sorted([old, new])
        with self._pipelined() as pipe:
            locked, policies = self._lock_chargeable(pipe, keys, moment)
            if locked[old].open_reservations:
                raise LedgerError(f"{old} has open reservations; commit or reap them first")
            carried = locked[old].spend
            merged = locked[new].spend.plus(carried)
            connection = pipe.core()
            self._store_spend(connection, locked[new].id, merged, locked[old].releases, now)
            connection.execute(
                update(Account)
                .where(Account.id == locked[old].id)
                .values(rescoped_to=new.query_type, updated_at=now)
            )
            pipe.append_history(
                self._key,
                chain=self._chain(new),
                at=now,
                action="rescope",
                actor=self.actor,
                key=new,
                payload={"from": old.as_dict(), "carried": carried.as_payload(), "reason": reason},
            )
            return self._receipts_of([new], [merged], policies)[0]

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
        record such a correction on the key its spend lives on.
        """
        keys = self._one_key(key)
        mechanism = self._mechanism(mechanism)
        count = check.count("count", count)
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError("a correction needs a reason")
        free_text("reason", reason, limit=2000)
        cost = self._cost(mechanism, count)
        moment = _now()
        now = _stamp(moment)
        with self._pipelined() as pipe:
            locked, policies = self._lock_chargeable(pipe, keys, moment)
            held = locked[keys[0]]
            after = held.spend.plus(cost)
            connection = pipe.core()
            self._store_spend(connection, held.id, after, count, now)
            pipe.append_history(
                self._key,
                chain=self._chain(keys[0]),
                at=now,
                action="correction",
                actor=self.actor,
                key=keys[0],
                payload={
                    "mechanism": mechanism.to_spec(),
                    "count": count,
                    "cost": cost.as_payload(),
                    "reason": reason,
                },
            )
            return self._receipts_of(keys, [after], policies)[0]

    # ------------------------------------------------------------------ audit

    def verify(
        self, checkpoint: Checkpoint | None = None, *, quarantine: bool = True
    ) -> VerifyReport:
        """Prove the ledger's facts from its history (:mod:`audit`); quarantine on failure.

        Checks every link (HMACs under the chain key when the ledger has one), every entry
        ``checkpoint`` recorded (so checkpointed history cannot have been erased,
        truncated or rewritten), and every stored row against the history's replay,
        including that no granted release ever took a key past its cap. All reads come
        from one snapshot, so writers running meanwhile cannot make a healthy ledger look
        corrupt. With ``quarantine`` (the default), a failed verify quarantines the
        ledger: nothing is released until :meth:`clear_quarantine`.
        """
        if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
            raise ValueError(f"checkpoint must be a Checkpoint, got {checkpoint!r}")
        settings = audit.AuditSettings(
            self._orders, self._delta, self._conversion, self._key, checkpoint
        )
        try:
            with database.transaction(self._pool(), write=False, snapshot=True) as connection:
                report = audit.verify(connection, settings)
        except LedgerUnavailable:
            raise  # nothing was read: no verdict either way
        except Exception as error:  # noqa: BLE001 - a verify that crashes is a verify that failed
            # Stored values verify could not even handle (a text in an integer column):
            # crashing must not be a way around the quarantine.
            report = VerifyReport(
                entries=0,
                accounts=0,
                problems=[f"verification could not complete: {type(error).__name__}: {error}"],
                keyed=self._key.keyed,
            )
        if report.problems and quarantine:
            try:
                self.quarantine(
                    f"verify found {len(report.problems)} problem(s), the first: "
                    f"{report.problems[0][:1000]}",
                    problems=[p[:1000] for p in report.problems[:_QUARANTINE_LISTED]],
                )
            except LedgerError as error:
                report.problems.append(f"the ledger could not be quarantined: {error}")
        return report

    def checkpoint(self, report: VerifyReport) -> Checkpoint:
        """A checkpoint of what ``report`` verified: keep it outside the ledger database.

        Only a verify that passed is checkpointed: its heads are the ones it proved.
        """
        if not isinstance(report, VerifyReport) or not report.ok:
            raise ValueError("only a verify report that passed can be checkpointed")
        return Checkpoint.of(report.ledger, _stamp(_now()), report.entries, report.heads, self._key)

    @property
    def chain_key(self) -> history.ChainKey:
        """The key the history is linked with (unkeyed without one): checkpoints use it."""
        return self._key

    def quarantine_status(self) -> tuple[str, str] | None:
        """(since, reason) while the ledger is quarantined, else None."""
        with self.reading() as connection:
            row = connection.execute(
                select(LedgerConfig.quarantined_at, LedgerConfig.quarantine_reason)
            ).one()
        return None if row.quarantined_at is None else (row.quarantined_at, row.quarantine_reason)

    def quarantine(self, reason: str, problems: Sequence[str] = ()) -> bool:
        """Stop every release until an operator clears it (audited); False if already in force.

        The quarantine is recorded in the history too. When the history cannot take an
        entry (its chain head was tampered with), the quarantine is set all the same: a
        broken chain must never keep releases running.
        """
        reason = _reason(reason)
        try:
            return self._set_quarantine(reason, problems, audited=True)
        except (LedgerCorrupt, LedgerConfigMismatch) as error:
            return self._set_quarantine(
                _reason(
                    f"{reason[:1500]} (not in the history, which refused the entry: "
                    f"{str(error)[:300]})"
                ),
                problems,
                audited=False,
            )

    def _set_quarantine(self, reason: str, problems: Sequence[str], *, audited: bool) -> bool:
        now = _stamp(_now())
        with self._write() as connection:
            held = connection.execute(
                select(LedgerConfig.quarantined_at).where(LedgerConfig.id == 1).with_for_update()
            ).scalar_one_or_none()
            if held is not None:
                return False
            connection.execute(
                update(LedgerConfig).values(quarantined_at=now, quarantine_reason=reason)
            )
            if audited:
                self._log_keyless(
                    connection,
                    "quarantine",
                    now,
                    {"reason": reason, "problems": [str(p) for p in problems]},
                )
        return True

    def clear_quarantine(self, reason: str) -> None:
        """Let releases run again after an investigation; ``reason`` says what was found.

        The clearing is a history entry naming its actor and reason. A ledger whose
        tables still disagree with its history is quarantined again by the next verify.
        """
        reason = _reason(reason)
        now = _stamp(_now())
        with self._write() as connection:
            row = connection.execute(
                select(LedgerConfig.quarantined_at, LedgerConfig.quarantine_reason)
                .where(LedgerConfig.id == 1)
                .with_for_update()
            ).one()
            if row.quarantined_at is None:
                raise LedgerError("the ledger is not quarantined")
            connection.execute(
                update(LedgerConfig)
                .where(LedgerConfig.id == 1)
                .values(quarantined_at=None, quarantine_reason=None)
            )
            self._log_keyless(
                connection,
                "unquarantine",
                now,
                {
                    "reason": reason,
                    "quarantined_at": row.quarantined_at,
                    "quarantine_reason": row.quarantine_reason,
                },
            )

    def adopt_chain_key(self, chain_key: str | bytes) -> None:
        """Key an unkeyed ledger's history from now on (``dp-budget db adopt-key``).

        The history must verify first. The adoption entry is linked with the new key and
        records every chain head, so the unkeyed history before it can no longer be
        rewritten unnoticed either. Every head is locked meanwhile and carries the key's
        id from then on, so a writer still holding no key is refused instead of linking
        an unkeyed entry; open the ledger with the key everywhere afterwards.
        """
        key = history.ChainKey(chain_key)
        if not key.keyed:
            raise ValueError("adopt_chain_key needs a chain key")
        if self._key.keyed:
            raise LedgerError("this ledger's history is keyed already")
        report = self.verify()
        if not report.ok:
            raise LedgerCorrupt(
                f"refusing to key a history that does not verify ({len(report.problems)} "
                f"problem(s), the first: {report.problems[0]})"
            )
        now = _stamp(_now())
        with self._write() as connection:
            heads = connection.execute(
                select(ChainHead.id, ChainHead.seq, ChainHead.hash)
                .order_by(ChainHead.id)
                .with_for_update()
            ).all()
            if tuple(tuple(head) for head in heads) != report.heads:
                raise LedgerError("the history grew while it was verified; adopt the key again")
            connection.execute(update(ChainHead).values(key_id=key.key_id))
            seq = history.append(
                connection,
                key,
                chain=history.KEYLESS_CHAIN,
                at=now,
                action="adopt-key",
                actor=self.actor,
                payload={"chain_key_id": key.key_id, "heads": [list(h) for h in report.heads]},
            )
            connection.execute(
                update(LedgerConfig)
                .where(LedgerConfig.id == 1)
                .values(chain_key_id=key.key_id, keyed_from=seq)
            )
        self._key = key


def _quarantined(since: str, reason: str) -> LedgerQuarantined:
    return LedgerQuarantined(f"the ledger is quarantined since {since} ({reason}){_CLEAR}")


def _sealed(tenant: str, query_type: str, window: str, sealed_at: str) -> WindowSealed:
    return WindowSealed(
        f"window {window!r} of tenant {tenant!r}, query type {query_type!r} was sealed at "
        f"{sealed_at} (reset after its grace period): nothing can be charged to it any more"
    )


def _rescoped(key: object, moved: str) -> WindowSealed:
    return WindowSealed(
        f"{key} was re-scoped to query type {moved!r}: its spend lives there now, and this "
        "key can never be charged again"
    )


def _shown(value: object) -> str:
    """A caller's value as a one-line error may quote it: its repr, or only its type when
    that is not one short printable line."""
    text = repr(value)
    return text if text.isprintable() and len(text) <= 200 else type(value).__name__


def _lease_of(row: Any) -> str | None:
    """A reservation row's lease, None when it holds none: NULL, or a value that is not
    text (a BLOB written into the SQLite column by hand). The column is no fact verify
    checks, so a value of it must never stop a reap (and every reservation after it)."""
    return row.lease_expires_at if isinstance(row.lease_expires_at, str) else None


def _reap_reason(
    row: Any, lease: str | None, at: str, cutoff: str | None, older_than: timedelta | None
) -> str | None:
    """Why an open reservation with ``lease`` is due for reaping at ``at``, None if it is
    not (any more)."""
    if lease is None:
        return f"open since {row.created_at}, without a lease"
    if lease <= at:
        return f"open since {row.created_at}, its lease ran out at {lease}"
    if cutoff is not None and row.created_at <= cutoff:
        return f"open since {row.created_at}, older than {older_than}"
    return None


def _reason(reason: object) -> str:
    """An operator's reason: a non-empty, visible text of at most 2000 characters."""
    if not isinstance(reason, str) or not reason.strip() or len(reason) > 2000:
        raise ValueError("a reason must be a non-empty string of at most 2000 characters")
    if any(ord(c) < 32 and c not in "\n\t" for c in reason):
        raise ValueError("a reason must not hold control characters")
    return free_text("reason", reason).strip()
