"""What the ledger hands back: receipts, reservations, account status, verification reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dp_budget_provider.accounting import Mechanism
from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.accounts.standing import Standing
from dp_budget_provider.ledger.windows.policy import (
    STATE_EXHAUSTED,
    STATE_OK,
    STATE_RESCOPED,
    STATE_SEALED,
    STATE_WARNING,
    Policy,
    within_cap,
)

OPEN, COMMITTED, RELEASED, REAPED = "open", "committed", "released", "reaped"


@dataclass(frozen=True)
class SpendReceipt:
    """One account after a debit: its cumulative eps, headroom and warning state.

    ``epsilon`` is the eps the ledger reports (the least over the grid, or the exact
    Gaussian bound); ``remaining``, ``fraction`` and ``warned`` count the spend as the cap
    check does (:meth:`Pricing.checked_epsilon`: at the policy's filter order), so they
    say what the cap still grants: an account the filter refuses shows no room, although
    its reported eps may be below the cap. ``subjects`` is how many subjects the
    account's class holds: each of them is at ``epsilon``. ``key`` is the account's (a
    class label as its subject), or the subject key asked about when the receipt answers
    for one subject.
    """

    key: LedgerKey
    epsilon: float
    remaining: float
    fraction: float
    warned: bool
    cap_epsilon: float
    method: str
    subjects: int = 1


@dataclass(frozen=True)
class BudgetCheck:
    """Whether a release fits every key asked about, and the key it fits worst.

    ``key`` is the key the release fits worst (the largest fraction of its cap the check
    would compare), ``epsilon`` the eps it would reach (committed and open reservations
    counted, summed as the reservation's own check sums them) and ``checked_epsilon`` what
    the reservation compares with its cap (the privacy filter's statistic at the policy's
    order: :meth:`Pricing.checked_epsilon`). ``states`` is how many distinct held states
    the answer was computed from: keys that have had the same releases share one.
    """

    keys: int
    key: LedgerKey
    epsilon: float
    cap_epsilon: float
    states: int
    checked_epsilon: float

    @property
    def exceeds(self) -> bool:
        """The release would pass ``key``'s cap: reserving it now would be refused."""
        return not within_cap(self.checked_epsilon, self.cap_epsilon)


@dataclass(frozen=True)
class Reservation:
    """A prospective spend holding budget on its keys until commit, release or reap.

    ``prospective_epsilon`` is the largest eps any of its keys would reach (counting
    every other open reservation) when it was made. ``token`` is the secret that makes
    its holder (the attempt that reserved) the only one who may commit, release or renew
    it; reservations read back from the database carry none. ``lease_expires_at`` is
    when an open reservation that is not renewed becomes due for reaping (as read or
    made; renewals move it on).
    """

    id: str
    attempt_id: str
    keys: tuple[LedgerKey, ...]
    mechanism: Mechanism
    count: int
    state: str
    prospective_epsilon: float
    created_at: str
    token: str = field(default="", repr=False, compare=False)
    lease_expires_at: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class AccountStatus:
    """An account as reports and the UI show it.

    ``epsilon``, ``remaining`` and ``fraction`` are what has been committed.
    ``held_epsilon`` counts every open reservation as charged too, and
    ``remaining_after_held`` is the cap minus it: what a new release can still get.
    ``warned`` and ``exhausted`` (so the state) are decided on the held spend, since
    that is what the next release is checked against. The epsilons are those the ledger
    reports; remaining, fraction, warning and exhaustion count the spend as the cap
    check does (at the policy's filter order: :class:`SpendReceipt`).

    ``key`` is a subject's key; ``account`` is the label of the account (spend class)
    holding its spend, and ``subjects`` how many subjects hold it: the class's size (a
    spend class row's: its members, see :mod:`spend_classes`, whose ``account`` is None:
    they may be held by several accounts).
    """

    key: LedgerKey
    epsilon: float
    cap_epsilon: float
    remaining: float
    fraction: float
    held_epsilon: float
    remaining_after_held: float
    warned: bool
    exhausted: bool
    open_reservations: int
    releases: int
    method: str
    updated_at: str
    rescoped_to: str | None = None  # sealed: its spend moved to this query type
    account: str | None = None
    subjects: int = 1
    # When a reset sealed the window: the spend is final, never charged again.
    sealed_at: str | None = None

    @property
    def state(self) -> str:
        """``ok``, ``WARNING``, ``EXHAUSTED`` (:meth:`Policy.state_at`), ``RESCOPED``
        (sealed: its spend moved to another query type) or ``SEALED`` (its window is
        sealed: the final spend)."""
        if self.rescoped_to is not None:
            return STATE_RESCOPED
        if self.sealed_at is not None:
            return STATE_SEALED
        if self.exhausted:
            return STATE_EXHAUSTED
        return STATE_WARNING if self.warned else STATE_OK

    @classmethod
    def of(cls, row: Any, standing: Standing, policy: Policy) -> AccountStatus:
        """The status of a per-subject row (``subject_rows``: the account's columns, the
        subject, the ``account`` label and ``size``), given where it stands and its policy."""
        checked, cap = standing.checked, policy.cap_epsilon
        return cls(
            key=LedgerKey.from_canonical(row.tenant, row.subject, row.query_type, row.window),
            epsilon=standing.committed.epsilon,
            cap_epsilon=cap,
            remaining=max(0.0, cap - checked.committed),
            fraction=checked.committed / cap,
            held_epsilon=standing.held.epsilon,
            remaining_after_held=max(0.0, cap - checked.held),
            warned=policy.warns_at(checked.held),
            exhausted=policy.exhausts_at(checked.held, standing.next_epsilon),
            open_reservations=row.open_reservations,
            releases=row.releases,
            method=standing.committed.method,
            updated_at=row.updated_at,
            rescoped_to=row.rescoped_to,
            account=row.account,
            subjects=int(row.size),
            sealed_at=getattr(row, "sealed_at", None),
        )


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of :meth:`PrivacyBudgetLedger.verify`."""

    entries: int
    accounts: int
    problems: list[str] = field(default_factory=list)
    # Facts that do not fail verification: entries an earlier version priced differently.
    notes: list[str] = field(default_factory=list)
    # (chain, seq, link) of every chain head verified: what a checkpoint records.
    heads: tuple[tuple[int, int, str], ...] = ()
    # True when the history's links are HMACs under the verifier's chain key.
    keyed: bool = False
    # The ledger's identity in checkpoints (the link of its creation entry).
    ledger: str = ""

    @property
    def ok(self) -> bool:
        """True when the chain, the reservation key sets and the account states all check out."""
        return not self.problems
