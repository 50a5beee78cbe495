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
* each account's committed and pending spend, counts, re-scope mark, time and size;
* each window's row: canonical for its calendar, first charged when the history says,
  sealed exactly when a reset sealed it;
* the spend classes (``classes``): a charge's entry records, per window, the cohort it
  charges and how it refined the window's classes. The replay applies each refinement
  before the entry's own effect: a split's child is a copy of its parent (committed,
  lifetime and pending spend, open reservations, releases, re-scope mark, re-pricing)
  holding the moved subjects, and each of the parent's open reservations holds the child
  as one more key (its later key rows: exactly those); a new account starts from zero.
  The entry's keys must be the accounts of its cohorts, and each cohort's accounts its
  listing as the replay makes it (kept + children + new when refined; a known cohort's
  listing, which every later split of a listed account extended by its child), holding
  exactly the cohort's subjects;
* each cohort's digest and size with its members (streamed in code-point order, as the
  digest is made), and every cohort the history names is stored, of the size it names;
* ``dp_cohort_accounts`` with the replayed listings of the live windows, and
  ``dp_charge_cohorts`` with the cohorts each charge entry names;
* ``dp_members``, from counts the server makes (work proportional to the listings, not
  to the subjects): every account of a live window lies inside each cohort listed with it
  and outside every other cohort listed in the window, a legacy account (a class of one
  charged before classes) holds only its own subject, and each account has as many
  members as its size. A class that refers to its cohort (``memberships``) refers to the
  one the replay made it of, has no ``dp_members`` row, and is counted against the
  window's other listed cohorts over its cohort's members. A reset moves the window's
  accounts to ``dp_sealed_accounts``, each proven like a live one and sealed when the
  reset sealed it, and keeps its members and listings, proven as before (a reset of an
  earlier version dropped all three; its cohorts stay);

and proves the cap: no key's lifetime spend in a window (across resets, re-scopes and
corrections) plus what was in flight ever passed the cap in force when a reservation was
granted, and nothing was charged to a sealed window or a re-scoped key.

A reservation's lease (``lease_expires_at``) is no fact of the history and is not checked:
renewals write no entry, and the lease only decides when an open reservation is charged
(the reap entry that charges it is a fact, checked like a commit), never whether.

Memory is bounded by the number of accounts (and the listings of the live windows),
never by the length of the history or the number of subjects: every table is streamed,
the history together with each entry's reservation keys in one pass, the members one
subject at a time, and the cohorts the history names are checked in batches.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import operator
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
from sqlalchemy import Connection, and_, func, select, tuple_
from sqlalchemy.dialects.postgresql import aggregate_order_by

from dp_budget_provider.accounting import Conversion, Mechanism, rdp_to_epsilon
from dp_budget_provider.ledger.accounts import classes
from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.accounts.spend import Pending, Spend
from dp_budget_provider.ledger.audit import authority
from dp_budget_provider.ledger.audit.authority import AdminPublicKey
from dp_budget_provider.ledger.audit.checkpoints import Checkpoint
from dp_budget_provider.ledger.errors import LedgerCorrupt
from dp_budget_provider.ledger.records import VerifyReport
from dp_budget_provider.ledger.storage import history
from dp_budget_provider.ledger.storage.schema import (
    Account,
    ChainHead,
    ChargeCohort,
    Cohort,
    CohortAccount,
    CohortMember,
    HistoryEntry,
    LedgerConfig,
    Member,
    PolicyRow,
    Reservation,
    ReservationKey,
    SealedAccount,
    Window,
)
from dp_budget_provider.ledger.windows.calendar import WindowCalendar
from dp_budget_provider.ledger.windows.policy import ANY, DEFAULT_GRACE, Policy
from dp_budget_provider.ledger.windows.policy_store import (
    policy_lookup,
    policy_of_scope,
    set_records,
)

_BATCH = 5000
_MEMBER_BATCH = 50_000  # cohort members: one short text each
# Cohorts PostgreSQL hashes itself: those whose members' text (as stored, separators
# included) stays below its 1 GB limit on one text value, with a margin.
_SERVER_DIGEST_BYTES = 2**30 - 2**20
_ENTRY_BATCH = 100  # history entries: a charge's payload grows with its classes
# Cohorts the replay names before it checks them against dp_cohorts, and per query.
_NAMED_BATCH = 10_000
_NAMES_PER_QUERY = 500
# A granted reservation is a breach when the replayed total passes its cap by more than
# floating-point reassociation could explain (the gate itself compares exactly).
_CAP_SLACK = 1e-9
_STATES = {"commit": "committed", "reap": "reaped", "release": "released"}
_NOT_CARRIED = (
    "its key rows past those it reserved are not the new parts of its accounts that split "
    "while it was open"
)
_CHARGES = ("reserve", "correction", "rescope")
# Actions whose payload names no reservation and no key, and that change no account.
_KEYLESS = ("create", "policy", "adopt-key", "admin-key", "quarantine", "unquarantine")
# Mechanisms whose curves an earlier version evaluated below (or, at a few orders, above)
# the sound curve this version computes: the subsampled Gaussian's truncated fractional
# series, the pure-DP and Laplace curves' cancellation at small eps0. A recorded cost of
# these kinds that differs from today's price is an earlier version's pricing, not an
# edit: verify notes it and proves the cap with the larger of the two at every order.
_REPRICED = frozenset({"poisson_subsampled_gaussian", "pure_dp", "laplace"})


def _account(scope: tuple[str, str, str], label: str) -> LedgerKey:
    """The key of the account ``label`` of a (tenant, query type, window)."""
    tenant, query_type, window = scope
    return LedgerKey.from_canonical(tenant, label, query_type, window)


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
    """One key's account as the history makes it (a class of ``size`` subjects)."""

    live: Spend = field(default_factory=Spend)  # the live account's committed spend
    lifetime: Spend = field(default_factory=Spend)  # everything ever charged to the key
    pending: Pending = field(default_factory=Pending)
    open: int = 0
    releases: int = 0
    updated_at: str = ""
    rescoped_to: str | None = None
    dropped: bool = False  # its window was reset: the account is gone, the key sealed
    kept: bool = False  # ... and its final spend moved to dp_sealed_accounts (revision 0011)
    # What re-priced entries (committed or in flight) cost beyond what they recorded.
    repriced: np.ndarray | None = None
    size: int = 1  # how many subjects the class holds (a legacy key: itself alone)
    of_class: bool = False  # made by a refinement (else a legacy key, charged directly)
    # The digest of the cohort whose members its members are (dp_accounts.cohort_id), while
    # they are: from the refinement that made it of a cohort new to the window, until a split.
    refers: str | None = None

    @property
    def required(self) -> bool:
        """Whether its account must have a row (and its members theirs): it holds spend or
        reservations, or is a class. A legacy key that holds nothing may have none (a reset
        before seals restarted it from zero and dropped its row)."""
        return bool(self.live.rho or self.live.residual is not None or self.open or self.of_class)


@dataclass(slots=True)
class _Open:
    """An open reservation, as its reserve entry made it."""

    cost: Spend
    cost_text: str
    count: int
    digest: str
    repriced: np.ndarray | None = None  # today's price beyond the recorded cost
    # Its key rows past those it reserved, and the new parts of its accounts that split
    # while it was open, which the history carried to it: the two must be the same.
    beyond: list[LedgerKey] = field(default_factory=list)
    carried: list[LedgerKey] = field(default_factory=list)


@dataclass(slots=True)
class _Scope:
    """One (tenant, query type, window) as the history made it."""

    first_at: str
    sealed_at: str | None = None
    kept: bool = False  # sealed by a reset that kept its final spend, members and listings
    # dp_cohort_accounts as the replay makes it: cohort digest -> the labels partitioning
    # it here, and the reverse (label -> the cohorts listing it), which a split follows.
    listings: dict[str, set[str]] = field(default_factory=dict)
    listed_in: dict[str, set[str]] = field(default_factory=dict)

    def record(self, digest: str, labels: set[str]) -> None:
        """A cohort refined here is listed with its accounts."""
        self.listings[digest] = labels
        for label in labels:
            self.listed_in.setdefault(label, set()).add(digest)

    def split(self, parent: str, child: str) -> None:
        """Every cohort listing ``parent`` lists its new part ``child`` too."""
        digests = self.listed_in.get(parent, set())
        for digest in digests:
            self.listings[digest].add(child)
        self.listed_in[child] = set(digests)

    def drop_classes(self) -> None:
        """A reset: the scope's listings and members are gone (its cohorts stay)."""
        self.listings, self.listed_in = {}, {}


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
        # The administrator's key as the history records it, the ledger's identity that
        # its signatures name, how many quarantines there were, and the signature that
        # lifted the last one (see ``authority``).
        self.admin: AdminPublicKey | None = None
        self.identity = ""
        self.quarantines = 0
        self.clearance: str | None = None
        # Cohorts named since the last batch was checked against dp_cohorts: (tenant,
        # digest) -> the size named (see _check_named).
        self.cohorts: dict[tuple[str, str], int] = {}
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

    def _epsilon_beyond(self, spend: Spend, cap: float) -> float | None:
        """The epsilon the ledger reports for ``spend`` when it passes ``cap`` (with the
        slack of rounding), None when it does not. The RDP conversion alone bounds that
        epsilon from above (the exact Gaussian bound is only ever lower), so it settles
        the spends well under their cap without the exact search; the rest are converted
        exactly, once per distinct spend."""
        s = self.settings
        limit = cap * (1 + _CAP_SLACK)
        rough, _ = rdp_to_epsilon(s.orders, spend.curve(s.orders), s.delta, s.conversion)
        if rough <= limit:
            return None
        signature = spend.signature
        found = self._bounds.get(signature)
        if found is None:
            if len(self._bounds) > 100_000:
                self._bounds.clear()
            found = self._bounds[signature] = spend.epsilon(s.orders, s.delta, s.conversion).epsilon
        return found if found > limit else None

    def _live(self, key: LedgerKey) -> _KeyState | None:
        state = self.keys.get(key)
        return None if state is None or state.dropped else state

    def _scope_of(self, entry: Any, tenant: str, query_type: str, window: str) -> _Scope:
        """The scope ``entry`` charges, recorded at its first charge: a canonical window of
        the calendar in force then."""
        scope = self.scopes.get((tenant, query_type, window))
        if scope is None:
            scope = self.scopes[(tenant, query_type, window)] = _Scope(entry.at)
            if self.policies:
                calendar = policy_of_scope(self.policies, tenant, query_type).calendar
                if not calendar.is_canonical(window):
                    self._problem(
                        entry,
                        f"window {window} of ({tenant}, {query_type}) is not one of its "
                        f"{calendar.kind} calendar",
                    )
        return scope

    def _charged(self, entry: Any, keys: list[LedgerKey]) -> None:
        """Check that ``keys`` could be charged by ``entry``: canonical windows of the
        calendar in force, not sealed, not re-scoped. Records first charges."""
        for key in keys:
            known = self._scope_of(entry, key.tenant, key.query_type, key.window)
            if known.sealed_at is not None:
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
        if history.keys_digest(keys[: len(keys) - len(held.beyond)]) != held.digest:
            self._problem(entry, "its keys differ from its reservation's")
        if held.beyond != held.carried:
            self._problem(entry, _NOT_CARRIED)
        for key in keys:
            state = self._state(key)
            state.open -= 1
            state.pending = state.pending.remove(held.cost) if state.open > 0 else Pending()
        return held

    # ------------------------------------------------------------------ classes

    def _refine(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        """Apply the refinements of the entry's cohorts (before its own effect): its keys
        must be the accounts of its cohorts. An entry written before classes has none: it
        charges its keys (legacy keys, each a class of one) as they are."""
        cohorts = payload.get("cohorts")
        if cohorts is None:
            return
        accounts: set[LedgerKey] = set()
        for cohort in cohorts:
            accounts.update(self._refine_cohort(entry, cohort))
        if sorted(accounts) != sorted(keys):
            self._problem(entry, "its keys are not the accounts of its cohorts")

    def _refine_cohort(self, entry: Any, cohort: dict[str, Any]) -> list[LedgerKey]:
        """One cohort of an entry, in one scope: its refinement applied (or, known, its
        listing checked); the keys of the accounts the entry says it charges for it."""
        tenant, query_type, window = cohort["tenant"], cohort["query_type"], cohort["window"]
        parts, digest, size = (tenant, query_type, window), cohort["cohort"], int(cohort["size"])
        where = f"cohort {digest} in window {window} of ({tenant}, {query_type})"
        named = self.cohorts.setdefault((tenant, digest), size)
        if named != size:  # (across batches, each is checked against the stored size)
            self._problem(entry, f"{where}: of {size} subjects; an earlier entry said {named}")
        scope = self._scope_of(entry, tenant, query_type, window)
        refined = cohort["refined"]
        if refined is None:
            listing = scope.listings.get(digest)
            if listing is None:
                self._problem(entry, f"{where}: charged as known, but the history never listed it")
                listing = set()
        else:
            if digest in scope.listings:
                self._problem(entry, f"{where}: refined again, although it is listed")
            listing = self._apply_refinement(entry, scope, parts, digest, refined, where)
        labels = cohort["accounts"]
        if labels != sorted(listing):
            self._problem(
                entry, f"{where}: charges {labels}, but the history lists {sorted(listing)}"
            )
        covered = 0
        for label in listing:
            state = self._live(_account(parts, label))
            covered += state.size if state is not None else 0
        if covered != size:
            self._problem(entry, f"{where}: its accounts hold {covered} subjects, not its {size}")
        return [_account(parts, label) for label in labels]

    def _apply_refinement(
        self,
        entry: Any,
        scope: _Scope,
        parts: tuple[str, str, str],
        digest: str,
        refined: dict[str, Any],
        where: str,
    ) -> set[str]:
        """A cohort refined in a scope: kept accounts stay, split parents give the covered
        part to a child (a copy of their spend, pending spend included, whose open
        reservations hold the child too), the subjects with no account get a new one.
        Returns the cohort's listing (kept + children + new), which is recorded."""

        def made(label: str, state: _KeyState) -> None:
            if self._live(_account(parts, label)) is not None:
                self._problem(entry, f"{where}: makes account {label}, which exists already")
            self.keys[_account(parts, label)] = state

        kept = set(refined["kept"])
        for label in sorted(kept):
            if self._live(_account(parts, label)) is None:
                self._problem(entry, f"{where}: keeps {label}, which is no account of the window")
        children: list[str] = []
        for parent, child, moved, *rest in refined["split"]:
            source = self._live(_account(parts, parent))
            if source is None:
                self._problem(entry, f"{where}: splits {parent}, which is no account of the window")
                continue
            self._carry(
                entry, where, source, parent, _account(parts, child), rest[0] if rest else []
            )
            if not 0 < int(moved) < source.size:
                self._problem(
                    entry, f"{where}: moves {moved} of the {source.size} subjects of {parent}"
                )
            made(
                child,
                _KeyState(
                    live=source.live,
                    lifetime=source.lifetime,
                    pending=source.pending,
                    open=source.open,
                    releases=source.releases,
                    updated_at=entry.at,
                    rescoped_to=source.rescoped_to,
                    repriced=source.repriced,
                    size=int(moved),
                    of_class=True,
                ),
            )
            source.size -= int(moved)
            source.refers = None  # the writer listed its members before it split it
            scope.split(parent, child)
            children.append(child)
        new = None
        if refined["new"] is not None:
            new, count, *members = refined["new"]
            count = int(count)
            if count < 1:
                self._problem(entry, f"{where}: makes {new} for {count} subjects")
            refers = None
            if members == ["cohort"]:
                # The class of a cohort that covers none of the window's classes: its
                # members are the cohort's (the accounts' size check below: all of them).
                refers = digest
                if kept or children:
                    self._problem(entry, f"{where}: makes {new} of the cohort, which it splits")
            elif members:
                self._problem(entry, f"{where}: makes {new} with members {members!r}")
            made(new, _KeyState(updated_at=entry.at, size=count, of_class=True, refers=refers))
        listing = {*kept, *children, *([new] if new is not None else [])}
        scope.record(digest, listing)
        return listing

    def _carry(
        self,
        entry: Any,
        where: str,
        source: _KeyState,
        parent: str,
        child: LedgerKey,
        carried: list[str],
    ) -> None:
        """A split parent's open reservations (ids) hold its new part too, one more key
        each: every one of them, and only those."""
        if len(set(carried)) != len(carried) or len(carried) != source.open:
            self._problem(
                entry,
                f"{where}: splits {parent}, held by {source.open} open reservations, but "
                f"carries {len(carried)} of them to {child.subject}",
            )
        for reservation_id in carried:
            held = self.open.get(reservation_id)
            if held is None:
                self._problem(entry, f"{where}: carries reservation {reservation_id}, not open")
            else:
                held.carried.append(child)

    def finish(self) -> None:
        """After the last entry: what only the whole history decides."""
        for reservation_id, held in sorted(self.open.items()):
            if held.beyond != held.carried:
                self.problems.append(f"reservation {reservation_id}: {_NOT_CARRIED}")

    def sizes(self) -> dict[tuple[str, str, str], dict[str, _KeyState]]:
        """Each scope's accounts whose members are stored (live, or sealed and kept), by
        label."""
        found: dict[tuple[str, str, str], dict[str, _KeyState]] = {}
        for key, state in self.keys.items():
            if not state.dropped or state.kept:
                found.setdefault((key.tenant, key.query_type, key.window), {})[key.subject] = state
        return found

    # ------------------------------------------------------------------ entries

    def apply(self, entry: Any, keys: list[LedgerKey], links: list[tuple[str, ...]]) -> None:
        """Apply one entry (with its reservation's keys, in order, and the cohorts
        ``dp_charge_cohorts`` links it to: (tenant, digest, query type, window))."""
        try:
            payload = json.loads(entry.payload)
            handler = getattr(self, "_on_" + entry.action.replace("-", "_"), None)
            if handler is None:
                self._problem(entry, "an action the ledger never writes")
                return
            handler(entry, payload, keys)
            covered = [
                (c["tenant"], c["cohort"], c["query_type"], c["window"])
                for c in payload.get("cohorts") or []
            ]
            if sorted(links) != sorted(covered):
                self._problem(entry, "its rows in dp_charge_cohorts are not the cohorts it covered")
        except (ValueError, KeyError, TypeError, AttributeError, LedgerCorrupt) as error:
            self._problem(entry, f"unreadable payload ({error!r}); edited?")

    def _on_create(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        if self.create is not None:
            self._problem(entry, "a second creation entry")
            return
        self.create = (entry, payload)
        self.identity = entry.hash
        if payload.get("admin_key") is not None:
            self.admin = AdminPublicKey(payload["admin_key"])

    def _on_admin_key(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        if self.admin is not None:
            self._problem(entry, "a second administrator key (a ledger keeps its first)")
            return
        self.admin = AdminPublicKey(payload["admin_key"])

    def _authorised(self, entry: Any, act: str, fields: dict[str, Any], signature: Any) -> None:
        """An administrator's act must carry the administrator's signature, once the
        ledger has an administrator."""
        if self.admin is not None and not self.admin.signed(
            authority.message(self.identity, act, fields), signature
        ):
            self._problem(
                entry,
                f"not signed by the ledger's administrator (key {self.admin.key_id}): written "
                "without the administrator's authority (by SQL, or by code without the key)",
            )

    def _on_adopt_key(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        if self.adopted is not None:
            self._problem(entry, "a second key adoption")
        self._authorised(
            entry,
            "adopt-key",
            {"chain_key_id": payload["chain_key_id"]},
            payload.get("signature"),
        )
        self.adopted = (entry.seq, payload["chain_key_id"])

    def _on_policy(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        policy = _policy_of_payload(payload)
        record = policy.as_record()
        self._authorised(entry, "policy", record, payload.get("signature"))
        self.policies[policy.scope] = policy
        self.policy_entries[policy.scope] = (
            {**record, "signature": payload.get("signature")},
            entry.at,
        )

    def _on_quarantine(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        self.quarantines += 1
        if payload.get("epoch", self.quarantines) != self.quarantines:
            self._problem(entry, f"quarantine #{payload['epoch']} is the {self.quarantines}th")
        self.quarantine = (entry.at, payload["reason"])
        self.clearance = None

    def _on_unquarantine(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        if self.quarantine is None:
            self._problem(entry, "clears a quarantine that was not in force")
        if payload.get("epoch", self.quarantines) != self.quarantines:
            self._problem(entry, f"clears quarantine #{payload['epoch']}, not the last")
        self._authorised(
            entry, "clear-quarantine", {"epoch": self.quarantines}, payload.get("signature")
        )
        self.quarantine = None
        self.clearance = payload.get("signature")

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
        # Rows past its own are the new parts of accounts that split while it was open.
        keys, beyond = keys[: payload["key_count"]], keys[payload["key_count"] :]
        if history.keys_digest(keys) != digest or len(keys) != payload["key_count"]:
            self._problem(entry, "the reservation's key rows differ from its digest")
        self._refine(entry, payload, keys)
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
            epsilon = self._epsilon_beyond(total, cap)
            if epsilon is not None:
                self._problem(
                    entry,
                    f"{key}: granted although its lifetime spend with what was in flight "
                    f"reaches eps {epsilon:.6g}, above its cap {cap:.6g}",
                )
        self.open[entry.reservation_id] = _Open(
            cost, cost_text, int(payload["count"]), digest, repriced, beyond
        )

    def _on_commit(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        held = self._close(entry, keys)
        if held is None:
            return
        digest = history.keys_digest(sorted(keys))  # the commit names them in lock order
        if (payload.get("key_count", len(keys)), payload.get("keys_digest", digest)) != (
            len(keys),
            digest,
        ):
            self._problem(entry, "its key count and digest are not those of its keys")
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
        key = LedgerKey.from_row(entry)
        self._refine(entry, payload, [key])
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
        old, new = LedgerKey.from_canonical(**payload["from"]), LedgerKey.from_row(entry)
        self._refine(entry, payload, [old, new])
        carried = Spend.from_payload(payload["carried"], self.size)
        moved = self._state(old)
        if "cohorts" in payload:
            # The accounts of one subject alone (tenant and window stay), in either scope.
            alone = classes.cohort_digest([payload["subject"]])
            charged = sorted((c["query_type"], c["cohort"]) for c in payload["cohorts"])
            if (old.tenant, old.window) != (new.tenant, new.window) or charged != sorted(
                [(old.query_type, alone), (new.query_type, alone)]
            ):
                self._problem(entry, "re-scopes other accounts than its subject's own")
        elif (old.tenant, old.subject, old.window) != (new.tenant, new.subject, new.window):
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
        kept = payload.get("kept", False)
        if kept not in (False, True) or (kept and scopes is None):
            self._problem(entry, f"kept is {kept!r}, which no reset writes")
            kept = False
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
                    state.dropped, state.kept = True, kept
        for (tenant, query_type, label), scope in self.scopes.items():
            if label == window and (scopes is None or (tenant, query_type) in scopes):
                if kept:
                    scope.kept = True  # its listings and members stay, sealed
                else:
                    scope.drop_classes()
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


def _history(
    connection: Connection,
) -> Iterator[tuple[Any, list[LedgerKey], list[tuple[str, ...]]]]:
    """Every entry in order, streamed, with its reservation's keys in position order and
    the cohorts ``dp_charge_cohorts`` links it to ((tenant, digest, query type, window);
    a link to no stored cohort has an empty tenant and digest).

    The entries, their key rows and their links are streams merged by seq, so that an
    entry's payload is read once, not once per key row: a charge's payload lists the
    accounts and refinements of its cohorts, as many as its key rows. Entries come in
    smaller batches than other rows for the same reason.
    """
    keys = ReservationKey.__table__.alias("k")
    entries = connection.execution_options(yield_per=_ENTRY_BATCH).execute(
        select(HistoryEntry).order_by(HistoryEntry.seq)
    )
    keys_of = _by_seq(
        connection.execution_options(yield_per=_BATCH).execute(
            select(
                HistoryEntry.seq,
                keys.c.tenant.label("k_tenant"),
                keys.c.subject.label("k_subject"),
                keys.c.query_type.label("k_query_type"),
                keys.c.window.label("k_window"),
                keys.c.position.label("k_position"),
            )
            .join(keys, keys.c.reservation_id == HistoryEntry.reservation_id)
            .order_by(HistoryEntry.seq, keys.c.position)
        )
    )
    links_of = _by_seq(
        connection.execution_options(yield_per=_BATCH).execute(
            select(
                ChargeCohort.seq,
                func.coalesce(Cohort.tenant, ""),
                func.coalesce(Cohort.digest, ""),
                ChargeCohort.query_type,
                ChargeCohort.window,
            )
            .join(HistoryEntry, HistoryEntry.seq == ChargeCohort.seq)
            .outerjoin(Cohort, Cohort.id == ChargeCohort.cohort_id)
            .order_by(ChargeCohort.seq)
        )
    )
    for entry in entries:
        rows_of_entry = keys_of(entry.seq)
        listed = [_reservation_key(row) for row in rows_of_entry]
        if any(row.k_position != index for index, row in enumerate(rows_of_entry)):
            listed.insert(0, _MISNUMBERED)  # its reserved keys can no longer match their digest
        yield entry, listed, [tuple(row[1:]) for row in links_of(entry.seq)]


def _by_seq(rows: Iterable[Any]) -> Callable[[int], list[Any]]:
    """The rows of each entry, from ``rows`` ordered by seq (their first column, each
    an entry's): asked for every entry in order, it reads each row once."""
    groups = itertools.groupby(rows, key=operator.itemgetter(0))
    current = next(groups, None)

    def of(seq: int) -> list[Any]:
        nonlocal current
        if current is None or current[0] != seq:
            return []
        found = list(current[1])
        current = next(groups, None)
        return found

    return of


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
    admin = replay.admin.text if replay.admin is not None else None
    authority_columns = {
        "admin_key": admin,
        "quarantine_epoch": replay.quarantines,
        "clearance": replay.clearance,
    }
    for column, value in authority_columns.items():
        if getattr(row, column) != value:
            problems.append(
                f"dp_ledger_config.{column}: {getattr(row, column)!r} differs from the "
                f"history's {value!r} (written without the administrator's authority?)"
            )
    whole = {"policies": set_records(replay.policies.values())}
    signed = replay.admin is None or replay.admin.signed(
        authority.message(replay.identity, "policy-set", whole), row.policy_set
    )
    if not signed or (replay.admin is None and row.policy_set is not None):
        problems.append(
            "dp_ledger_config.policy_set: not the administrator's signature over the policies "
            "the history sets"
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
    """dp_accounts against the live accounts of the replay, and dp_sealed_accounts against
    the final spend of those a reset sealed and kept (then also sealed when it says)."""
    count = _check_store(connection, replay, problems, Account)
    _check_store(connection, replay, problems, SealedAccount)
    return count


def _check_store(connection: Connection, replay: _Replay, problems: list[str], table: Any) -> int:
    size = replay.size
    sealed = table is SealedAccount
    cohort_ids = _referred_ids(connection, replay)
    seen: set[LedgerKey] = set()
    count = 0
    for row in connection.execution_options(yield_per=_BATCH).execute(select(table)):
        count += 1
        key = LedgerKey.from_row(row)
        seen.add(key)
        state = replay.keys.get(key)
        if sealed and (state is None or not state.kept):
            problems.append(
                f"sealed account {key}: no reset of the history sealed it with its final spend"
            )
            continue
        if not sealed and (state is None or state.dropped):
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
            ("size", row.size == state.size),
            (
                "cohort_id (the cohort whose members are its members)",
                row.cohort_id == cohort_ids.get((key.tenant, state.refers)),
            ),
        ]
        if sealed:
            scope = replay.scopes.get((key.tenant, key.query_type, key.window))
            checks.append(("sealed_at", scope is not None and row.sealed_at == scope.sealed_at))
        wrong = [what for what, fine in checks if not fine]
        if wrong:
            name = (
                f"sealed account {key}" if sealed else f"account {_account_name(connection, key)}"
            )
            problems += [f"{name}: {what} differs from the history's" for what in wrong]
    for key, state in replay.keys.items():
        if key in seen or state.dropped != sealed or (sealed and not state.kept):
            continue
        if state.required:
            where = "sealed with its final spend" if sealed else "charged or held"
            problems.append(f"account {key}: {where} in the history but missing")
    return count


def _referred_ids(connection: Connection, replay: _Replay) -> dict[tuple[str, str | None], int]:
    """The ids of the cohorts the live accounts refer to, by (tenant, digest): what their
    ``cohort_id`` must be (a cohort's digest is proven from its members by
    :func:`_check_cohorts`, so the id names those members)."""
    named = sorted(
        {
            (key.tenant, state.refers)
            for key, state in replay.keys.items()
            if state.refers and (not state.dropped or state.kept)
        }
    )
    ids: dict[tuple[str, str | None], int] = {}
    for start in range(0, len(named), _NAMES_PER_QUERY):
        rows = connection.execute(
            select(Cohort.tenant, Cohort.digest, Cohort.id).where(
                tuple_(Cohort.tenant, Cohort.digest).in_(named[start : start + _NAMES_PER_QUERY])
            )
        )
        ids.update(((row.tenant, row.digest), row.id) for row in rows)
    return ids


def _account_name(connection: Connection, key: LedgerKey) -> str:
    """An account as a problem names it: a class by one of its subjects too."""
    example = classes.example_subject(connection, key)
    return str(key) if example == key else f"{key} (holding {example})"


def _code_point_order(connection: Connection, column: Any) -> Any:
    """``column`` ordered by code point, as Python sorts (and as cohort digests are made):
    SQLite's binary collation does; PostgreSQL's "C" collation does (UTF-8 bytes)."""
    return column.collate("C") if connection.dialect.name == "postgresql" else column


def _check_named(
    connection: Connection, named: dict[tuple[str, str], int], problems: list[str]
) -> None:
    """The cohorts the history named ((tenant, digest) -> size) are stored, of that size;
    the batch is emptied (the replay checks a batch whenever it is full: memory stays
    bounded however many cohorts the history names)."""
    stored: dict[tuple[str, str], int] = {}
    names = sorted(named)
    for start in range(0, len(names), _NAMES_PER_QUERY):
        chunk = names[start : start + _NAMES_PER_QUERY]
        rows = connection.execute(
            select(Cohort.tenant, Cohort.digest, Cohort.size).where(
                tuple_(Cohort.tenant, Cohort.digest).in_(chunk)
            )
        )
        stored.update(((row.tenant, row.digest), row.size) for row in rows)
    for (tenant, digest), size in sorted(named.items()):
        held = stored.get((tenant, digest))
        if held is None:
            problems.append(f"cohort {digest} of {tenant}: named by the history but not stored")
        elif held != size:
            problems.append(
                f"cohort {digest} of {tenant}: size {held}, but the history names {size}"
            )
    named.clear()


def _check_cohorts(connection: Connection, problems: list[str]) -> None:
    """Each cohort's digest and size against its members (:func:`_cohort_contents`); no
    member row names a cohort, nor a charge link an entry, that does not exist."""
    for cohort, digest, count in _cohort_contents(connection):
        name = f"cohort {cohort.digest} of {cohort.tenant}"
        if digest != cohort.digest:
            problems.append(f"{name}: its digest is not that of its {count} members")
        if cohort.size != count:
            problems.append(f"{name}: size {cohort.size}, but it has {count} members")
    orphans = connection.execute(
        select(CohortMember.cohort_id)
        .distinct()
        .where(~CohortMember.cohort_id.in_(select(Cohort.id)))
    ).scalars()
    problems += [f"cohort {cid}: member rows of a cohort that does not exist" for cid in orphans]
    unlinked = connection.execute(
        select(ChargeCohort.seq)
        .distinct()
        .where(~ChargeCohort.seq.in_(select(HistoryEntry.seq)))
        .order_by(ChargeCohort.seq)
    ).scalars()
    problems += [
        f"dp_charge_cohorts: rows of entry {seq}, which is not in the history" for seq in unlinked
    ]


def _cohort_contents(connection: Connection) -> Iterator[tuple[Any, str, int]]:
    """Each cohort (id, tenant, digest, size as stored) with the digest and the count of
    its member rows, in cohort order: sha256 of its subjects in code point order, one per
    line (what :func:`classes.cohort_digest` makes of the ids).

    PostgreSQL hashes a cohort itself (one text of its members: none crosses the wire)
    when that text, measured on the member rows (never the cohort's editable ``size``),
    fits :data:`_SERVER_DIGEST_BYTES`; larger cohorts, and every cohort on SQLite (which
    has no sha256), are streamed here in bounded batches.
    """
    cohort = select(Cohort.id, Cohort.tenant, Cohort.digest, Cohort.size)
    streamed = cohort.order_by(Cohort.id)
    if connection.dialect.name == "postgresql":
        members = Cohort.__table__.outerjoin(CohortMember, CohortMember.cohort_id == Cohort.id)
        # One pass over the members for the few cohorts too large for one text (each over
        # a gigabyte of ids); every other cohort is hashed by the server.
        oversized = (
            connection.execute(
                select(CohortMember.cohort_id)
                .group_by(CohortMember.cohort_id)
                .having(
                    func.sum(func.octet_length(CohortMember.subject) + 1) > _SERVER_DIGEST_BYTES
                )
            )
            .scalars()
            .all()
        )
        ordered = _code_point_order(connection, CohortMember.subject)
        joined = func.string_agg(CohortMember.subject, aggregate_order_by("\n", ordered))
        text = func.coalesce(joined, "")
        hashed = (
            cohort.add_columns(
                func.encode(func.sha256(func.convert_to(text, "UTF8")), "hex"),
                func.count(CohortMember.subject),
            )
            .select_from(members)
            .where(Cohort.id.not_in(oversized))
            .group_by(Cohort.id)
            .order_by(Cohort.id)
        )
        for row in connection.execution_options(yield_per=_BATCH).execute(hashed):
            yield row, row[4], row[5]
        streamed = streamed.where(Cohort.id.in_(oversized))
    for row in connection.execution_options(yield_per=_BATCH).execute(streamed):
        digest, count, separator = hashlib.sha256(), 0, ""
        for text, lines in _member_texts(connection, row.id):
            digest.update((separator + text).encode())
            count, separator = count + lines, "\n"
        yield row, digest.hexdigest(), count


# SQLite: one page of a cohort's members, after a subject, joined into one text by the
# database, with its line count and last subject (plain SQL run by the driver: a statement
# object built per page would cost more than the page, for many cohorts of one subject).
_SQLITE_PAGE = (
    "SELECT group_concat(member, char(10)), count(*), max(member) FROM (SELECT subject "
    "AS member FROM dp_cohort_members WHERE cohort_id = :cohort AND subject > :after "
    "ORDER BY subject LIMIT :lines) AS page"
)


def _member_texts(connection: Connection, cohort_id: int) -> Iterator[tuple[str, int]]:
    """A cohort's subjects in code point order, as texts of up to ``_MEMBER_BATCH`` lines
    and their line counts (bounded memory, no row object per member).

    SQLite joins them itself, a page of its members' index at a time (its binary
    collation is code point order), each page after the last subject of the one before:
    ``group_concat`` joins the rows of the ordered page in the order it reads them; were
    it ever not, the digest would differ and verify fail, never pass. PostgreSQL (a cohort
    too large to hash in one text) streams them in one sort, through a server-side
    cursor: its index is in the database's collation, so pages would each sort anew.
    """
    if connection.dialect.name == "postgresql":
        cursor = connection.connection.cursor(name=f"dp_verify_cohort_{int(cohort_id)}")
        try:
            cursor.execute(
                "SELECT subject FROM dp_cohort_members WHERE cohort_id = %s "
                'ORDER BY subject COLLATE "C"',
                (cohort_id,),
            )
            while rows := cursor.fetchmany(_MEMBER_BATCH):
                yield "\n".join(subject for (subject,) in rows), len(rows)
        finally:
            cursor.close()
        return
    after = ""  # below every subject (none is empty)
    while True:
        named = {"cohort": cohort_id, "after": after, "lines": _MEMBER_BATCH}
        text, lines, last = connection.exec_driver_sql(_SQLITE_PAGE, named).one()
        if not lines:
            return
        yield text, lines
        if lines < _MEMBER_BATCH:
            return
        after = last


def _check_cohort_accounts(connection: Connection, replay: _Replay, problems: list[str]) -> None:
    """dp_cohort_accounts against the replayed listings of the live scopes."""
    statement = (
        select(
            CohortAccount.cohort_id,
            CohortAccount.query_type,
            CohortAccount.window,
            CohortAccount.account,
            Cohort.tenant,
            Cohort.digest,
        )
        .outerjoin(Cohort, Cohort.id == CohortAccount.cohort_id)
        .order_by(CohortAccount.cohort_id, CohortAccount.query_type, CohortAccount.window)
    )
    seen: set[tuple[tuple[str, str, str], str]] = set()
    rows = connection.execution_options(yield_per=_BATCH).execute(statement)
    for (cohort_id, query_type, window), group in itertools.groupby(
        rows, key=lambda row: (row.cohort_id, row.query_type, row.window)
    ):
        listed = list(group)  # one cohort's accounts in one scope: bounded by the classes
        first = listed[0]
        if first.tenant is None:
            problems.append(f"dp_cohort_accounts: rows of cohort {cohort_id}, which does not exist")
            continue
        scope = (first.tenant, query_type, window)
        name = f"cohort {first.digest} in window {window} of ({first.tenant}, {query_type})"
        known = replay.scopes.get(scope)
        listing = None if known is None else known.listings.get(first.digest)
        if listing is None:
            problems.append(
                f"{name}: has accounts in dp_cohort_accounts, but none in the history (or its "
                "window was reset)"
            )
            continue
        seen.add((scope, first.digest))
        stored = {row.account for row in listed}
        for label in sorted(stored - listing):
            problems.append(f"{name}: dp_cohort_accounts lists {label}, the history does not")
        for label in sorted(listing - stored):
            problems.append(f"{name}: dp_cohort_accounts lacks its account {label}")
    for scope, known in replay.scopes.items():
        for digest in sorted(known.listings.keys()):
            if (scope, digest) not in seen:
                problems.append(
                    f"cohort {digest} in window {scope[2]} of ({scope[0]}, {scope[1]}): "
                    "its accounts are missing from dp_cohort_accounts"
                )


def _check_members(connection: Connection, replay: _Replay, problems: list[str]) -> None:
    """Every live scope's membership, proven from counts the server makes, in work
    proportional to the listings (not to the subjects).

    In the history's model every account of a scope is an atom of its cohorts: an account
    listed for a cohort lies inside it, any other account lies outside it (a refinement
    lists the parts it covers, and a later split lists the child wherever the parent is).
    So dp_members is right when (1) each account has as many members as the replay gives
    it subjects (:func:`_check_sizes`), (2) for each cohort listed in the scope, an
    account has either all its members in it (listed there) or none (not listed), and
    (3) a legacy account (a subject's own, from before classes) holds only its subject.
    (2) is one count per (account, cohort) pair; the cohorts come from
    dp_cohort_accounts, which :func:`_check_cohort_accounts` proves equal to the replay's
    listings. A class whose members are its cohort's has no dp_members row (1), and its
    pairs are counted over its cohort's members (:func:`_check_referring`): its
    reference is :func:`_check_accounts`'s, its cohort's members :func:`_check_cohorts`'.
    """
    members = Member.__table__
    cohort_members = CohortMember.__table__.alias("cm")
    listed = (
        select(
            CohortAccount.cohort_id,
            Cohort.tenant,
            CohortAccount.query_type,
            CohortAccount.window,
            Cohort.digest,
        )
        .join(Cohort, Cohort.id == CohortAccount.cohort_id)
        .distinct()
        .subquery("listed")
    )
    scope_columns = (members.c.tenant, members.c.query_type, members.c.window)
    # Both streams in code point order, the order the merge below compares in.
    scope_order = [_code_point_order(connection, column) for column in scope_columns]
    counted = (
        select(*scope_columns, members.c.account, func.count().label("n"))
        .group_by(*scope_columns, members.c.account)
        .order_by(*scope_order)
    )
    paired = (
        select(
            *scope_columns,
            members.c.account,
            listed.c.digest,
            func.count().label("n"),
        )
        .select_from(
            members.join(cohort_members, cohort_members.c.subject == members.c.subject).join(
                listed,
                and_(
                    listed.c.cohort_id == cohort_members.c.cohort_id,
                    listed.c.tenant == members.c.tenant,
                    listed.c.query_type == members.c.query_type,
                    listed.c.window == members.c.window,
                ),
            )
        )
        .group_by(*scope_columns, members.c.account, listed.c.digest)
        .order_by(*scope_order)
    )
    of_scope = operator.itemgetter(0, 1, 2)
    pairs = itertools.groupby(
        connection.execution_options(yield_per=_BATCH).execute(paired), key=of_scope
    )
    pending: tuple[classes.Scope, list[Any]] | None = next(
        ((scope, list(rows)) for scope, rows in pairs), None
    )
    sizes = replay.sizes()
    counts_of = itertools.groupby(
        connection.execution_options(yield_per=_BATCH).execute(counted), key=of_scope
    )
    for scope, rows in counts_of:
        counts = {row.account: row.n for row in rows}
        scope_pairs: list[Any] = []
        while pending is not None and pending[0] <= scope:
            if pending[0] == scope:
                scope_pairs = pending[1]
            pending = next(((s, list(r)) for s, r in pairs), None)
        tenant, query_type, window = scope
        known = replay.scopes.get(scope)
        expected = sizes.pop(scope, {})
        if known is None or (known.sealed_at is not None and not known.kept):
            problems.append(
                f"dp_members: members of window {window} of ({tenant}, {query_type}), which "
                "the history never charged or has reset"
            )
            continue
        _check_sizes(scope, counts, expected, known.listed_in, problems)
        _check_atoms(connection, scope, known, counts, scope_pairs, problems)
        problems += _check_referring(connection, scope, known, expected)
    for scope, expected in sizes.items():
        known = replay.scopes.get(scope)
        _check_sizes(scope, {}, expected, {} if known is None else known.listed_in, problems)
        if known is not None and (known.sealed_at is None or known.kept):
            problems += _check_referring(connection, scope, known, expected)
    _check_legacy_members(connection, problems)


def _check_atoms(
    connection: Connection,
    scope: classes.Scope,
    known: _Scope,
    counts: dict[str, int],
    pairs: list[Any],
    problems: list[str],
) -> None:
    """Each stored account of a scope against the cohorts listed there: all its members
    in those the history lists it in, none in the others (``pairs``: its members per
    cohort, as counted by the server)."""
    tenant, query_type, window = scope
    found = {(row.account, row.digest): row.n for row in pairs}
    for (account, digest), n in sorted(found.items()):
        if digest not in known.listed_in.get(account, ()):
            example = _example_member(connection, scope, account, digest, inside=True)
            others = f" (and {n - 1} more)" if n > 1 else ""
            problems.append(
                f"member {tenant}/{example}/{query_type}/{window}{others}: in account "
                f"{account}, and in cohort {digest}, but the history puts no subject of that "
                "account in that cohort"
            )
    for account, held in sorted(counts.items()):
        for digest in sorted(known.listed_in.get(account, ())):
            inside = found.get((account, digest), 0)
            if inside == held:
                continue
            example = _example_member(connection, scope, account, digest, inside=False)
            others = f" (and {held - inside - 1} more)" if held - inside > 1 else ""
            problems.append(
                f"member {tenant}/{example}/{query_type}/{window}{others}: in account "
                f"{account}, but not in cohort {digest}, where the history puts every "
                "subject of that account"
            )


def _example_member(
    connection: Connection,
    scope: classes.Scope,
    account: str,
    digest: str,
    *,
    inside: bool,
) -> str | None:
    """The least member of ``account`` inside (or outside) the scope's cohort ``digest``:
    what a problem names (only read when verify has found one)."""
    tenant, query_type, window = scope
    in_cohort = (
        select(CohortMember.subject)
        .join(Cohort, Cohort.id == CohortMember.cohort_id)
        .where(
            Cohort.tenant == tenant,
            Cohort.digest == digest,
            CohortMember.subject == Member.subject,
        )
        .exists()
    )
    return connection.execute(
        select(func.min(Member.subject)).where(
            Member.tenant == tenant,
            Member.query_type == query_type,
            Member.window == window,
            Member.account == account,
            in_cohort if inside else ~in_cohort,
        )
    ).scalar()


def _check_legacy_members(connection: Connection, problems: list[str]) -> None:
    """A legacy account (a subject's own, named by it) never splits: it holds at most its
    own subject. Any other member named in it is a problem (the first hundred listed)."""
    prefix = classes.LABEL_PREFIX
    strays = connection.execute(
        select(Member.tenant, Member.subject, Member.query_type, Member.window, Member.account)
        .where(
            func.substr(Member.account, 1, len(prefix)) != prefix,
            Member.account != Member.subject,
        )
        .order_by(Member.tenant, Member.query_type, Member.window, Member.subject)
        .limit(100)
    )
    problems += [
        f"member {row.tenant}/{row.subject}/{row.query_type}/{row.window}: in account "
        f"{row.account}, the legacy account of another subject"
        for row in strays
    ]


def _check_sizes(
    scope: tuple[str, str, str],
    counts: dict[str, int],
    expected: dict[str, _KeyState],
    listed: Container[str],
    problems: list[str],
) -> None:
    """Each account of a scope has as many dp_members rows as the replay gives it subjects,
    none when its members are its cohort's (they are counted with the cohort).

    Only a legacy account that holds nothing and no cohort lists may have no members (a
    reset before seals dropped its row). A listed one must keep its member: the cohort
    checks see an account only through its members, so an empty legacy account would
    otherwise hide its subject moved into a class sharing its cohorts."""
    tenant, query_type, window = scope
    for label in sorted(counts.keys() | expected.keys()):
        state = expected.get(label)
        held = counts.get(label, 0)
        size = 0 if state is None or state.refers else state.size
        if held != size and (held or state is None or state.required or label in listed):
            refers = state.refers if state is not None else None
            referring = f" (its members are cohort {refers}'s)" if refers else ""
            problems.append(
                f"account {tenant}/{label}/{query_type}/{window}: {held} members in "
                f"dp_members, but the history gives it {size} subjects there{referring}"
            )


def _check_referring(
    connection: Connection, scope: classes.Scope, known: _Scope, expected: dict[str, _KeyState]
) -> list[str]:
    """The accounts of a scope whose members are their cohort's, against the other
    cohorts listed there: all of its members in those the history lists it in, none in
    the others. One count per (account, other cohort) pair, made by the server over the
    members of the accounts' cohorts, once per scope; nothing to count in a scope that
    lists one cohort (repeated releases over one population)."""
    referring = {label: state for label, state in expected.items() if state.refers}
    if not referring or len(known.listings) < 2:
        return []
    tenant, query_type, window = scope
    mine, theirs = CohortMember.__table__.alias("mine"), CohortMember.__table__.alias("theirs")
    listed_here = select(CohortAccount.cohort_id).where(
        CohortAccount.query_type == query_type, CohortAccount.window == window
    )
    digests = dict(
        connection.execute(
            select(Cohort.id, Cohort.digest).where(
                Cohort.tenant == tenant, Cohort.id.in_(listed_here)
            )
        ).all()
    )
    # From the accounts to their members, to the other cohorts holding each (by subject):
    # ``+ 0`` keeps a planner from reaching those cohorts through the listing instead (each
    # listed cohort probed for each member: quadratic in the window's small classes).
    counted: dict[tuple[str, str], int] = {}
    accounts = SealedAccount if known.kept else Account
    for label, cohort_id, n in connection.execute(
        select(accounts.subject, theirs.c.cohort_id, func.count())
        .select_from(accounts)
        .join(mine, mine.c.cohort_id == accounts.cohort_id)
        .join(
            theirs,
            and_(theirs.c.subject == mine.c.subject, theirs.c.cohort_id != mine.c.cohort_id),
        )
        .where(
            accounts.tenant == tenant,
            accounts.query_type == query_type,
            accounts.window == window,
            (theirs.c.cohort_id + 0).in_(listed_here),
        )
        .group_by(accounts.subject, theirs.c.cohort_id)
    ):
        if cohort_id in digests:  # (a cohort of another tenant shares the window's name)
            counted[(label, digests[cohort_id])] = n
    problems: list[str] = []

    def wrong(label: str, digest: str, inside: int, listed: bool) -> None:
        problems.append(
            f"account {tenant}/{label}/{query_type}/{window}: {inside} of its "
            f"{referring[label].size} members (cohort {referring[label].refers}'s) are in "
            f"cohort {digest}, where the history puts {'all' if listed else 'none'} of them"
        )

    # Pairs the server found, then listed pairs it did not: work in the pairs, not in
    # accounts x cohorts. (An account the replay has no reference for is named by the
    # accounts' check, a cohort listed nowhere here by the listings'.)
    for (label, digest), inside in sorted(counted.items()):
        state = referring.get(label)
        if state is not None and digest in known.listings and digest != state.refers:
            listed = digest in known.listed_in.get(label, ())
            if inside != (state.size if listed else 0):
                wrong(label, digest, inside, listed)
    for label, state in sorted(referring.items()):
        for digest in sorted(known.listed_in.get(label, set()) - {state.refers}):
            if (label, digest) not in counted:
                wrong(label, digest, 0, True)
    return problems


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
        if checkpoint.ledger != history.ledger_identity(connection):
            problems.append(f"the checkpoint of {checkpoint.at} is of another ledger")
        marks.update(checkpoint.marks())
    return marks


def _guarded(problems: list[str], table: str, check: Callable[[], Any]) -> Any:
    """Run one table's check; a row it cannot even read is that table's problem, not a crash."""
    try:
        return check()
    except (ValueError, TypeError, KeyError, LedgerCorrupt) as error:
        problems.append(f"{table}: unreadable ({error!r}); edited?")
        return None


def verify(connection: Connection, settings: AuditSettings) -> VerifyReport:
    """Audit the ledger seen through ``connection`` (one consistent snapshot)."""
    if connection.dialect.name == "postgresql":
        # verify reads every row of every cursor it opens: plan them for the whole result,
        # not for the first tenth (PostgreSQL's default for cursors, which picks nested
        # loops that rescan the cohort members once per member).
        connection.exec_driver_sql("SET LOCAL cursor_tuple_fraction = 1.0")
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

    def check_named() -> None:
        _guarded(problems, "dp_cohorts", lambda: _check_named(connection, replay.cohorts, problems))

    entries = 0
    for entry, keys, links in _history(connection):
        entries += 1
        replay.apply(entry, keys, links)
        if len(replay.cohorts) >= _NAMED_BATCH:
            check_named()
    check_named()
    replay.finish()
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
    _guarded(problems, "dp_cohorts", lambda: _check_cohorts(connection, problems))
    _guarded(
        problems,
        "dp_cohort_accounts",
        lambda: _check_cohort_accounts(connection, replay, problems),
    )
    _guarded(problems, "dp_members", lambda: _check_members(connection, replay, problems))
    return VerifyReport(
        entries=entries,
        accounts=accounts or 0,
        problems=problems,
        notes=replay.notes,
        heads=tuple(sorted((chain, seq, link) for chain, (seq, link) in heads.items())),
        keyed=settings.key.keyed,
        ledger=history.ledger_identity(connection),
    )
