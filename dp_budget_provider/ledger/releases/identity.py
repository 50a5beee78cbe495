"""A release's identity: what makes two runs of a task the same release.

Re-running a release that has been made (a cleared task, a re-run of a successful run, a
backfill over an interval already released) must not pay again for an answer that was
already published: handing out the stored noisy answer is post-processing and costs
nothing, while a fresh answer is a new release (and averaging fresh answers is how noise is
peeled off). So a release is named by everything that fixes *which* answer it is, all of
it public and fixed before the data is read:

* where it is made: the DAG, the task and its map index (from the task's own context,
  never from an argument), and the name of the callable that computes its answer;
* the data it reads: the run's data interval, and the one window it was told to charge
  if it was (a sensor's window is the window it found room in, not the data's: two runs
  over different data that charge one window are two releases);
* how it is released: the mechanism charged and its parameters, the noise kind, the
  lattice, the answer rule (bounds, cells, NaN value, integer), the sensitivities, the
  count, the tenant and query type;
* whom it covers: a digest of its (subject, window) keys, or of its registered cohorts
  in their windows.

The run id and try number are not part of it: they change on every re-run. Neither are the
callable's code (the ledger never sees it) nor its arguments, which may be the data itself
(an upstream task's rows): the decision to reuse never looks at the data. A release whose
code changed, or a mapped release whose inputs moved to other map indexes, is made again
with ``refresh=True``. The digest of the canonical document is the identity;
the document itself is stored with the release, so an administrator can read what it names
(it holds digests of cohorts, never a subject).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from dp_budget_provider.ledger.accounts.covered import Covered, covered
from dp_budget_provider.ledger.storage import history


@dataclass(frozen=True)
class ReleaseSlot:
    """Where a release is made and what data it reads: the part of its identity that the
    task's context gives (the rest is the release's own declaration and keys).

    ``period`` is ``("data_interval", start, end)`` (ISO 8601, UTC), or for a release told
    which window to charge ``("window", w, start, end)``;
    ``query`` names the code that computes the answer (:func:`query_digest`).
    """

    dag: str
    task: str
    map_index: int
    period: tuple[str, ...]
    query: str = ""

    def __post_init__(self) -> None:
        for part in ("dag", "task"):
            value = getattr(self, part)
            if not isinstance(value, str) or not value:
                raise ValueError(f"a release's {part} id is a non-empty string, got {value!r}")
        if isinstance(self.map_index, bool) or not isinstance(self.map_index, int):
            raise ValueError(f"a map index is an integer, got {self.map_index!r}")
        if not self.period or self.period[0] not in ("data_interval", "window"):  # see of()
            raise ValueError(
                f"a release's period is a data interval or a window, got {self.period!r}"
            )

    @classmethod
    def over_interval(
        cls,
        dag: str,
        task: str,
        map_index: int,
        start: datetime,
        end: datetime,
        query: str = "",
    ) -> ReleaseSlot:
        """A release over the data from ``start`` to ``end`` (aware datetimes)."""
        return cls(dag, task, map_index, ("data_interval", _utc(start), _utc(end)), query)

    @classmethod
    def in_window(
        cls,
        dag: str,
        task: str,
        map_index: int,
        window: str,
        start: datetime,
        end: datetime,
        query: str = "",
    ) -> ReleaseSlot:
        """A release over the data from ``start`` to ``end`` told to charge ``window``."""
        return cls(dag, task, map_index, ("window", window, _utc(start), _utc(end)), query)


@dataclass(frozen=True)
class ReleaseIdentity:
    """A release's identity: its canonical ``document`` and the ``digest`` that names it."""

    document: Mapping[str, Any]
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "digest", identity_digest(self.text))

    @property
    def text(self) -> str:
        """The document as canonical JSON (what the digest is of, and what is stored)."""
        return history.canonical_json(dict(self.document))

    @property
    def dag(self) -> str:
        """The DAG that makes the release (a gate serves only its own DAG's releases)."""
        return str(self.document["dag"])

    @classmethod
    def of(cls, slot: ReleaseSlot, release: Mapping[str, Any], keys: Covered) -> ReleaseIdentity:
        """The identity of the release ``release`` (its declaration and the mechanism it
        charges, plain JSON values) made at ``slot`` over ``keys``."""
        return cls(
            {
                "dag": slot.dag,
                "task": slot.task,
                "map_index": slot.map_index,
                "period": list(slot.period),
                "query": slot.query,
                "release": dict(release),
                "covers": covered_digest(keys),
            }
        )


def query_digest(callable_name: str) -> str:
    """A digest naming the code that computes a release's answer (``module.qualname``)."""
    return identity_digest(history.canonical_json(["callable", callable_name]))


def identity_digest(text: str) -> str:
    """The identity named by a document's canonical JSON."""
    return hashlib.sha256(text.encode()).hexdigest()


def covered_digest(keys: Covered) -> str:
    """A digest of whom a release covers: its (subject, window) keys in lock order, or its
    registered cohorts (by their digests) in their query types and windows."""
    plain, cohorts = covered(keys)
    if cohorts:
        named = sorted((c.tenant, c.cohort.digest, c.query_type, c.window) for c in cohorts)
        return "cohorts:" + identity_digest(history.canonical_json([list(c) for c in named]))
    return "keys:" + history.keys_digest(plain)


def _utc(moment: datetime) -> str:
    if not isinstance(moment, datetime) or moment.utcoffset() is None:
        raise ValueError(f"a data interval's bounds are aware datetimes, got {moment!r}")
    return moment.astimezone(timezone.utc).isoformat()
