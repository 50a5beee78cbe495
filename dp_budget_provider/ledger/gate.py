"""What a task holds of the ledger: a gate that releases within the caps and tells
nothing about anyone else's releases.

A task runs code its DAG author wrote, and whatever the task is told (errors, receipts,
logs, XCom) that author reads. A refusal that names the subject that refused, or a
receipt with each class's eps after the release, lets one DAG learn who is in another
DAG's data: refusals cost nothing, and a release at a negligible cost over a chosen
subset tells whether someone else charged it. So the gate answers only what a release
needs, and each answer depends only on the release itself:

* ``reserve`` grants, or refuses with one uniform :class:`ReleaseRefused` for every
  reason (the cap, a sealed window, a quarantine, a corrupt ledger): its message is the
  same words and a *reference*, the facts sealed to the administrator's key
  (:mod:`authority`), which only an administrator opens (``dp-budget refusal``);
* ``commit`` returns a :class:`ReleaseReceipt`: the release's own cost, mechanism, cap
  and size, never an account's spend;
* ``fits`` is the one bit a sensor needs (the refused-or-granted bit: it still leaks
  with enough questions; shares per principal and individual filtering remove it);
* a filtered reservation (individual filtering, :mod:`~.releases.filtering`) is the
  release service's alone: the subjects it leaves out never leave the service, and it
  is never given back.

A deployment where every DAG author may see all budget state opens the gate with
``exposed=True`` (``[dp_budget] expose_budget_state``): refusals then carry their
reason and receipts the accounts' state, as the ledger's own API returns them.

Administrative acts are not offered at all (and need the administrator's key anyway).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar

import numpy as np

from dp_budget_provider.accounting import Conversion, Mechanism
from dp_budget_provider.ledger.accounts.classes import Cohort, subjects_in
from dp_budget_provider.ledger.accounts.covered import Covered, covered
from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.audit.authority import SEALED_SIZE
from dp_budget_provider.ledger.errors import BudgetExhausted, LedgerError, LedgerUnavailable
from dp_budget_provider.ledger.ledger import PrivacyBudgetLedger
from dp_budget_provider.ledger.records import Reservation, SpendReceipt
from dp_budget_provider.ledger.releases.identity import ReleaseIdentity
from dp_budget_provider.ledger.releases.stored import Keep
from dp_budget_provider.ledger.storage import history
from dp_budget_provider.ledger.windows.maintenance import MaintenanceState
from dp_budget_provider.ledger.windows.policy import Policy
from dp_budget_provider.ledger.windows.shares import dag_of, parse_share

T = TypeVar("T")
UNIFORM_REFUSAL = "the privacy budget ledger refused this release; nothing was released or charged"


class ReleaseRefused(LedgerError):
    """A release the ledger would not grant, for whatever reason; nothing was written.

    ``reference`` is the reason sealed to the administrator's key (None when the ledger
    has no administrator key to seal it to); ``detail`` is the reason itself, only in
    an exposed gate.
    """

    def __init__(self, reference: str | None, detail: str | None = None) -> None:
        self.reference = reference
        self.detail = detail
        if detail is not None:
            text = f"{UNIFORM_REFUSAL}: {detail}"
        elif reference is not None:
            text = (
                f"{UNIFORM_REFUSAL}. Reference for an administrator (`dp-budget refusal "
                f"REFERENCE`): {reference}"
            )
        else:
            text = (
                f"{UNIFORM_REFUSAL}. The ledger has no administrator key, so the reason is "
                "recorded nowhere (`dp-budget admin init`)"
            )
        super().__init__(text)


@dataclass(frozen=True)
class GrantedRelease:
    """A granted reservation as a task holds it: its id and lease, not its accounts.

    ``subjects`` and ``windows`` are the release's own, as it asked for them (a filtered
    release's too, whoever it left out). Of a filtered release the grant holds the
    subjects left out only for the release service, which totals the release's
    contribution table without them (:func:`~.releases.service.make_release`).
    """

    id: str
    subjects: int
    windows: tuple[str, ...]
    mechanism: Mechanism
    count: int
    lease_expires_at: str | None
    scope: tuple[str, str]
    _reservation: Reservation = field(repr=False, compare=False)
    # None: not filtered. A filtered grant is always committed (``release`` refuses it).
    _left_out: frozenset[str] | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class ReleaseReceipt:
    """What a task is told of a committed release: the release itself.

    ``epsilon`` is what this release alone costs (at the ledger's delta), ``cap_epsilon``
    the cap its scope is held to. ``accounts`` holds the accounts' state only in an
    exposed gate (else None).
    """

    reservation_id: str
    subjects: int
    windows: tuple[str, ...]
    mechanism: dict[str, Any]
    epsilon: float
    cap_epsilon: float
    accounts: list[SpendReceipt] | None = None
    # The subject that names the most-spent account (exposed gates only).
    named: LedgerKey | None = None
    # The release's principal's shares after it, where a cap is divided (:func:`_share_state`).
    share: dict[str, Any] | None = None
    # Handed the stored answer of an earlier run of the same release (``reservation_id``
    # is that run's): nothing was charged now.
    reused: bool = False
    # Whether the answer was kept for re-runs (None: not asked to keep it).
    stored: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        """The receipt as plain JSON values (a task's XCom)."""
        document: dict[str, Any] = {
            "reservation_id": self.reservation_id,
            "keys": self.subjects,
            "windows": list(self.windows),
            "mechanism": self.mechanism,
            "epsilon": self.epsilon,
            "cap_epsilon": self.cap_epsilon,
            "reused": self.reused,
        }
        if self.share is not None:
            document["share"] = self.share
        if self.stored is not None:
            document["stored"] = self.stored
        if self.accounts:  # none when a filtered release left every subject out
            worst = max(self.accounts, key=lambda r: r.fraction)
            document.update(
                account=(self.named or worst.key).as_dict(),
                epsilon_after=worst.epsilon,
                remaining=worst.remaining,
                fraction=worst.fraction,
                warned=any(r.warned for r in self.accounts),
                method=worst.method,
            )
        return document


@dataclass(frozen=True)
class ReusedRelease:
    """A re-run handed the stored answer of its release: the answer, and the receipt the
    release's own task was given (the release alone: no account's state), marked reused."""

    value: Any
    receipt: ReleaseReceipt


def _stored_receipt(document: Mapping[str, Any]) -> ReleaseReceipt:
    """The receipt a stored release kept (:meth:`ReleaseGate.commit`), marked reused."""
    return ReleaseReceipt(
        reservation_id=document["reservation_id"],
        subjects=document["keys"],
        windows=tuple(document["windows"]),
        mechanism=dict(document["mechanism"]),
        epsilon=document["epsilon"],
        cap_epsilon=document["cap_epsilon"],
        reused=True,
    )


def _share_state(receipts: list[SpendReceipt]) -> dict[str, Any] | None:
    """What a release's principal may see of its budget where a cap is divided: its
    share accounts after the release, the one nearest its share's cap. They hold only
    the principal's own releases, so this says nothing about other DAGs' data (the
    scopes' own accounts, which hold everyone's, are never shown)."""
    if not receipts:
        return None
    worst = max(receipts, key=lambda r: r.fraction)
    principal, scope = parse_share(worst.key.query_type)  # type: ignore[misc]
    return {
        "principal": principal,
        "scope": scope,
        "window": worst.key.window,
        "epsilon_after": worst.epsilon,
        "remaining": worst.remaining,
        "fraction": worst.fraction,
        "cap_epsilon": worst.cap_epsilon,
    }


def _fitting(facts: dict[str, Any]) -> dict[str, Any]:
    """``facts`` cut to fit a sealed reference's fixed size: the reason is shortened first
    (the account and eps are whole in their own fields), the account last."""

    def size() -> int:
        return len(history.canonical_json(facts).encode("utf-8"))

    while size() > SEALED_SIZE and facts["reason"]:
        facts["reason"] = facts["reason"][: len(facts["reason"]) // 2]
    if size() > SEALED_SIZE:
        facts.pop("account", None)
    return facts


def _subjects(keys: Covered) -> int:
    """How many (subject, window) pairs a release covers: its own input, not its classes
    (how the ledger splits them into classes depends on other releases)."""
    keys_of, cohorts = covered(keys)
    return subjects_in(cohorts or keys_of)


class ReleaseGate:
    """A ledger as a task may use it (see the module docstring)."""

    def __init__(
        self, ledger: PrivacyBudgetLedger, *, exposed: bool = False, dag: str | None = None
    ) -> None:
        self._ledger = ledger
        self.exposed = exposed
        # The DAG whose task holds the gate (the hook takes it from the task's context):
        # where a cap is divided, every answer is about its principal's share, and it may
        # reserve only as itself. A gate outside any task has none (no share anywhere).
        self.dag = dag

    @property
    def delta(self) -> float:
        """The ledger's fixed delta (public: every eps is at it)."""
        return self._ledger.delta

    @property
    def orders(self) -> np.ndarray:
        """The ledger's grid of Rényi orders (public: how every cost is priced)."""
        return self._ledger.orders

    @property
    def conversion(self) -> Conversion:
        """The ledger's RDP to (eps, delta) conversion (public)."""
        return self._ledger.conversion

    def windows_for(
        self, tenant: str, query_type: str, start: datetime, end: datetime
    ) -> list[str]:
        """The windows data from ``start`` to ``end`` falls in (the public calendar)."""
        return self._ledger.windows_for(tenant, query_type, start, end)

    def policy_for_scope(self, tenant: str, query_type: str) -> Policy:
        """The cap and calendar in force for (tenant, query type): public to its releases."""
        return self._ledger.policy_for_scope(tenant, query_type)

    def policy_for_release(self, tenant: str, query_type: str) -> Policy:
        """The cap a release of this gate's DAG is held to at (tenant, query type): its
        principal's share where the cap is divided, else the scope's (public to it)."""
        return self._ledger.policy_for_release(tenant, query_type, self.dag)

    def cohort(self, subjects: Any, tenant: str = "default") -> Cohort:
        """Register a cohort (what the handle says depends only on its subjects)."""
        return self._ledger.cohort(subjects, tenant)

    def cost_alone(self, mechanism: Mechanism, count: int = 1) -> float:
        """What this release alone costs, in eps at the ledger's delta."""
        return self._ledger.epsilon_alone(mechanism, count)

    def checked_alone(self, policy: Policy, mechanism: Mechanism, count: int = 1) -> float:
        """What ``policy``'s cap is compared with for this release on an account with
        nothing spent (at its filter order): what noise is planned against. A function
        of the release and the policy alone."""
        return self._ledger.checked_alone(policy, mechanism, count)

    def fits_alone(
        self, tenant: str, query_type: str, mechanism: Mechanism, count: int = 1
    ) -> bool:
        """Whether this release alone fits the cap of (tenant, query type) this gate's DAG
        is held to (its share's where the cap is divided): if not, no window ever will.
        Priced on nothing spent, so it says nothing about anyone."""
        return self._ledger.fits_an_empty_account(
            tenant, query_type, mechanism, count, dag=self.dag
        )

    def fits(self, keys: Covered, mechanism: Mechanism, count: int = 1) -> bool:
        """Whether the release, made by this gate's DAG, would be granted now: one bit,
        nothing about why (a sealed window, a re-scoped subject or a quarantine answer False
        like a full cap: told apart, they would say something about other DAGs' subjects).
        Where a cap is divided, the DAG's own share is what it is checked against: a task
        cannot ask about another DAG's."""
        try:
            return not self._ledger.budget_check(keys, mechanism, count, dag=self.dag).exceeds
        except LedgerUnavailable:
            raise
        except LedgerError:
            return False

    def reserve(
        self, keys: Covered, mechanism: Mechanism, count: int = 1, *, attempt: str
    ) -> GrantedRelease:
        """Reserve the release's cost on ``keys``, or raise :class:`ReleaseRefused`. A
        gate held by a DAG's task reserves only as that DAG (its ``attempt`` names it):
        which share pays is the DAG's."""
        return self._granted(
            keys,
            attempt,
            lambda: (self._ledger.reserve(keys, mechanism, count, attempt=attempt), None),
        )

    def _reserve_filtering(
        self, keys: Covered, mechanism: Mechanism, count: int = 1, *, attempt: str
    ) -> GrantedRelease:
        """A filtered reservation, for the release service alone (``make_release`` with a
        contribution table): no subject's budget refuses it, the subjects that cannot
        afford it are left out (:mod:`~.releases.filtering`), and the grant says nothing
        of them but to the service, which totals the table without them, adds the noise
        and commits at once. Not a method a task calls: the set left out is what
        filtering hides, and a filtered grant is never given back (:meth:`release`)."""

        def reserved() -> tuple[Reservation, frozenset[str]]:
            return self._ledger.reserve_admitting(keys, mechanism, count, attempt=attempt)

        return self._granted(keys, attempt, reserved)

    def _granted(
        self,
        keys: Covered,
        attempt: str,
        reserve: Callable[[], tuple[Reservation, frozenset[str] | None]],
    ) -> GrantedRelease:
        """The grant of ``reserve()`` (a reservation, and what a filter left out: None
        when unfiltered) as the release asked for it (refusals sealed)."""
        self._as_own_dag(attempt)
        reservation, left_out = self._refusing(reserve)
        ordered, cohorts = covered(keys)
        asked = [*ordered, *cohorts]
        return GrantedRelease(
            reservation.id,
            _subjects(keys),
            # Its own windows, as asked (not the periods of its subjects' totals at wider
            # scopes, nor what a filter left of them).
            tuple(sorted({k.window for k in asked})),
            reservation.mechanism,
            reservation.count,
            reservation.lease_expires_at,
            (asked[0].tenant, asked[0].query_type),
            reservation,
            left_out,
        )

    def commit(
        self, granted: GrantedRelease, keep: tuple[ReleaseIdentity, Any] | None = None
    ) -> ReleaseReceipt:
        """Charge the release (it happened); the receipt describes the release alone.

        ``keep``: the release's identity and its noisy answer, kept with the commit for
        re-runs of the same release (:meth:`reuse`), with the receipt of the release alone
        (never an account's state, even in an exposed gate: a re-run may come much later).
        An answer too large to keep is not (:data:`stored.MAX_STORED_BYTES`): the receipt's
        ``stored`` says whether it was.
        """
        released = ReleaseReceipt(
            granted.id,
            granted.subjects,
            granted.windows,
            granted.mechanism.to_spec(),
            self.cost_alone(granted.mechanism, granted.count),
            self._ledger.policy_for_scope(*granted.scope).cap_epsilon,
        )
        kept = None
        if keep is not None:
            self.own(keep[0])
            kept = Keep.of(keep[0], keep[1], released.as_dict())
        receipts = self._refusing(lambda: self._ledger.commit(granted._reservation, kept))
        # A filtered release's share accounts are those of the subjects it kept: who.
        shares = [
            r
            for r in (receipts if granted._left_out is None else [])
            if parse_share(r.key.query_type) is not None
        ]
        named = None
        if self.exposed and receipts:
            named = self._ledger.subject_of(max(receipts, key=lambda r: r.fraction).key)
        return dataclasses.replace(
            released,
            accounts=receipts if self.exposed else None,
            named=named,
            share=_share_state(shares),
            # Kept only by the commit that charged it (not by one that found its
            # reservation reaped meanwhile), and only if small enough.
            stored=None if keep is None else kept is not None and kept.stored is not None,
        )

    def reuse(self, identity: ReleaseIdentity, *, attempt: str) -> ReusedRelease | None:
        """The stored answer of ``identity`` (a release of this gate's DAG) and its
        receipt, marked reused, charging nothing; None when the release was never made
        (or kept). Refused (:class:`ReleaseRefused`, its reason sealed) in quarantine and
        when the stored answer does not prove against the history: it is then never
        served. Whether an answer is stored depends only on this DAG's own releases."""
        self.own(identity)
        self._as_own_dag(attempt)
        answer = self._refusing(lambda: self._ledger.reuse(identity, attempt))
        if answer is None:
            return None
        return ReusedRelease(answer.value, _stored_receipt(answer.receipt))

    def own(self, identity: ReleaseIdentity) -> None:
        """Refuse (ValueError) a release identity of another DAG than the one holding this
        gate: a task keeps and reuses only its own DAG's releases."""
        if self.dag is not None and identity.dag != self.dag:
            raise ValueError(
                f"release identity of DAG {identity.dag!r} is not this task's DAG {self.dag!r}: "
                "a task keeps and reuses only its own DAG's releases"
            )

    def _as_own_dag(self, attempt: str) -> None:
        """Refuse (ValueError) an attempt naming another DAG than the one holding this
        gate: a task reserves, and is handed answers, as its own DAG."""
        if self.dag is not None and dag_of(attempt) != self.dag:
            raise ValueError(
                f"attempt {attempt!r} does not name this task's DAG {self.dag!r}: a task "
                "acts as its own DAG"
            )

    def release(self, granted: GrantedRelease, reason: str = "") -> None:
        """Give the reservation back: the data was never touched. A filtered reservation
        is never given back (ValueError): it is committed, or reaped as charged, so that
        a filter's answer is never had for nothing."""
        if granted._left_out is not None:
            raise ValueError("a filtered reservation is committed, never given back")
        self._ledger.release(granted._reservation, reason)

    def renew(self, granted: GrantedRelease) -> datetime:
        """Renew the reservation's lease."""
        return self._ledger.renew(granted._reservation)

    def keep_alive(
        self, granted: GrantedRelease, log: logging.Logger | logging.LoggerAdapter[Any]
    ) -> contextlib.AbstractContextManager[None]:
        """Renew the lease in the background while the release runs."""
        return self._ledger.keep_alive(granted._reservation, log)

    def rescope(self, old: LedgerKey, new: LedgerKey, reason: str = "") -> None:
        """Move an account's spend to another query type (it carries all of it, and the
        old key is sealed); nothing about the spend moved is returned."""
        self._refusing(lambda: self._ledger.rescope(old, new, reason))

    def reap(self, older_than: timedelta | None = None) -> int:
        """Charge abandoned reservations (only ever charges); how many (not whose)."""
        return len(self._ledger.reap(older_than))

    def reset_closed(self) -> list[str]:
        """Seal and reset the windows past their grace period (never refunds); which
        windows (not how many accounts other DAGs held there)."""
        return sorted(self._ledger.reset_closed())

    def maintenance(self, intervals: Mapping[str, timedelta]) -> list[MaintenanceState]:
        """When reap, reset and verify last ran and which are overdue: about the ledger's
        upkeep, nothing about any account (so the release tasks can warn about it)."""
        return self._ledger.maintenance(intervals)

    def _refusing(self, action: Callable[[], T]) -> T:
        """``action()``; every refusal leaves as one :class:`ReleaseRefused`, its facts
        sealed.

        It is raised after the ``except`` block has ended (not from a context manager's
        exit either, which runs while the error is handled): raised while the ledger's
        own error (naming the subject and its spend) is handled, Python keeps that error
        as its ``__context__``, which any code holding the exception can read.
        """
        try:
            return action()
        except LedgerUnavailable:
            raise  # the database, not the budget: says nothing about anyone's data
        except LedgerError as error:
            refused = self._refused(error)
        raise refused

    def _refused(self, error: LedgerError) -> ReleaseRefused:
        facts: dict[str, Any] = {"refusal": type(error).__name__, "reason": str(error)}
        if isinstance(error, BudgetExhausted):
            facts.update(
                account=getattr(error.key, "as_dict", lambda: str(error.key))(),
                epsilon=error.would_be_epsilon,
                cap_epsilon=error.cap_epsilon,
            )
        trusted = self._ledger.admin_public_key
        reference = trusted.seal(_fitting(facts)) if trusted is not None else None
        return ReleaseRefused(reference, str(error) if self.exposed else None)
