"""Auditing a ledger: the facts every table must agree with, proven from the history.

The history is the ledger's only source of truth: every other table is what replaying
it must give. ``verify`` checks its links (keyed when the ledger has a chain key, and
against the last checkpoint kept outside the database), then replays it entry by entry
and compares every stored row, column by column, with what the replay says:

* the configuration with its creation (and key adoption) entry, each policy row with
  its latest policy entry, the quarantine with its last quarantine entry;
* each reservation with its reserve entry and its closing entry, each cost with what its
  mechanism costs (a cost an earlier version priced differently, for the mechanisms whose
  curves this version corrected, is noted and the cap proven with the higher price), each
  commit's cost with its reservation's, each key set with its digest;
* each account's committed and pending spend, counts, re-scope mark and time;
* each window's row: canonical for its calendar, first charged when the history says,
  sealed exactly when a reset sealed it;

and proves the cap: no key's lifetime spend in a window (across resets, re-scopes and
corrections) plus what was in flight ever passed the cap in force when a reservation was
granted, and nothing was charged to a sealed window or a re-scoped key.

A reservation's lease (``lease_expires_at``) is no fact of the history and is not checked:
renewals write no entry, and the lease only decides when an open reservation is charged
(the reap entry that charges it is a fact, checked like a commit), never whether.

Memory is bounded by the number of keys, never by the length of the history: every
table is streamed, the history together with each entry's reservation keys in one pass.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
from sqlalchemy import Connection, and_, select

from dp_budget_provider.accounting import Conversion, Mechanism
from dp_budget_provider.ledger import history
from dp_budget_provider.ledger.checkpoints import Checkpoint
from dp_budget_provider.ledger.errors import LedgerCorrupt
from dp_budget_provider.ledger.keys import LedgerKey
from dp_budget_provider.ledger.policy import ANY, DEFAULT_GRACE, Policy
from dp_budget_provider.ledger.policy_store import policy_lookup
from dp_budget_provider.ledger.records import VerifyReport
from dp_budget_provider.ledger.schema import (
    Account,
    ChainHead,
    HistoryEntry,
    LedgerConfig,
    PolicyRow,
    Reservation,
    ReservationKey,
    Window,
)
from dp_budget_provider.ledger.spend import Pending, Spend
from dp_budget_provider.ledger.windows import WindowCalendar

_BATCH = 5000
# A granted reservation is a breach when the replayed total passes its cap by more than
# floating-point reassociation could explain (the gate itself compares exactly).
_CAP_SLACK = 1e-9
_STATES = {"commit": "committed", "reap": "reaped", "release": "released"}
_CHARGES = ("reserve", "correction", "rescope")
# Actions whose payload names no reservation and no key, and that change no account.
_KEYLESS = ("create", "policy", "adopt-key", "quarantine", "unquarantine")
# Mechanisms whose curves an earlier version evaluated below (or, at a few orders, above)
# the sound curve this version computes: the subsampled Gaussian's truncated fractional
# series, the pure-DP and Laplace curves' cancellation at small eps0. A recorded cost of
# these kinds that differs from today's price is an earlier version's pricing, not an
# edit: verify notes it and proves the cap with the larger of the two at every order.
_REPRICED = frozenset({"poisson_subsampled_gaussian", "pure_dp", "laplace"})


def _key_of(row: Any) -> LedgerKey:
    return LedgerKey.from_canonical(row.tenant, row.subject, row.query_type, row.window)


@dataclass(frozen=True)
class AuditSettings:
    """What the verifier holds outside the database: the grid, delta, conversion and key."""

    orders: np.ndarray
    delta: float
    conversion: Conversion
    key: history.ChainKey
    checkpoint: Checkpoint | None = None


@dataclass(slots=True)
class _KeyState:
    """One key's account as the history makes it."""

    live: Spend = field(default_factory=Spend)  # the live account's committed spend
    lifetime: Spend = field(default_factory=Spend)  # everything ever charged to the key
    pending: Pending = field(default_factory=Pending)
    open: int = 0
    releases: int = 0
    updated_at: str = ""
    rescoped_to: str | None = None
    dropped: bool = False  # its window was reset: the account is gone, the key sealed
    # What re-priced entries (committed or in flight) cost beyond what they recorded.
    repriced: np.ndarray | None = None


@dataclass(slots=True)
class _Open:
    """An open reservation, as its reserve entry made it."""

    cost: Spend
    cost_text: str
    count: int
    digest: str
    repriced: np.ndarray | None = None  # today's price beyond the recorded cost


@dataclass(slots=True)
class _Scope:
    """One (tenant, query type, window) as the history made it."""

    first_at: str
    sealed_at: str | None = None


def _plus(curve: np.ndarray | None, extra: np.ndarray | None) -> np.ndarray | None:
    """Curves that may be absent (None: zero), added."""
    if extra is None:
        return curve
    return extra.copy() if curve is None else curve + extra


def _canonical_cost(payload: Any, size: int) -> tuple[Spend, str]:
    """A cost from a payload, and its canonical text (exact equality of costs)."""
    spend = Spend.from_payload(payload, size)
    return spend, history.canonical_json(spend.as_payload())


def _policy_of_payload(payload: dict[str, Any]) -> Policy:
    """A policy as its history entry recorded it (entries before grace periods: the default)."""
    calendar = payload.get("calendar") or {}
    if isinstance(calendar, str):
        calendar = {"kind": calendar, "length_seconds": payload.get("calendar_length_seconds")}
    return Policy(
        cap_epsilon=payload["cap_epsilon"],
        warn_fraction=payload["warn_fraction"],
        tenant=payload["tenant"],
        query_type=payload["query_type"],
        calendar=WindowCalendar(calendar.get("kind", "iso_week"), calendar.get("length_seconds")),
        min_window=timedelta(seconds=payload["min_window_seconds"]),
        compliance_clause=payload.get("compliance_clause", ""),
        grace=timedelta(seconds=payload.get("grace_seconds", DEFAULT_GRACE.total_seconds())),
    )


class _Replay:
    """The history applied in order: what every table must hold, and every breach on the way."""

    def __init__(self, settings: AuditSettings) -> None:
        self.settings = settings
        self.size = settings.orders.size
        self.keys: dict[LedgerKey, _KeyState] = {}
        self.open: dict[str, _Open] = {}
        self.scopes: dict[tuple[str, str, str], _Scope] = {}
        self.legacy_resets: dict[str, str] = {}  # window -> first reset before seals existed
        self.policies: dict[tuple[str, str], Policy] = {}
        self.policy_entries: dict[tuple[str, str], tuple[dict[str, Any], str]] = {}
        self.create: tuple[Any, dict[str, Any]] | None = None
        self.adopted: tuple[int, str] | None = None  # (seq, key id) of a key adoption
        self.quarantine: tuple[str, str] | None = None  # (at, reason)
        self.problems: list[str] = []
        self.notes: list[str] = []
        self._bounds: dict[tuple[Any, ...], float] = {}
        self._costs: dict[tuple[str, int], Spend] = {}

    # ------------------------------------------------------------------ helpers

    def _problem(self, entry: Any, text: str) -> None:
        self.problems.append(f"entry {entry.seq} ({entry.action}): {text}")

    def _state(self, key: LedgerKey) -> _KeyState:
        state = self.keys.get(key)
        if state is None:
            state = self.keys[key] = _KeyState()
        return state

    def _epsilon(self, spend: Spend) -> float:
        signature = spend.signature
        found = self._bounds.get(signature)
        if found is None:
            if len(self._bounds) > 100_000:
                self._bounds.clear()
            s = self.settings
            found = self._bounds[signature] = spend.epsilon(s.orders, s.delta, s.conversion).epsilon
        return found

    def _charged(self, entry: Any, keys: list[LedgerKey]) -> None:
        """Check that ``keys`` could be charged by ``entry``: canonical windows of the
        calendar in force, not sealed, not re-scoped. Records first charges."""
        policy_of = policy_lookup(self.policies) if self.policies else None
        for key in keys:
            scope = (key.tenant, key.query_type, key.window)
            known = self.scopes.get(scope)
            if known is None:
                self.scopes[scope] = _Scope(entry.at)
                if policy_of is not None:
                    calendar = policy_of(key).calendar
                    if not calendar.is_canonical(key.window):
                        self._problem(
                            entry, f"{key}: window is not one of its {calendar.kind} calendar"
                        )
            elif known.sealed_at is not None:
                self._problem(entry, f"{key}: charged to a window sealed at {known.sealed_at}")
            state = self.keys.get(key)
            if state is not None and state.rescoped_to is not None:
                self._problem(entry, f"{key}: charged after it was re-scoped")

    def _touch(self, keys: list[LedgerKey], at: str) -> None:
        for key in keys:
            self._state(key).updated_at = at

    def _close(self, entry: Any, keys: list[LedgerKey]) -> _Open | None:
        """One reservation closes on ``keys``: its cost leaves their pending spend."""
        held = self.open.pop(entry.reservation_id or "", None)
        if held is None:
            self._problem(entry, f"reservation {entry.reservation_id} is not open")
            return None
        if history.keys_digest(keys) != held.digest:
            self._problem(entry, "its keys differ from its reservation's")
        for key in keys:
            state = self._state(key)
            state.open -= 1
            state.pending = state.pending.remove(held.cost) if state.open > 0 else Pending()
        return held

    # ------------------------------------------------------------------ entries

    def apply(self, entry: Any, keys: list[LedgerKey]) -> None:
        """Apply one entry (with its reservation's keys, in order)."""
        try:
            payload = json.loads(entry.payload)
            handler = getattr(self, "_on_" + entry.action.replace("-", "_"), None)
            if handler is None:
                self._problem(entry, "an action the ledger never writes")
                return
            handler(entry, payload, keys)
        except (ValueError, KeyError, TypeError, AttributeError, LedgerCorrupt) as error:
            self._problem(entry, f"unreadable payload ({error!r}); edited?")

    def _on_create(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        if self.create is not None:
            self._problem(entry, "a second creation entry")
            return
        self.create = (entry, payload)

    def _on_adopt_key(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        if self.adopted is not None:
            self._problem(entry, "a second key adoption")
        self.adopted = (entry.seq, payload["chain_key_id"])

    def _on_policy(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        policy = _policy_of_payload(payload)
        self.policies[policy.scope] = policy
        self.policy_entries[policy.scope] = (policy.as_record(), entry.at)

    def _on_quarantine(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        self.quarantine = (entry.at, payload["reason"])

    def _on_unquarantine(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        if self.quarantine is None:
            self._problem(entry, "clears a quarantine that was not in force")
        self.quarantine = None

    def _priced(
        self, entry: Any, payload: dict[str, Any], cost: Spend
    ) -> tuple[bool, np.ndarray | None]:
        """Whether ``cost`` is what the entry's mechanism costs on the ledger's grid, and
        for an earlier version's pricing of a re-priced kind what today's price adds
        (elementwise, >= 0) to prove the cap with."""
        spec, count = payload["mechanism"], int(payload["count"])
        signature = (history.canonical_json(spec), count)
        found = self._costs.get(signature)
        if found is None:
            if len(self._costs) > 10_000:
                self._costs.clear()
            mechanism = Mechanism.from_spec(spec)
            found = self._costs[signature] = Spend.of_release(
                mechanism, count, self.settings.orders
            )
        if cost.close_to(found):
            return True, None
        if spec.get("kind") not in _REPRICED or cost.rho or found.rho:
            return False, None
        orders = self.settings.orders
        extra = np.maximum(found.curve(orders) - cost.curve(orders), 0.0)
        self.notes.append(
            f"entry {entry.seq} ({entry.action}): recorded cost of {spec.get('kind')} is an "
            f"earlier version's pricing; today's sound price is higher by up to "
            f"{float(extra.max()):.3g} in RDP (the cap is proven with it)"
        )
        return True, extra

    def _on_reserve(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        cost, cost_text = _canonical_cost(payload["cost"], self.size)
        digest = payload["keys_digest"]
        if history.keys_digest(keys) != digest or len(keys) != payload["key_count"]:
            self._problem(entry, "the reservation's key rows differ from its digest")
        priced, repriced = self._priced(entry, payload, cost)
        if not priced:
            self._problem(entry, "the reserved cost is not what its mechanism costs")
        if entry.reservation_id in self.open:
            self._problem(entry, f"reservation {entry.reservation_id} reserved twice")
        self._charged(entry, keys)
        policy_of = policy_lookup(self.policies)
        for key in keys:
            state = self._state(key)
            state.open += 1
            state.pending = state.pending.add(cost)
            state.updated_at = entry.at
            state.repriced = _plus(state.repriced, repriced)
            cap = policy_of(key).cap_epsilon
            total = state.lifetime.plus(state.pending.as_spend())
            if state.repriced is not None:
                total = total.plus(Spend(0.0, state.repriced, None))
            epsilon = self._epsilon(total)
            if epsilon > cap * (1 + _CAP_SLACK):
                self._problem(
                    entry,
                    f"{key}: granted although its lifetime spend with what was in flight "
                    f"reaches eps {epsilon:.6g}, above its cap {cap:.6g}",
                )
        self.open[entry.reservation_id] = _Open(
            cost, cost_text, int(payload["count"]), digest, repriced
        )

    def _on_commit(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        held = self._close(entry, keys)
        if held is None:
            return
        _, cost_text = _canonical_cost(payload["cost"], self.size)
        if cost_text != held.cost_text or int(payload["count"]) != held.count:
            self._problem(entry, "its cost differs from its reservation's")
        for key in keys:
            state = self._state(key)
            state.live = state.live.plus(held.cost)
            state.lifetime = state.lifetime.plus(held.cost)
            state.releases += held.count
            state.updated_at = entry.at

    _on_reap = _on_commit

    def _on_release(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        held = self._close(entry, keys)
        if held is not None and held.repriced is not None:  # never charged: nor is the extra
            for key in keys:
                state = self._state(key)
                state.repriced = np.maximum(state.repriced - held.repriced, 0.0)
        self._touch(keys, entry.at)

    def _on_correction(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        key = _key_of(entry)
        cost = Spend.from_payload(payload["cost"], self.size)
        priced, repriced = self._priced(entry, payload, cost)
        if not priced:
            self._problem(entry, "the corrected cost is not what its mechanism costs")
        self._charged(entry, [key])
        state = self._state(key)
        state.repriced = _plus(state.repriced, repriced)
        state.live = state.live.plus(cost)
        state.lifetime = state.lifetime.plus(cost)
        state.releases += int(payload["count"])
        state.updated_at = entry.at

    def _on_rescope(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        old, new = LedgerKey(**payload["from"]), _key_of(entry)
        carried = Spend.from_payload(payload["carried"], self.size)
        moved = self._state(old)
        if (old.tenant, old.subject, old.window) != (new.tenant, new.subject, new.window):
            # An earlier version moved spend between keys and dropped the old one.
            target = self._state(new)
            target.live = target.live.plus(moved.live)
            target.lifetime = target.lifetime.plus(moved.lifetime)
            target.repriced = _plus(target.repriced, moved.repriced)
            del self.keys[old]
            return
        self._charged(entry, [old, new])
        if not carried.close_to(moved.live):
            self._problem(entry, f"carries other spend than {old} held")
        if moved.open:
            self._problem(entry, f"{old} was re-scoped with open reservations")
        target = self._state(new)
        target.live = target.live.plus(moved.live)
        target.lifetime = target.lifetime.plus(moved.lifetime)
        target.repriced = _plus(target.repriced, moved.repriced)
        target.releases += moved.releases
        moved.rescoped_to = new.query_type
        self._touch([old, new], entry.at)

    def _on_reset(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        window = payload["window"]
        sealed = payload.get("sealed")  # None: an earlier version's reset of every scope
        scopes = None if sealed is None else {tuple(scope) for scope in sealed}
        if scopes is None:
            self.legacy_resets.setdefault(window, entry.at)
        dropped = 0
        for key, state in self.keys.items():
            if key.window != window or state.dropped:
                continue
            if scopes is None or (key.tenant, key.query_type) in scopes:
                if state.open:
                    self._problem(entry, f"{key}: reset with open reservations")
                dropped += 1
                if scopes is None:  # before seals, a reset let the key start again from zero
                    self.keys[key] = _KeyState(lifetime=state.lifetime)
                else:
                    state.dropped = True
        for tenant, query_type in sorted(scopes or ()):
            scope = self.scopes.get((tenant, query_type, window))
            if scope is None:
                self._problem(
                    entry, f"seals window {window} of ({tenant}, {query_type}), never charged"
                )
            elif scope.sealed_at is not None:
                self._problem(entry, f"seals window {window} of ({tenant}, {query_type}) again")
            else:
                scope.sealed_at = entry.at
        if payload.get("accounts") != dropped:
            self._problem(
                entry,
                f"says it dropped {payload.get('accounts')} accounts; the history had {dropped}",
            )


def _history_with_keys(connection: Connection) -> Iterator[tuple[Any, list[LedgerKey]]]:
    """Every entry in order with its reservation's keys in position order, streamed."""
    keys = ReservationKey.__table__.alias("k")
    statement = (
        select(
            HistoryEntry,
            keys.c.tenant.label("k_tenant"),
            keys.c.subject.label("k_subject"),
            keys.c.query_type.label("k_query_type"),
            keys.c.window.label("k_window"),
            keys.c.position.label("k_position"),
        )
        .outerjoin(keys, keys.c.reservation_id == HistoryEntry.reservation_id)
        .order_by(HistoryEntry.seq, keys.c.position)
    )
    rows = connection.execution_options(yield_per=_BATCH).execute(statement)
    for _, group in itertools.groupby(rows, key=lambda row: row.seq):
        rows_of_entry = list(group)
        first = rows_of_entry[0]
        if first.k_tenant is None:
            yield first, []
            continue
        listed = [_reservation_key(row) for row in rows_of_entry]
        if any(row.k_position != index for index, row in enumerate(rows_of_entry)):
            listed.append(_MISNUMBERED)  # the digest can no longer match: reported there
        yield first, listed


# Stands in for key rows whose positions are not 0..n-1 (edited in SQL).
_MISNUMBERED = LedgerKey.from_canonical("", "", "", "positions edited")


def _reservation_key(row: Any) -> LedgerKey:
    return LedgerKey.from_canonical(row.k_tenant, row.k_subject, row.k_query_type, row.k_window)


def _check_config(connection: Connection, replay: _Replay, problems: list[str]) -> Any:
    config = connection.execute(select(LedgerConfig)).all()
    if len(config) != 1 or config[0].id != 1:
        problems.append(f"dp_ledger_config: {len(config)} rows, not the one row with id 1")
        return config[0] if config else None
    row = config[0]
    if replay.create is None:
        problems.append("dp_ledger_config: no creation entry in the history")
        return row
    entry, payload = replay.create
    expected = {
        "delta": payload["delta"],
        "orders": history.canonical_json(payload["orders"]),
        "conversion": payload["conversion"],
        "created_at": entry.at,
        "chains": payload.get("chains", row.chains),
    }
    stored = {
        "delta": row.delta,
        "orders": history.canonical_json(json.loads(row.orders)),
        "conversion": row.conversion,
        "created_at": row.created_at,
        "chains": row.chains,
    }
    for column, value in expected.items():
        if stored[column] != value:
            problems.append(
                f"dp_ledger_config.{column}: {stored[column]!r} differs from the creation "
                f"entry's {value!r}"
            )
    if payload.get("chain_key_id") is not None:
        keyed = (entry.seq, payload["chain_key_id"])
    else:
        keyed = replay.adopted
    if (row.keyed_from, row.chain_key_id) != (keyed or (None, None)):
        problems.append(
            f"dp_ledger_config: keyed from {row.keyed_from!r} with key {row.chain_key_id!r}, "
            f"but the history says {keyed!r}"
        )
    settings = replay.settings
    if row.chain_key_id != settings.key.key_id:
        problems.append("dp_ledger_config.chain_key_id: not the key this verifier holds")
    if (row.delta, row.conversion) != (settings.delta, settings.conversion) or not np.array_equal(
        np.array(json.loads(row.orders)), settings.orders
    ):
        problems.append("dp_ledger_config: delta, grid or conversion differ from the verifier's")
    quarantine = (row.quarantined_at, row.quarantine_reason)
    if quarantine != (replay.quarantine or (None, None)):
        problems.append(
            f"dp_ledger_config: quarantine {quarantine!r} differs from the history's "
            f"{replay.quarantine!r}"
        )
    if connection.dialect.name == "postgresql":
        triggers = connection.exec_driver_sql(
            "SELECT count(*) FROM pg_trigger WHERE tgname = 'dp_policies_version' "
            "AND tgrelid = 'dp_policies'::regclass AND tgenabled <> 'D'"
        ).scalar_one()
        if triggers != 1:
            problems.append(
                "dp_policies: trigger dp_policies_version is missing or disabled (policy "
                "changes would not reach processes reusing policies by version)"
            )
    heads = set(connection.execute(select(ChainHead.key_id).distinct()).scalars())
    if heads - {row.chain_key_id}:
        problems.append(f"dp_chain_head.key_id: {sorted(map(str, heads))} is not the ledger's key")
    return row


def _check_policies(connection: Connection, replay: _Replay, problems: list[str]) -> None:
    seen = set()
    for row in connection.execute(select(PolicyRow)):
        scope = (row.tenant, row.query_type)
        seen.add(scope)
        audited = replay.policy_entries.get(scope)
        if audited is None:
            problems.append(f"policy {scope}: no policy entry in the history")
            continue
        record, at = audited
        for column, value in {**record, "updated_at": at}.items():
            held = getattr(row, column)
            if held != value:
                problems.append(
                    f"policy {scope}.{column}: {held!r} differs from its latest entry's {value!r}"
                )
    for scope in sorted(replay.policy_entries.keys() - seen):
        problems.append(f"policy {scope}: in the history but its row is missing")
    if (ANY, ANY) not in seen:
        problems.append("dp_policies: no default policy")


def _check_reservations(
    connection: Connection, settings: AuditSettings, problems: list[str]
) -> None:
    """Each reservation row against its reserve entry and its closing entry (streamed)."""
    opened = HistoryEntry.__table__.alias("r")
    closed = HistoryEntry.__table__.alias("c")
    statement = (
        select(
            Reservation,
            opened.c.seq.label("r_seq"),
            opened.c.at.label("r_at"),
            opened.c.actor.label("r_actor"),
            opened.c.payload.label("r_payload"),
            closed.c.action.label("c_action"),
            closed.c.at.label("c_at"),
        )
        .outerjoin(
            opened, and_(opened.c.reservation_id == Reservation.id, opened.c.action == "reserve")
        )
        .outerjoin(
            closed,
            and_(
                closed.c.reservation_id == Reservation.id,
                closed.c.action.in_(tuple(_STATES)),
            ),
        )
        .order_by(Reservation.id)
    )
    size = settings.orders.size
    for row in connection.execution_options(yield_per=_BATCH).execute(statement):
        name = f"reservation {row.id}"
        if row.r_seq is None:
            problems.append(f"{name}: no reserve entry in the history")
            continue
        try:
            payload = json.loads(row.r_payload)
            cost = Spend.from_columns(
                row.cost_rho, row.cost_residual, row.cost_gaussian_mu2, size
            ).as_payload()
            mechanism = history.canonical_json(json.loads(row.mechanism))
        except (ValueError, TypeError, LedgerCorrupt) as error:
            problems.append(f"{name}: unreadable ({error})")
            continue
        expected: dict[str, Any] = {
            "attempt_id": payload.get("attempt_id"),
            "state": _STATES.get(row.c_action or "", "open"),
            "mechanism": history.canonical_json(payload.get("mechanism")),
            "count": payload.get("count"),
            "cost": history.canonical_json(payload.get("cost")),
            "key_count": payload.get("key_count"),
            "keys_digest": payload.get("keys_digest"),
            "actor": row.r_actor,
            "created_at": row.r_at,
            "resolved_at": row.c_at,
        }
        stored: dict[str, Any] = {
            "attempt_id": row.attempt_id,
            "state": row.state,
            "mechanism": mechanism,
            "count": row.count,
            "cost": history.canonical_json(cost),
            "key_count": row.key_count,
            "keys_digest": row.keys_digest,
            "actor": row.actor,
            "created_at": row.created_at,
            "resolved_at": row.resolved_at,
        }
        for column in ("token_hash", "prospective_epsilon"):
            if column in payload:
                expected[column] = payload[column]
                stored[column] = getattr(row, column)
        if "prospective_epsilon" in payload:  # the server-side reserve's columns stay empty
            for column in ("prospective_rho", "prospective_mu2"):
                expected[column] = None
                stored[column] = getattr(row, column)
        if stored.get("token_hash", "") is None:
            # A downgrade below 0005 drops token hashes; without one, nobody can commit or
            # release the reservation (only reaping charges it), so nothing is gained.
            del expected["token_hash"]
        for column, value in expected.items():
            if stored[column] != value:
                problems.append(
                    f"{name}.{column}: {stored[column]!r} differs from its history's {value!r}"
                )
    orphans = connection.execute(
        select(ReservationKey.reservation_id)
        .distinct()
        .where(~ReservationKey.reservation_id.in_(select(Reservation.id)))
    ).scalars()
    problems += [
        f"reservation {rid}: key rows of a reservation that does not exist" for rid in orphans
    ]
    missing = connection.execute(
        select(HistoryEntry.seq, HistoryEntry.reservation_id).where(
            HistoryEntry.action == "reserve",
            ~HistoryEntry.reservation_id.in_(select(Reservation.id)),
        )
    )
    problems += [f"entry {seq}: reservation {rid} has no row" for seq, rid in missing]


def _check_accounts(connection: Connection, replay: _Replay, problems: list[str]) -> int:
    size = replay.size
    seen: set[LedgerKey] = set()
    count = 0
    for row in connection.execution_options(yield_per=_BATCH).execute(select(Account)):
        count += 1
        key = _key_of(row)
        seen.add(key)
        state = replay.keys.get(key)
        if state is None or state.dropped:
            problems.append(f"account {key}: no history entry charged it (or its window was reset)")
            continue
        try:
            spend = Spend.from_columns(row.rho, row.residual, row.gaussian_mu2, size)
            pending = Pending.from_columns(
                row.pending_rho, row.pending_residual, row.pending_mu2, row.pending_others, size
            )
        except (ValueError, TypeError, LedgerCorrupt) as error:
            problems.append(f"account {key}: unreadable ({error})")
            continue
        checks: list[tuple[str, bool]] = [
            ("committed spend", spend.close_to(state.live)),
            ("pending spend", pending.close_to(state.pending)),
            ("open_reservations", row.open_reservations == state.open),
            ("releases", row.releases == state.releases),
            ("rescoped_to", row.rescoped_to == state.rescoped_to),
            ("updated_at", row.updated_at == state.updated_at),
        ]
        for what, fine in checks:
            if not fine:
                problems.append(f"account {key}: {what} differs from the history's")
    for key, state in replay.keys.items():
        if key in seen or state.dropped:
            continue
        if state.live.rho or state.live.residual is not None or state.open:
            problems.append(f"account {key}: charged or held in the history but missing")
    return count


def _check_windows(connection: Connection, replay: _Replay, problems: list[str]) -> None:
    policy_of: Callable[[LedgerKey], Policy] = policy_lookup(replay.policies)
    seen = set()
    for row in connection.execution_options(yield_per=_BATCH).execute(select(Window)):
        scope = (row.tenant, row.query_type, row.window)
        seen.add(scope)
        name = f"window {row.window} of ({row.tenant}, {row.query_type})"
        calendar = policy_of(
            LedgerKey.from_canonical(row.tenant, "-", row.query_type, row.window)
        ).calendar
        if not calendar.is_canonical(row.window):
            problems.append(f"{name}: not a window of its {calendar.kind} calendar")
        known = replay.scopes.get(scope)
        if known is None:
            problems.append(f"{name}: no history entry charged it")
            continue
        if row.created_at != known.first_at:
            problems.append(
                f"{name}: created_at {row.created_at} is not its first charge {known.first_at}"
            )
        sealed = known.sealed_at
        legacy = replay.legacy_resets.get(row.window)
        if sealed is None and legacy is not None and known.first_at <= legacy:
            sealed = legacy  # reset before seals existed: the upgrade sealed it then
        if row.sealed_at != sealed:
            problems.append(
                f"{name}: sealed_at {row.sealed_at} differs from the history's {sealed}"
            )
    for scope in sorted(replay.scopes.keys() - seen):
        problems.append(f"window {scope[2]} of ({scope[0]}, {scope[1]}): charged but has no row")


def _marks(connection: Connection, settings: AuditSettings, problems: list[str]) -> dict:
    """Entries that must be in the history unchanged: the checkpoint's, and the heads a key
    adoption sealed (its own keyed link vouches for them)."""
    marks: dict[int, tuple[int, str]] = {}
    adoptions = connection.execute(
        select(HistoryEntry.payload).where(HistoryEntry.action == "adopt-key")
    ).scalars()
    for payload in adoptions:
        try:
            marks.update(history.marks(json.loads(payload)["heads"]))
        except (ValueError, KeyError, TypeError) as error:
            problems.append(f"key adoption entry: unreadable heads ({error!r})")
    checkpoint = settings.checkpoint
    if checkpoint is not None:
        if checkpoint.ledger != ledger_identity(connection):
            problems.append(f"the checkpoint of {checkpoint.at} is of another ledger")
        marks.update(checkpoint.marks())
    return marks


def ledger_identity(connection: Connection) -> str:
    """What names a ledger in its checkpoints: the link of its creation entry."""
    found = connection.execute(
        select(HistoryEntry.hash)
        .where(HistoryEntry.action == "create")
        .order_by(HistoryEntry.seq)
        .limit(1)
    ).scalar_one_or_none()
    return found or ""


def _guarded(problems: list[str], table: str, check: Callable[[], Any]) -> Any:
    """Run one table's check; a row it cannot even read is that table's problem, not a crash."""
    try:
        return check()
    except (ValueError, TypeError, KeyError, LedgerCorrupt) as error:
        problems.append(f"{table}: unreadable ({error!r}); edited?")
        return None


def verify(connection: Connection, settings: AuditSettings) -> VerifyReport:
    """Audit the ledger seen through ``connection`` (one consistent snapshot)."""
    config = connection.execute(select(LedgerConfig.chains, LedgerConfig.keyed_from)).first()
    chains, keyed_from = (config.chains, config.keyed_from) if config else (1, None)
    heads = {row.id: (row.seq, row.hash) for row in connection.execute(select(ChainHead))}
    problems: list[str] = []
    marks = _marks(connection, settings, problems)
    problems += [
        f"entry {p.seq}: {p.problem}"
        for p in history.chain_problems(connection, chains, settings.key, keyed_from, marks)
    ]
    replay = _Replay(settings)
    entries = 0
    for entry, keys in _history_with_keys(connection):
        entries += 1
        replay.apply(entry, keys)
    problems += replay.problems
    _guarded(problems, "dp_ledger_config", lambda: _check_config(connection, replay, problems))
    _guarded(problems, "dp_policies", lambda: _check_policies(connection, replay, problems))
    _guarded(
        problems, "dp_reservations", lambda: _check_reservations(connection, settings, problems)
    )
    accounts = _guarded(
        problems, "dp_accounts", lambda: _check_accounts(connection, replay, problems)
    )
    _guarded(problems, "dp_windows", lambda: _check_windows(connection, replay, problems))
    return VerifyReport(
        entries=entries,
        accounts=accounts or 0,
        problems=problems,
        notes=replay.notes,
        heads=tuple(sorted((chain, seq, link) for chain, (seq, link) in heads.items())),
        keyed=settings.key.keyed,
        ledger=ledger_identity(connection),
    )
