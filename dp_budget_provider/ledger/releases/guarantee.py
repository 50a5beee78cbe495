"""A release's guarantee as it may be published beyond the task that made it.

A committed release is told to its own task in full (the receipt, ``gate.py``). What
leaves the task for others (an Airflow asset event that any DAG scheduled on the asset
reads, a lineage event in a catalogue) is read by people who may author other DAGs over
other data, so it says what a reader needs to trust and use the numbers, and nothing
more than the receipt already says:

==================  ============================================================
``reservation_id``  the ledger's reservation: what an administrator looks up
``mechanism``       the mechanism charged, as a spec (the discrete one for lattice noise)
``noise``           ``lattice`` (exact discrete noise) or ``unsafe_float``
``noise_std``       the standard deviation of the noise on each value
``epsilon``         what this release alone costs, at ``delta``
``delta``           the ledger's fixed delta
``epsilon_after``   the receipt's account state after the release, at ``delta``:
                    only where the gate exposes budget state (else None, as the
                    receipt has none: it would say how much others spent on the
                    same subjects)
``cap_epsilon``     the cap the release's scope is held to (public policy)
``windows``         the budget windows charged
``cohort_size``     how many subjects the release covers, as a public bucket
``reused``          true when the run was handed the stored answer of an earlier
                    run of the same release (``reservation_id`` is that run's),
                    charging nothing
==================  ============================================================

Never a subject, an account key, or anything about other releases. The cohort's size is
bucketed because an exact count is a membership signal: two releases over the same
population whose sizes differ by one tell a reader that one person joined or left, and
which releases moved together tells who. The buckets are decades, fixed in code
(``[1, 10)``, ``[10, 100)``, ...): a reader learns the order of magnitude a noise
standard deviation is to be compared with, and a bucket moves only when the size
crosses a power of ten. A size that sits at a boundary still moves it with one subject,
so where the cohort's size is itself sensitive no outlet should carry it at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dp_budget_provider.ledger.accounts.covered import Covered, covered
from dp_budget_provider.ledger.releases.service import ReleaseOutcome

#: The base of the cohort-size buckets: decades.
BUCKET_BASE = 10


@dataclass(frozen=True)
class CohortSizeBucket:
    """``at_least <= size < below``: the decade a cohort's size falls in."""

    at_least: int
    below: int

    @classmethod
    def of(cls, size: int) -> CohortSizeBucket:
        """The bucket of ``size`` (at least 1: a release covers someone)."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"a cohort's size is a positive integer, got {size!r}")
        low = 1
        while low * BUCKET_BASE <= size:
            low *= BUCKET_BASE
        return cls(low, low * BUCKET_BASE)

    def as_dict(self) -> dict[str, int]:
        return {"at_least": self.at_least, "below": self.below}


def cohort_size(keys: Covered) -> int:
    """How many distinct subjects ``keys`` cover, whatever the windows (a subject charged
    in two windows is one subject): the size of the population the release describes (a
    registered cohort's size, the same in each of its windows)."""
    plain, cohorts = covered(keys)
    if cohorts:
        return max(item.cohort.size for item in cohorts)
    return len({(key.tenant, key.subject) for key in plain})


@dataclass(frozen=True)
class ReleaseGuarantee:
    """The publishable guarantee of one charged release (see the module docstring)."""

    reservation_id: str
    mechanism: Mapping[str, Any]
    noise: str
    noise_std: float
    epsilon: float
    delta: float
    epsilon_after: float | None
    cap_epsilon: float
    windows: tuple[str, ...]
    cohort_size: CohortSizeBucket
    reused: bool = False

    @classmethod
    def of(cls, outcome: ReleaseOutcome, keys: Covered, delta: float) -> ReleaseGuarantee | None:
        """The guarantee of a charged release (``released``, ``failed`` after the data was
        touched, or ``reused``: the earlier release's); None when nothing was charged.
        ``keys`` is what the release covered,
        ``delta`` the ledger's."""
        if outcome.receipt is None or outcome.plan is None:
            return None
        receipt = outcome.receipt
        summary = receipt.as_dict()
        return cls(
            reservation_id=receipt.reservation_id,
            mechanism=dict(receipt.mechanism),
            noise="unsafe_float" if outcome.plan.lattice is None else "lattice",
            noise_std=outcome.plan.noise_std,
            epsilon=receipt.epsilon,
            delta=float(delta),
            # Exactly what the receipt tells the task: present only in an exposed gate.
            epsilon_after=summary.get("epsilon_after"),
            cap_epsilon=receipt.cap_epsilon,
            windows=tuple(receipt.windows),
            cohort_size=CohortSizeBucket.of(cohort_size(keys)),
            reused=receipt.reused,
        )

    def as_dict(self) -> dict[str, Any]:
        """The guarantee as plain JSON values (an asset event's extra, a lineage facet)."""
        return {
            "reservation_id": self.reservation_id,
            "mechanism": dict(self.mechanism),
            "noise": self.noise,
            "noise_std": self.noise_std,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "epsilon_after": self.epsilon_after,
            "cap_epsilon": self.cap_epsilon,
            "windows": list(self.windows),
            "cohort_size": self.cohort_size.as_dict(),
            "reused": self.reused,
        }
