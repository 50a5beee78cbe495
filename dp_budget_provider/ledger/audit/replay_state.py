"""What the replay holds while it reads the history: the verifier's settings, what it finds,
and each account, open reservation and window as the history makes them. One state per
account, per open reservation and per window, never per entry or per subject: what bounds
verify's memory, with the rows it streams ``BATCH`` at a time (the windows' listings, one
row per cohort and account, are kept in a scratch file: ``replay_listings``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dp_budget_provider.accounting import Conversion
from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.accounts.spend import Pending, Spend
from dp_budget_provider.ledger.audit.checkpoints import Checkpoint
from dp_budget_provider.ledger.audit.replay_listings import ScopeListings
from dp_budget_provider.ledger.storage import history

BATCH = 5000
"""Rows per fetch of the tables verify streams (history entries and cohort members come in
batches of their own size)."""
ENTRY_BATCH = 100
"""Rows per fetch of those that carry a history payload (entries, reservations with their
reserve entry): a charge's payload grows with its classes."""

Handler = Callable[[Any, Any, list[LedgerKey]], None]
"""What one kind of entry does to the replay, given its row, its payload read as that
kind's record (``entries``) and its reservation's keys (in position order; none for an
entry that names no reservation)."""


@dataclass(frozen=True)
class AuditSettings:
    """What the verifier holds outside the database: the grid, delta, conversion and key."""

    orders: np.ndarray
    delta: float
    conversion: Conversion
    key: history.ChainKey
    checkpoint: Checkpoint | None = None


@dataclass
class Findings:
    """What the replay finds on its way through the history, in the order it finds it: the
    problems (a breach, or a fact an edit changed) and the notes (an earlier version's
    pricing, which is no problem). Every part of the replay reports to the same findings,
    so the problems keep the history's order."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def problem(self, entry: Any, text: str) -> None:
        """A problem of one entry, named by its seq and action."""
        self.problems.append(f"entry {entry.seq} ({entry.action}): {text}")


@dataclass(slots=True)
class KeyState:
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
class OpenReservation:
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
class ScopeState:
    """One (tenant, query type, window) as the history made it."""

    first_at: str
    # dp_cohort_accounts as the replay makes it here (in the verifier's scratch file).
    listings: ScopeListings
    sealed_at: str | None = None
    kept: bool = False  # sealed by a reset that kept its final spend, members and listings
