"""Individual filtering: which of a cohort's subjects can afford a release.

A release made with individual filtering (Feldman and Zrnic 2021) is never refused for a
subject's sake: each subject whose accounts, at every scope whose cap applies to the
release (its own scope, the wider scopes, its principal's share), could not take the
release's cost on top of their committed and reserved spend is *left out*: the release
is made over the others, charged to them alone, and whoever reads the data leaves the
left-out subjects' rows out before aggregating. Why this keeps every subject within its
cap, and what it needs (a cap checked at a fixed Rényi order), is in docs/accounting.md,
"Individual filtering".

What is decided here runs inside the reservation's own transaction, under the locks the
reservation takes, in the order every charge takes them: the windows first (exclusively),
then the open reservations holding any account of one of the cohort's subjects at any of
those scopes, then those accounts, in key order. Nothing can
add spend to those accounts until the transaction ends (a commit or reap moves pending
spend to committed spend, which leaves the sum the check counts as it was), so the
reservation made next over the subjects kept fits by construction.

The subjects kept are a cohort of their own (registered here, in the same transaction),
so the reservation, its history entry and ``verify`` are those of any cohort's release.
When every subject is left out, the reservation holds no account at all: it is made and
committed all the same, so that nothing the release's task sees says so.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from fractions import Fraction

import numpy as np

from dp_budget_provider.ledger.accounts import classes
from dp_budget_provider.ledger.accounts.classes import Cohort, CohortKeys
from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.accounts.pricing import Pricing
from dp_budget_provider.ledger.accounts.spend import Spend, prospective
from dp_budget_provider.ledger.releases.locks import ChargeLocks, PoliciesChanged, check_windows
from dp_budget_provider.ledger.storage import clock, pipeline
from dp_budget_provider.ledger.storage.statements import LockedAccount
from dp_budget_provider.ledger.windows import scopes
from dp_budget_provider.ledger.windows.policy import Policy
from dp_budget_provider.ledger.windows.policy_store import (
    PolicyStore,
    policy_lookup,
    policy_of_scope,
)
from dp_budget_provider.ledger.windows.shares import dag_of


def unit_digest(canonical: str) -> bytes:
    """A unit's id as a :class:`ContributionTable` names it: 16 bytes of BLAKE2b of its
    canonical form (the ledger's, :func:`~.keys.canonical_subject_ids`), never the id."""
    return hashlib.blake2b(canonical.encode(), digest_size=16).digest()


@dataclass(frozen=True, eq=False)
class ContributionTable:
    """What each unit of a filtered release contributes to each value of its answer, as
    plain arrays: the release's answer is the sum of the entries of the units kept.

    ``units`` holds one :func:`unit_digest` per unit; entry ``i`` adds ``amount[i]`` to
    value ``index[i]`` of an answer of ``size`` values on behalf of unit ``unit_of[i]``.
    The release service totals it over the units the reservation kept, inside the
    release, and adds the noise at once: neither the units left out nor the exact totals
    ever reach the caller. Before anything is reserved it checks that no unit moves the
    answer by more than the sensitivity the release declares (:meth:`check_moves`).
    Which units a table names is its maker's: the operator names the units of the rows
    it read, registered as the cohort charged; a table made by hand that names a unit
    outside its cohort has that unit counted and never charged, as a callable's release
    reads rows of subjects it does not list.
    """

    units: np.ndarray
    unit_of: np.ndarray
    index: np.ndarray
    amount: np.ndarray
    size: int
    integer: bool = False

    def __post_init__(self) -> None:
        # Its own read-only copies: arrays the caller still holds could change between the
        # checks below (and check_moves) and the totals (see the service's snapshot).
        for name, kind in (("units", "S"), ("unit_of", "i"), ("index", "i"), ("amount", "f")):
            given = getattr(self, name)
            if not isinstance(given, np.ndarray) or given.ndim != 1:
                raise ValueError(f"a contribution table's {name} is a one-dimensional array")
            if given.dtype.kind != kind and not (kind == "f" and given.dtype.kind in "iu"):
                raise ValueError(f"a contribution table's {name} has dtype {given.dtype}")
            # Positions as 64-bit integers: a narrower type wraps in the arithmetic below.
            target = {"f": np.float64, "i": np.int64}.get(kind, given.dtype)
            owned = given.astype(target, copy=True)
            owned.setflags(write=False)
            object.__setattr__(self, name, owned)
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"a contribution table's answer has size >= 1, got {self.size!r}")
        if len(self.units) * self.size >= 2**62:  # every (unit, value) pair has an int64 key
            raise ValueError("a contribution table has too many units and values")
        entries = len(self.unit_of)
        if not (len(self.index) == len(self.amount) == entries):
            raise ValueError("a contribution table's entry arrays differ in length")
        if self.units.dtype != np.dtype("S16"):
            raise ValueError("a contribution table names its units by 16-byte digests")
        if entries and (
            self.unit_of.min() < 0
            or self.unit_of.max() >= len(self.units)
            or self.index.min() < 0
            or self.index.max() >= self.size
        ):
            raise ValueError("a contribution table's entry names no unit or no value")
        if not np.isfinite(self.amount).all():
            raise ValueError("a contribution table's amounts must be finite")
        if self.integer and not (
            np.array_equal(self.amount, np.round(self.amount))
            and float(np.abs(self.amount).sum()) < 2.0**52
        ):
            raise ValueError("an integer contribution table's amounts must be whole numbers")

    def totals(self, left_out: frozenset[str] = frozenset()) -> np.ndarray:
        """The answer over the units not ``left_out`` (canonical ids), as if the others'
        entries had never been read: integers for an integer answer."""
        kept = np.ones(len(self.units), dtype=bool)
        if left_out:
            wanted = np.array([unit_digest(unit) for unit in left_out], dtype="S16")
            kept = ~np.isin(self.units, wanted)
        entries = kept[self.unit_of]
        index, amount = self.index[entries], self.amount[entries]
        if self.integer:
            counts = np.zeros(self.size, dtype=np.int64)
            np.add.at(counts, index, amount.astype(np.int64))
            return counts
        # Each value the correctly rounded exact sum of its entries: a running float sum
        # depends on their order, and a large entry and its opposite can swallow what lies
        # between them, so a unit's entries could move it by more than the unit moves.
        return np.array(_exact_sums(index, amount, self.size), dtype=np.float64)

    def check_moves(self, l1: float | None, l2: float | None) -> None:
        """Refuse (ValueError) a table one of whose units is named twice, or moves the
        answer by more than ``l1`` (the sum of its moves' magnitudes) or ``l2`` (their
        Euclidean norm), each compared exactly. A unit's move of a value is the correctly
        rounded exact sum of its entries there; a unit the float sums of its moves cannot
        decide (within a relative ``4 * (values + 1)`` ulps of the bound) is summed again in
        rationals from its own entries."""
        if np.unique(self.units).size != self.units.size:
            raise ValueError("a contribution table names a unit twice")
        if not len(self.unit_of):
            return
        pairs, where = np.unique(self.unit_of * self.size + self.index, return_inverse=True)
        if self.integer:  # whole numbers summing below 2**52: float sums are exact
            moves = np.bincount(where, weights=self.amount, minlength=len(pairs))
        else:
            moves = np.array(_exact_sums(where, self.amount, len(pairs)), dtype=np.float64)
        owner = pairs // self.size
        by_unit = np.argsort(self.unit_of, kind="stable")
        starts = np.searchsorted(self.unit_of[by_unit], np.arange(len(self.units) + 1))
        slack = 4 * (self.size + 1) * 2.0**-53
        for name, bound, power in (("L1", l1, 1), ("L2", l2, 2)):
            if bound is None:
                continue
            sized = np.abs(moves) if power == 1 else moves * moves
            per_unit = np.bincount(owner, weights=sized, minlength=len(self.units))
            limit = Fraction(bound) ** power
            if self.integer:  # exact integers below 2**52: compare with the bound's floor
                doubtful = (per_unit > math.floor(limit)) | (per_unit >= 2.0**52)
            else:
                doubtful = per_unit * (1 + slack) > float(limit) * (1 - slack)
            for unit in np.flatnonzero(doubtful):
                exact: dict[int, Fraction] = {}
                for entry in by_unit[starts[unit] : starts[unit + 1]]:
                    at = int(self.index[entry])
                    exact[at] = exact.get(at, Fraction(0)) + Fraction(float(self.amount[entry]))
                if sum(abs(move) ** power for move in exact.values()) > limit:
                    raise ValueError(
                        "a unit of the contribution table moves the answer by more than the "
                        f"sensitivity declared ({name} {bound:g})"
                    )


def _exact_sums(group: np.ndarray, amount: np.ndarray, groups: int) -> list[float]:
    """For each of ``groups`` groups, the correctly rounded exact sum (``math.fsum``) of
    the amounts whose ``group`` it is (0.0 for an empty group)."""
    order = np.argsort(group, kind="stable")
    bounds = np.searchsorted(group[order], np.arange(groups + 1))
    ordered = amount[order]
    return [math.fsum(ordered[bounds[g] : bounds[g + 1]]) for g in range(groups)]


@dataclass(frozen=True)
class Admitted:
    """The part of a cohort a filtered release charges: ``cohorts``, its keys in each of
    the release's windows (empty when no subject can afford it), and ``left_out``, the
    canonical ids of the subjects it leaves out."""

    cohorts: list[CohortKeys]
    left_out: frozenset[str]


def filtered_cohort(cohorts: Sequence[object]) -> Cohort:
    """The one registered cohort a filtered release covers (in one or more windows);
    ValueError for anything else: filtering decides per subject of one cohort."""
    found = {keys.cohort for keys in cohorts if isinstance(keys, CohortKeys)}
    if len(found) != 1 or not all(isinstance(keys, CohortKeys) for keys in cohorts):
        raise ValueError(
            "a filtered release covers one registered cohort (ledger.cohort(...)) in each "
            "of its windows, not a list of keys or several cohorts"
        )
    return found.pop()


class Filter:
    """Decides, under the reservation's locks, which subjects a filtered release keeps."""

    def __init__(self, pricing: Pricing, locks: ChargeLocks, store: PolicyStore) -> None:
        self._pricing = pricing
        self._locks = locks
        self._store = store

    def admitted(
        self,
        pipe: pipeline.Pipeline,
        cohorts: Sequence[CohortKeys],
        cost: Spend,
        attempt: str,
        moment: datetime,
    ) -> Admitted:
        """Lock what the release over ``cohorts`` would charge and keep the subjects every
        account of whose can take ``cost``; the kept subjects are registered as a cohort.

        ValueError when the release alone passes a cap that applies to it on an account
        with nothing spent: every subject would be left out whatever anyone released, a
        fact about the release and the policies alone.
        """
        cohort = filtered_cohort(cohorts)
        now = clock.stamp(moment)
        chosen = self._store.current(pipe)
        _, scoped = scopes.with_wider_scopes([], cohorts, chosen, dag=dag_of(attempt))
        self._locks.lock_windows(pipe, scoped, now)
        # Read honoured, under the locks: as a charge proves the scopes it chose.
        policies = self._store.read(pipe)
        if policies is not chosen and not scopes.same_wider_scopes(
            chosen, policies, {cohort.tenant}
        ):
            raise PoliciesChanged(
                "the ledger's policies changed while this release was being filtered: it was "
                "refused with nothing written; make it again"
            )
        # What refuses any charge of these windows, whoever is kept: the reservation that
        # follows keeps none when everyone is left out, and must be refused all the same.
        policy_of = policy_lookup(policies)
        check_windows(scoped, policy_of, moment, new_release=True)
        for scope in scoped:
            policy = policy_of_scope(policies, scope.tenant, scope.query_type)
            if policy.filter_order is None:
                raise ValueError(
                    f"the cap of {scope.tenant}/{scope.query_type} is checked on the reported "
                    "epsilon: individual filtering is valid only where every cap that applies "
                    "is checked at one fixed Renyi order (a privacy filter: docs/accounting.md)"
                )
            if not policy.admits(self._pricing.checked_alone(cost, policy)):
                raise ValueError(
                    f"the release alone passes the cap of {scope.tenant}/{scope.query_type} "
                    f"(eps {policy.cap_epsilon:g}) on an account with nothing spent: no "
                    "subject could afford it"
                )
        cohort_id = classes.registered(pipe, cohort)
        covering = [
            (scope_of(scope), sorted(classes.covering(pipe, scope_of(scope), cohort_id)))
            for scope in scoped
        ]
        # As a charge locks: the open reservations holding these accounts first (a commit
        # holds its reservation, then its accounts), then the accounts in key order.
        classes.lock_open_reservations(pipe, covering)
        ordered = sorted(  # a LedgerKey sorts in lock order
            LedgerKey.from_canonical(tenant, label, query_type, window)
            for (tenant, query_type, window), labels in covering
            for label in labels
        )
        locked = self._locks.lock_existing(pipe, ordered)
        affords = _affords(self._pricing, cost, policy_of)
        short = [key for key in ordered if not affords(key, locked[key])]
        left_out: set[str] = set()
        for key in short:
            left_out.update(classes.members_in(pipe, key, cohort_id))
        if not left_out:
            return Admitted(list(cohorts), frozenset())
        kept = sorted(set(classes.cohort_members(pipe, cohort_id)) - left_out)
        if not kept:
            return Admitted([], frozenset(left_out))
        _, digest = classes.register(pipe, cohort.tenant, kept, now)
        part = Cohort(cohort.tenant, digest, len(kept))
        return Admitted(
            [part.in_window(keys.query_type, keys.window) for keys in cohorts],
            frozenset(left_out),
        )


def scope_of(keys: CohortKeys) -> classes.Scope:
    """The (tenant, query type, window) of a cohort's keys."""
    return (keys.tenant, keys.query_type, keys.window)


def _affords(
    pricing: Pricing, cost: Spend, policy_of: Callable[[LedgerKey], Policy]
) -> Callable[[LedgerKey, LockedAccount], bool]:
    """Whether a locked account can take ``cost``: checked as the reservation checks it
    (its committed and pending spend with the cost, at the policy's filter order). A
    re-scoped account can take nothing: no release may charge it."""

    def affords(key: LedgerKey, held: LockedAccount) -> bool:
        if held.rescoped_to is not None:
            return False
        total = prospective(held.spend, held.pending, cost)
        policy = policy_of(key)
        return policy.admits(pricing.checked_epsilon(total, policy))

    return affords
