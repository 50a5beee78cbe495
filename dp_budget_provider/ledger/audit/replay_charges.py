"""The history's charges, replayed: reserve, commit (and reap), release, correction,
re-scope and reset, each applied to the spend of its accounts and the state of its
reservation after the refinements of the window's classes it records (``classes``); and
every breach on the way: a grant that took a key past its cap, a charge to a sealed window
or a re-scoped key, a cost that is not what its mechanism costs, keys that are not the
accounts of the charge's cohorts.

What they make is what the accounts, reservations, windows and class tables must hold
(``table_checks``, ``class_checks``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dp_budget_provider.accounting import Mechanism, rdp_to_epsilon
from dp_budget_provider.ledger.accounts import classes
from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.accounts.pricing import Pricing
from dp_budget_provider.ledger.accounts.spend import Pending, Spend
from dp_budget_provider.ledger.audit.replay_acts import Configuration
from dp_budget_provider.ledger.audit.replay_listings import ListingStore
from dp_budget_provider.ledger.audit.replay_state import (
    AuditSettings,
    Findings,
    Handler,
    KeyState,
    OpenReservation,
    ScopeState,
)
from dp_budget_provider.ledger.storage import history
from dp_budget_provider.ledger.storage.entries import (
    ChargedCohort,
    CommitEntry,
    CorrectionEntry,
    ReapEntry,
    Refinement,
    RefiningEntry,
    ReleaseEntry,
    RescopeEntry,
    ReserveEntry,
    ResetEntry,
)
from dp_budget_provider.ledger.storage.payloads import Entry
from dp_budget_provider.ledger.windows import scopes
from dp_budget_provider.ledger.windows.policy import SCOPE_ACCOUNTS, Policy
from dp_budget_provider.ledger.windows.policy_store import policy_lookup, policy_of_scope
from dp_budget_provider.ledger.windows.shares import dag_of

# A granted reservation is a breach when the replayed total passes its cap by more than
# floating-point reassociation could explain (the gate itself compares exactly).
_CAP_SLACK = 1e-9
_NOT_CARRIED = (
    "its key rows past those it reserved are not the new parts of its accounts that split "
    "while it was open"
)
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


def _plus(curve: np.ndarray | None, extra: np.ndarray | None) -> np.ndarray | None:
    """Curves that may be absent (None: zero), added."""
    if extra is None:
        return curve
    return extra.copy() if curve is None else curve + extra


def _canonical_cost(cost: Spend, size: int) -> tuple[Spend, str]:
    """An entry's cost on the ledger's grid of ``size`` orders, and its canonical text
    (exact equality of costs)."""
    spend = cost.on_grid(size)
    return spend, history.canonical_json(spend.as_payload())


class Charges:
    """The accounts, open reservations and windows as the history's charges make them."""

    def __init__(
        self, settings: AuditSettings, configuration: Configuration, findings: Findings
    ) -> None:
        self.settings = settings
        self.size = settings.orders.size
        # Its policies, as the acts so far set them: what each charge is judged under.
        self.configuration = configuration
        self.findings = findings
        self.keys: dict[LedgerKey, KeyState] = {}
        self.open: dict[str, OpenReservation] = {}
        self.scopes: dict[tuple[str, str, str], ScopeState] = {}
        self.listings = ListingStore()  # closed by :meth:`close`
        self.legacy_resets: dict[str, str] = {}  # window -> first reset before seals existed
        # Cohorts named since the last batch was checked against dp_cohorts: (tenant,
        # digest) -> the size named (see ``class_checks.check_named``).
        self.cohorts: dict[tuple[str, str], int] = {}
        # The ledger's own pricing: verify counts a grant as the cap check counted it.
        self._pricing = Pricing(settings.orders, settings.delta, settings.conversion)
        self._costs: dict[tuple[str, int], Spend] = {}
        self.corrected_totals = scopes.CorrectedTotals()

    def handlers(self) -> dict[type[Entry], Handler]:
        """The charges, by the kind of their entries (a reap charges as a commit)."""
        return {
            ReserveEntry: self._on_reserve,
            CommitEntry: self._on_commit,
            ReapEntry: self._on_commit,
            ReleaseEntry: self._on_release,
            CorrectionEntry: self._on_correction,
            RescopeEntry: self._on_rescope,
            ResetEntry: self._on_reset,
        }

    # ------------------------------------------------------------------ helpers

    def _state(self, key: LedgerKey) -> KeyState:
        state = self.keys.get(key)
        if state is None:
            state = self.keys[key] = KeyState()
        return state

    def _epsilon_beyond(self, spend: Spend, policy: Policy) -> float | None:
        """What the ledger compared with ``policy``'s cap for ``spend`` when it passes the
        cap (with the slack of rounding), None when it does not.

        The statistic is the cap check's own (:meth:`Pricing.checked_epsilon`): at the
        policy's filter order, or for a policy on the reported rule the epsilon the ledger
        reports. For the latter the RDP conversion alone bounds it from above (the exact
        Gaussian bound is only ever lower), so it settles the spends well under their cap
        without the exact search."""
        s = self.settings
        limit = policy.cap_epsilon * (1 + _CAP_SLACK)
        if policy.filter_order is None:
            rough, _ = rdp_to_epsilon(s.orders, spend.curve(s.orders), s.delta, s.conversion)
            if rough <= limit:
                return None
        checked = self._pricing.checked_epsilon(spend, policy)
        return checked if checked > limit else None

    def _live(self, key: LedgerKey) -> KeyState | None:
        state = self.keys.get(key)
        return None if state is None or state.dropped else state

    def _scope_of(self, entry: Any, tenant: str, query_type: str, window: str) -> ScopeState:
        """The scope ``entry`` charges, recorded at its first charge: a canonical window of
        the calendar in force then."""
        scope = self.scopes.get((tenant, query_type, window))
        if scope is None:
            scope = self.scopes[(tenant, query_type, window)] = ScopeState(
                entry.at, self.listings.scope()
            )
            if self.configuration.policies:
                calendar = policy_of_scope(self.configuration.policies, tenant, query_type).calendar
                if not calendar.is_canonical(window):
                    self.findings.problem(
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
                self.findings.problem(
                    entry, f"{key}: charged to a window sealed at {known.sealed_at}"
                )
            state = self.keys.get(key)
            if state is not None and state.rescoped_to is not None:
                self.findings.problem(entry, f"{key}: charged after it was re-scoped")

    def _touch(self, keys: list[LedgerKey], at: str) -> None:
        for key in keys:
            self._state(key).updated_at = at

    def _close(self, entry: Any, keys: list[LedgerKey]) -> OpenReservation | None:
        """One reservation closes on ``keys``: its cost leaves their pending spend."""
        held = self.open.pop(entry.reservation_id or "", None)
        if held is None:
            self.findings.problem(entry, f"reservation {entry.reservation_id} is not open")
            return None
        if history.keys_digest(keys[: len(keys) - len(held.beyond)]) != held.digest:
            self.findings.problem(entry, "its keys differ from its reservation's")
        if held.beyond != held.carried:
            self.findings.problem(entry, _NOT_CARRIED)
        for key in keys:
            state = self._state(key)
            state.open -= 1
            state.pending = state.pending.remove(held.cost) if state.open > 0 else Pending()
        return held

    # ------------------------------------------------------------------ classes

    def _refine(self, entry: Any, charge: RefiningEntry, keys: list[LedgerKey]) -> None:
        """Apply the refinements of the entry's cohorts (before its own effect): its keys
        must be the accounts of its cohorts. An entry written before classes has none: it
        charges its keys (legacy keys, each a class of one) as they are."""
        cohorts = charge.cohorts
        if cohorts is None:
            return
        accounts: set[LedgerKey] = set()
        for cohort in cohorts:
            accounts.update(self._refine_cohort(entry, cohort))
        if sorted(accounts) != sorted(keys):
            self.findings.problem(entry, "its keys are not the accounts of its cohorts")

    def _refine_cohort(self, entry: Any, cohort: ChargedCohort) -> list[LedgerKey]:
        """One cohort of an entry, in one scope: its refinement applied (or, known, its
        listing checked); the keys of the accounts the entry says it charges for it."""
        tenant, query_type, window = cohort.tenant, cohort.query_type, cohort.window
        parts, digest, size = (tenant, query_type, window), cohort.cohort, cohort.size
        where = f"cohort {digest} in window {window} of ({tenant}, {query_type})"
        named = self.cohorts.setdefault((tenant, digest), size)
        if named != size:  # (across batches, each is checked against the stored size)
            self.findings.problem(
                entry, f"{where}: of {size} subjects; an earlier entry said {named}"
            )
        scope = self._scope_of(entry, tenant, query_type, window)
        refined = cohort.refined
        if refined is None:
            listing = scope.listings.labels(digest)
            if listing is None:
                self.findings.problem(
                    entry, f"{where}: charged as known, but the history never listed it"
                )
                listing = set()
        else:
            if digest in scope.listings:
                self.findings.problem(entry, f"{where}: refined again, although it is listed")
            listing = self._apply_refinement(entry, scope, parts, digest, refined, where)
        labels = list(cohort.accounts)
        if labels != sorted(listing):
            self.findings.problem(
                entry, f"{where}: charges {labels}, but the history lists {sorted(listing)}"
            )
        covered = 0
        for label in listing:
            state = self._live(_account(parts, label))
            covered += state.size if state is not None else 0
        if covered != size:
            self.findings.problem(
                entry, f"{where}: its accounts hold {covered} subjects, not its {size}"
            )
        return [_account(parts, label) for label in labels]

    def _apply_refinement(
        self,
        entry: Any,
        scope: ScopeState,
        parts: tuple[str, str, str],
        digest: str,
        refined: Refinement,
        where: str,
    ) -> set[str]:
        """A cohort refined in a scope: kept accounts stay, split parents give the covered
        part to a child (a copy of their spend, pending spend included, whose open
        reservations hold the child too), the subjects with no account get a new one.
        Returns the cohort's listing (kept + children + new), which is recorded."""

        def made(label: str, state: KeyState) -> None:
            if self._live(_account(parts, label)) is not None:
                self.findings.problem(
                    entry, f"{where}: makes account {label}, which exists already"
                )
            self.keys[_account(parts, label)] = state

        kept = set(refined.kept)
        for label in sorted(kept):
            if self._live(_account(parts, label)) is None:
                self.findings.problem(
                    entry, f"{where}: keeps {label}, which is no account of the window"
                )
        children: list[str] = []
        for split in refined.split:
            parent, child, moved = split.parent, split.child, split.moved
            source = self._live(_account(parts, parent))
            if source is None:
                self.findings.problem(
                    entry, f"{where}: splits {parent}, which is no account of the window"
                )
                continue
            self._carry(entry, where, source, parent, _account(parts, child), split.carried)
            if not 0 < moved < source.size:
                self.findings.problem(
                    entry, f"{where}: moves {moved} of the {source.size} subjects of {parent}"
                )
            made(
                child,
                KeyState(
                    live=source.live,
                    lifetime=source.lifetime,
                    pending=source.pending,
                    open=source.open,
                    releases=source.releases,
                    updated_at=entry.at,
                    rescoped_to=source.rescoped_to,
                    repriced=source.repriced,
                    size=moved,
                    of_class=True,
                ),
            )
            source.size -= moved
            source.refers = None  # the writer listed its members before it split it
            scope.listings.split(parent, child)
            children.append(child)
        new = refined.new
        if new is not None:
            if new.size < 1:
                self.findings.problem(entry, f"{where}: makes {new.label} for {new.size} subjects")
            refers = None
            if new.refers:
                # The class of a cohort that covers none of the window's classes: its
                # members are the cohort's (the accounts' size check below: all of them).
                refers = digest
                if kept or children:
                    self.findings.problem(
                        entry, f"{where}: makes {new.label} of the cohort, which it splits"
                    )
            state = KeyState(updated_at=entry.at, size=new.size, of_class=True, refers=refers)
            made(new.label, state)
        listing = {*kept, *children, *([new.label] if new is not None else [])}
        scope.listings.record(digest, listing)
        return listing

    def _carry(
        self,
        entry: Any,
        where: str,
        source: KeyState,
        parent: str,
        child: LedgerKey,
        carried: tuple[str, ...],
    ) -> None:
        """A split parent's open reservations (ids) hold its new part too, one more key
        each: every one of them, and only those."""
        if len(set(carried)) != len(carried) or len(carried) != source.open:
            self.findings.problem(
                entry,
                f"{where}: splits {parent}, held by {source.open} open reservations, but "
                f"carries {len(carried)} of them to {child.subject}",
            )
        for reservation_id in carried:
            held = self.open.get(reservation_id)
            if held is None:
                self.findings.problem(
                    entry, f"{where}: carries reservation {reservation_id}, not open"
                )
            else:
                held.carried.append(child)

    def finish(self) -> None:
        """After the last entry: what only the whole history decides."""
        for reservation_id, held in sorted(self.open.items()):
            if held.beyond != held.carried:
                self.findings.problems.append(f"reservation {reservation_id}: {_NOT_CARRIED}")
        self.findings.problems.extend(self.corrected_totals.unmet())

    def close(self) -> None:
        """Delete the listings' scratch file."""
        self.listings.close()

    def sizes(self) -> dict[tuple[str, str, str], dict[str, KeyState]]:
        """Each scope's accounts whose members are stored (live, or sealed and kept), by
        label."""
        found: dict[tuple[str, str, str], dict[str, KeyState]] = {}
        for key, state in self.keys.items():
            if not state.dropped or state.kept:
                found.setdefault((key.tenant, key.query_type, key.window), {})[key.subject] = state
        return found

    # ------------------------------------------------------------------ entries

    def _priced(
        self, entry: Any, spec: dict[str, Any], count: int, cost: Spend
    ) -> tuple[bool, np.ndarray | None]:
        """Whether ``cost`` is what ``count`` releases of the mechanism of ``spec`` cost on
        the ledger's grid, and for an earlier version's pricing of a re-priced kind what
        today's price adds (elementwise, >= 0) to prove the cap with."""
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
        self.findings.notes.append(
            f"entry {entry.seq} ({entry.action}): recorded cost of {spec.get('kind')} is an "
            f"earlier version's pricing; today's sound price is higher by up to "
            f"{float(extra.max()):.3g} in RDP (the cap is proven with it)"
        )
        return True, extra

    def _on_reserve(self, entry: Any, reserved: ReserveEntry, keys: list[LedgerKey]) -> None:
        cost, cost_text = _canonical_cost(reserved.cost, self.size)
        digest = reserved.keys_digest
        # Rows past its own are the new parts of accounts that split while it was open.
        keys, beyond = keys[: reserved.key_count], keys[reserved.key_count :]
        if history.keys_digest(keys) != digest or len(keys) != reserved.key_count:
            self.findings.problem(entry, "the reservation's key rows differ from its digest")
        self._refine(entry, reserved, keys)
        priced, repriced = self._priced(entry, reserved.mechanism, reserved.count, cost)
        if not priced:
            self.findings.problem(entry, "the reserved cost is not what its mechanism costs")
        if entry.reservation_id in self.open:
            self.findings.problem(entry, f"reservation {entry.reservation_id} reserved twice")
        self._charged(entry, keys)
        policies = self.configuration.policies
        for missed in [
            *scopes.missed_totals(reserved.cohorts or (), policies),
            *scopes.missed_shares(reserved.cohorts or (), policies, dag_of(reserved.attempt_id)),
        ]:
            self.findings.problem(entry, missed)
        policy_of = policy_lookup(self.configuration.policies)
        for key in keys:
            state = self._state(key)
            state.open += 1
            state.pending = state.pending.add(cost)
            state.updated_at = entry.at
            state.repriced = _plus(state.repriced, repriced)
            policy = policy_of(key)
            cap = policy.cap_epsilon
            total = state.lifetime.plus(state.pending.as_spend())
            if state.repriced is not None:
                total = total.plus(Spend(0.0, state.repriced, None))
            epsilon = self._epsilon_beyond(total, policy)
            if epsilon is not None:
                self.findings.problem(
                    entry,
                    f"{key}: granted although its lifetime spend with what was in flight "
                    f"reaches eps {epsilon:.6g}, above its cap {cap:.6g}",
                )
        self.open[entry.reservation_id] = OpenReservation(
            cost, cost_text, reserved.count, digest, repriced, beyond
        )

    def _on_commit(self, entry: Any, charged: CommitEntry, keys: list[LedgerKey]) -> None:
        held = self._close(entry, keys)
        if held is None:
            return
        digest = history.keys_digest(sorted(keys))  # the commit names them in lock order
        if (charged.key_count, charged.keys_digest) != (len(keys), digest):
            self.findings.problem(entry, "its key count and digest are not those of its keys")
        _, cost_text = _canonical_cost(charged.cost, self.size)
        if cost_text != held.cost_text or charged.count != held.count:
            self.findings.problem(entry, "its cost differs from its reservation's")
        for key in keys:
            state = self._state(key)
            state.live = state.live.plus(held.cost)
            state.lifetime = state.lifetime.plus(held.cost)
            state.releases += held.count
            state.updated_at = entry.at

    def _on_release(self, entry: Any, released: ReleaseEntry, keys: list[LedgerKey]) -> None:
        held = self._close(entry, keys)
        if held is not None and held.repriced is not None:  # never charged: nor is the extra
            for key in keys:
                state = self._state(key)
                state.repriced = np.maximum(state.repriced - held.repriced, 0.0)
        self._touch(keys, entry.at)

    def _on_correction(self, entry: Any, corrected: CorrectionEntry, keys: list[LedgerKey]) -> None:
        key = LedgerKey.from_row(entry)
        self._refine(entry, corrected, [key])
        cost = corrected.cost.on_grid(self.size)
        priced, repriced = self._priced(entry, corrected.mechanism, corrected.count, cost)
        if not priced:
            self.findings.problem(entry, "the corrected cost is not what its mechanism costs")
        self._charged(entry, [key])
        self._corrected_totals(entry, corrected)
        state = self._state(key)
        state.repriced = _plus(state.repriced, repriced)
        state.live = state.live.plus(cost)
        state.lifetime = state.lifetime.plus(cost)
        state.releases += corrected.count
        state.updated_at = entry.at

    def _corrected_totals(self, entry: Any, corrected: CorrectionEntry) -> None:
        """A correction's own entry names the totals a cap applied to; each total's entry
        is one so named (:class:`scopes.CorrectedTotals`)."""
        if not corrected.cohorts:
            return
        cohort = corrected.cohorts[0]
        what = (_canonical_cost(corrected.cost, self.size)[1], corrected.count, corrected.reason)
        if cohort.query_type in SCOPE_ACCOUNTS:
            problems = [self.corrected_totals.total(cohort, what)]
        else:
            policies = self.configuration.policies
            problems = self.corrected_totals.own(cohort, corrected.totals, what, policies)
        for problem in problems:
            if problem is not None:
                self.findings.problem(entry, problem)

    def _on_rescope(self, entry: Any, rescoped: RescopeEntry, keys: list[LedgerKey]) -> None:
        old, new = rescoped.source, LedgerKey.from_row(entry)
        self._refine(entry, rescoped, [old, new])
        carried = rescoped.carried.on_grid(self.size)
        moved = self._state(old)
        if rescoped.cohorts is not None:
            # The accounts of one subject alone (tenant and window stay), in either scope.
            alone = classes.cohort_digest([rescoped.subject])
            charged = sorted((c.query_type, c.cohort) for c in rescoped.cohorts)
            if (old.tenant, old.window) != (new.tenant, new.window) or charged != sorted(
                [(old.query_type, alone), (new.query_type, alone)]
            ):
                self.findings.problem(entry, "re-scopes other accounts than its subject's own")
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
            self.findings.problem(entry, f"carries other spend than {old} held")
        if moved.open:
            self.findings.problem(entry, f"{old} was re-scoped with open reservations")
        target = self._state(new)
        target.live = target.live.plus(moved.live)
        target.lifetime = target.lifetime.plus(moved.lifetime)
        target.repriced = _plus(target.repriced, moved.repriced)
        target.releases += moved.releases
        moved.rescoped_to = new.query_type
        self._touch([old, new], entry.at)

    def _on_reset(self, entry: Any, reset: ResetEntry, keys: list[LedgerKey]) -> None:
        window = reset.window
        scopes = None if reset.sealed is None else set(reset.sealed)  # None: every scope
        if scopes is None:
            self.legacy_resets.setdefault(window, entry.at)
        kept = reset.kept
        if kept and scopes is None:
            self.findings.problem(entry, f"kept is {kept!r}, which no reset writes")
            kept = False
        dropped = 0
        for key, state in self.keys.items():
            if key.window != window or state.dropped:
                continue
            if scopes is None or (key.tenant, key.query_type) in scopes:
                if state.open:
                    self.findings.problem(entry, f"{key}: reset with open reservations")
                dropped += 1
                if scopes is None:  # before seals, a reset let the key start again from zero
                    self.keys[key] = KeyState(lifetime=state.lifetime)
                else:
                    state.dropped, state.kept = True, kept
        for (tenant, query_type, label), scope in self.scopes.items():
            if label == window and (scopes is None or (tenant, query_type) in scopes):
                if kept:
                    scope.kept = True  # its listings and members stay, sealed
                else:
                    scope.listings.drop()
        for tenant, query_type in sorted(scopes or ()):
            scope = self.scopes.get((tenant, query_type, window))
            if scope is None:
                self.findings.problem(
                    entry, f"seals window {window} of ({tenant}, {query_type}), never charged"
                )
            elif scope.sealed_at is not None:
                self.findings.problem(
                    entry, f"seals window {window} of ({tenant}, {query_type}) again"
                )
            else:
                scope.sealed_at = entry.at
        if reset.accounts != dropped:
            self.findings.problem(
                entry, f"says it dropped {reset.accounts} accounts; the history had {dropped}"
            )
