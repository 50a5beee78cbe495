"""The history's entries as typed, frozen records: one class per action.

An entry's payload is the part of it that only its action explains (the other parts,
its time, actor, reservation and key, are columns every entry has). Each kind of entry
is a frozen dataclass here, which says what its payload holds, once: every writer builds
the record and appends it (``Journal.append``), and verify's replay parses each stored
payload once (:meth:`Entry.from_payload`) and applies the record. The chain links the
canonical JSON of every payload (``history.link_prefix``), so :meth:`Record.payload`
makes exactly the dict the writers made before these records existed, byte for byte once
canonical, and a history any earlier version wrote parses.

Stability rules. A payload is kept forever in a chain nobody may rewrite, and read by
every later version's verify, so the kinds are kept the way dp_accounting keeps its
``DpEvent`` classes:

* a kind, and a field of one, is never removed or renamed: a history holding it must
  still parse, and mean what it meant;
* a field added to a kind is optional, with a default that means what entries written
  before it meant: a reset without ``kept`` kept nothing, a reap without
  ``lease_expires_at`` held no lease, a charge without ``cohorts`` was made before spend
  classes. So an older payload parses into a record of the same meaning; its
  :meth:`~Record.payload` is this version's form of it, never needed to check it (the
  chain covers the bytes as stored, not a payload made again);
* the meaning of a field never changes: a new meaning is a new field (or a new kind),
  so a verifier never judges an old entry by a rule it was not written under;
* a field this version does not know is ignored when reading (a later version's
  optional field), and a kind it does not know is verify's problem to report.

How a record is written and read, and what reading refuses, is :mod:`payloads`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.accounts.spend import Spend
from dp_budget_provider.ledger.storage.payloads import (
    Entry,
    ListRecord,
    Record,
    named,
    null_written,
    read_items,
    read_object,
    read_value,
)
from dp_budget_provider.ledger.windows.calendar import WindowCalendar
from dp_budget_provider.ledger.windows.policy import DEFAULT_GRACE, Policy
from dp_budget_provider.ledger.windows.shares import Share

# ---------------------------------------------------------------------- what a charge records


@dataclass(frozen=True, kw_only=True)
class Split(ListRecord):
    """An account of the window that the cohort covers in part: ``moved`` of its subjects
    go to a new account ``child``, a copy of its spend, which the open reservations
    holding the parent (``carried``, their ids) hold too. Written as a list: [parent,
    child, moved, carried] (before splits carried reservations: the first three, which
    carried none)."""

    parent: str
    child: str
    moved: int
    carried: tuple[str, ...] = ()

    def as_list(self) -> list[Any]:
        """The split as its refinement lists it."""
        return [self.parent, self.child, self.moved, list(self.carried)]

    @classmethod
    def read(cls, payload: Any) -> Split:
        items = read_items(payload, 3, 4)
        return cls(
            parent=read_value(0, str, items[0]),
            child=read_value(1, str, items[1]),
            moved=read_value(2, int, items[2]),
            carried=read_value(3, tuple[str, ...], items[3]) if len(items) > 3 else (),
        )


@dataclass(frozen=True, kw_only=True)
class NewClass(ListRecord):
    """The account made for the cohort's subjects the window had none for, of ``size``
    subjects; ``refers``: it is all of the cohort (it covered none of the window's
    classes), whose members are its own (never written again). Written as a list:
    [label, size], with "cohort" after them when it refers."""

    label: str
    size: int
    refers: bool = False

    def as_list(self) -> list[Any]:
        """The new account as its refinement lists it."""
        return [self.label, self.size, *(["cohort"] if self.refers else [])]

    @classmethod
    def read(cls, payload: Any) -> NewClass:
        items = read_items(payload, 2, 3)
        if items[2:] not in ([], ["cohort"]):
            raise ValueError(f"its members are {items[2]!r}, not the cohort's")
        return cls(
            label=read_value(0, str, items[0]),
            size=read_value(1, int, items[1]),
            refers=len(items) > 2,
        )


@dataclass(frozen=True, kw_only=True)
class Refinement(Record):
    """How a cohort new to a window refined the window's classes: the accounts it
    covers wholly (``kept``), those it covers in part (``split``), and the one made for
    the subjects the window had no account for (``new``, if any)."""

    kept: tuple[str, ...]
    split: tuple[Split, ...]
    new: NewClass | None


@dataclass(frozen=True, kw_only=True)
class ChargedCohort(Record):
    """One cohort (by digest) as a charge covers it in one (tenant, query type, window):
    the accounts it is charged to (its listing there, in label order), and how the
    window's classes were refined for it (None: it was listed there already)."""

    tenant: str
    query_type: str
    window: str
    cohort: str
    size: int
    accounts: tuple[str, ...]
    refined: Refinement | None


# ---------------------------------------------------------------------- the ledger's acts


@dataclass(frozen=True, kw_only=True)
class CreateEntry(Entry):
    """The ledger created: what it is fixed with for its whole life. The first entry."""

    action: ClassVar[str] = "create"
    delta: float
    orders: tuple[float, ...]
    conversion: str
    # None: created before the history had chains (the configuration holds the number
    # the upgrade that made them gave it).
    chains: int | None = None
    chain_key_id: str | None = null_written()  # None: unkeyed
    admin_key: str | None = None  # the administrator's public key, when created with one


@dataclass(frozen=True, kw_only=True)
class PolicyEntry(Entry):
    """A scope's policy created or replaced, signed by the administrator (``signature``,
    once the ledger has one).

    Its payload is the policy's record (:meth:`Policy.as_record`) with the calendar as its
    spec; older entries read as they were written: no calendar is the default one (a bare
    calendar kind takes ``calendar_length_seconds``), no compliance clause an empty one,
    no grace period the default grace, no shares an undivided cap.
    """

    action: ClassVar[str] = "policy"
    policy: Policy
    signature: str | None = None

    def payload(self) -> dict[str, Any]:
        """The policy's record, its calendar as a spec, and its signature if signed."""
        written = {**self.policy.as_record(), "calendar": self.policy.calendar.to_spec()}
        if self.signature is not None:
            written["signature"] = self.signature
        return written

    @classmethod
    def read(cls, payload: Any) -> PolicyEntry:
        found = read_object(payload)
        calendar = found.get("calendar") or {}
        if isinstance(calendar, str):
            calendar = {"kind": calendar, "length_seconds": found.get("calendar_length_seconds")}
        calendar = read_value("calendar", dict, calendar)
        policy = Policy(
            cap_epsilon=found["cap_epsilon"],
            warn_fraction=found["warn_fraction"],
            tenant=found["tenant"],
            query_type=found["query_type"],
            calendar=WindowCalendar(
                calendar.get("kind", "iso_week"),
                calendar.get("length_seconds"),
                calendar.get("span", 1),
            ),
            min_window=timedelta(seconds=found["min_window_seconds"]),
            compliance_clause=found.get("compliance_clause", ""),
            grace=timedelta(seconds=found.get("grace_seconds", DEFAULT_GRACE.total_seconds())),
            filter_order=found.get("filter_order"),
            shares=tuple(
                Share.from_record(share)
                for share in read_value("shares", list, found.get("shares", []))
            ),
        )
        signature = read_value("signature", str | None, found.get("signature"))
        return cls(policy=policy, signature=signature)


@dataclass(frozen=True, kw_only=True)
class AdminKeyEntry(Entry):
    """The ledger's administrator key recorded (once, trust on first use)."""

    action: ClassVar[str] = "admin-key"
    admin_key: str


@dataclass(frozen=True, kw_only=True)
class AdoptKeyEntry(Entry):
    """The history keyed from here on with the key ``chain_key_id`` names, sealing every
    chain head as it stood, (chain, seq, link) each; signed by the administrator (None:
    adopted before administrators)."""

    action: ClassVar[str] = "adopt-key"
    chain_key_id: str
    heads: tuple[tuple[int, int, str], ...]
    signature: str | None = None


@dataclass(frozen=True, kw_only=True)
class QuarantineEntry(Entry):
    """A verify failed: nothing is released until the administrator clears it. ``epoch``
    counts the ledger's quarantines (None: before they were counted, the count so far)."""

    action: ClassVar[str] = "quarantine"
    reason: str
    problems: tuple[str, ...]
    epoch: int | None = None


@dataclass(frozen=True, kw_only=True)
class UnquarantineEntry(Entry):
    """A quarantine cleared, with what was found; the quarantine it lifted (its time,
    reason and ``epoch``) and the administrator's signature over that epoch (None for
    either: cleared before they were recorded)."""

    action: ClassVar[str] = "unquarantine"
    reason: str
    quarantined_at: str
    quarantine_reason: str | None
    epoch: int | None = None
    signature: str | None = None


# ---------------------------------------------------------------------- the charges


@dataclass(frozen=True, kw_only=True)
class RefiningEntry(Entry):
    """A charge that refines the windows' classes for its subjects first: ``cohorts``
    records, per window, the cohort it charges and the refinement (None: charged before
    spend classes, to its keys as they were)."""

    cohorts: tuple[ChargedCohort, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class ReserveEntry(RefiningEntry):
    """A release's cost held on its accounts (``key_count`` of them, whose canonical list
    ``keys_digest`` binds) until its commit, release or reap.

    ``prospective_epsilon`` is the largest epsilon an account would reach, and
    ``token_hash`` what the ledger keeps of the reservation's token (None: a reservation
    before tokens, or one the server decided, which recorded the ``prospective`` spend
    instead of its epsilon).
    """

    action: ClassVar[str] = "reserve"
    attempt_id: str
    # The mechanism's spec (Mechanism.to_spec), as written: verify prices it, and a spec
    # it cannot read is that entry's problem where it does.
    mechanism: dict[str, Any]
    count: int
    cost: Spend
    key_count: int
    keys_digest: str
    prospective_epsilon: float | None = None
    token_hash: str | None = None
    prospective: Spend | None = None


@dataclass(frozen=True, kw_only=True)
class StoredMark(Record):
    """A release's stored answer as its commit records it: the release's ``identity``, the
    ``digest`` binding its identity document, answer and receipt (``dp_stored_releases``),
    and the reservation whose answer for the identity it ``replaces`` (None: none was
    kept; written as null)."""

    identity: str
    digest: str
    replaces: str | None = null_written()


@dataclass(frozen=True, kw_only=True)
class CommitEntry(Entry):
    """A reservation charged: its release happened. Its cost moves from pending to the
    committed spend of its keys (``key_count``, in lock order, bound by
    ``keys_digest``). ``stored``: the answer kept for re-runs of the same release (None:
    none kept: a reap, a failed attempt, an answer too large, or a commit before stored
    releases)."""

    action: ClassVar[str] = "commit"
    attempt_id: str
    cost: Spend
    count: int
    key_count: int
    keys_digest: str
    stored: StoredMark | None = None


@dataclass(frozen=True, kw_only=True)
class ReapEntry(CommitEntry):
    """A reservation charged as a commit because its attempt stopped: ``reason`` says why
    (its lease ran out, or it was open too long), ``lease_expires_at`` the lease it held
    (None: none, or reaped before leases)."""

    action: ClassVar[str] = "reap"
    reason: str
    lease_expires_at: str | None = null_written()


@dataclass(frozen=True, kw_only=True)
class ReleaseEntry(Entry):
    """A reservation dropped, charging nothing: its release never touched the data."""

    action: ClassVar[str] = "release"
    attempt_id: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class ReuseEntry(Entry):
    """A re-run of a release handed the stored answer of the release that charged
    ``reservation`` (its commit recorded the answer as ``digest``), charging nothing:
    handing out an answer already published is post-processing."""

    action: ClassVar[str] = "reuse"
    attempt_id: str
    identity: str
    reservation: str
    digest: str


@dataclass(frozen=True, kw_only=True)
class CorrectionEntry(RefiningEntry):
    """A release the ledger missed, charged afterwards to the entry's key (never an edit,
    and never a refund)."""

    action: ClassVar[str] = "correction"
    mechanism: dict[str, Any]  # its spec, as a reserve's
    count: int
    cost: Spend
    reason: str
    # The subject's totals (wider scopes' query types) the same correction charged, each
    # in an entry of its own; on the key's own entry, where a wider cap applied.
    totals: tuple[str, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class RescopeEntry(RefiningEntry):
    """A key's releases re-classified as the entry's key's query type: the spend
    ``carried`` from ``source`` (written as "from") is added there, and ``source`` is
    never charged again. ``subject`` names whose accounts they are (None: before spend
    classes, when the keys named the subject themselves)."""

    action: ClassVar[str] = "rescope"
    source: LedgerKey = named("from")
    carried: Spend
    reason: str
    subject: str | None = None


@dataclass(frozen=True, kw_only=True)
class ResetEntry(Entry):
    """A closed window reset: ``accounts`` accounts (holding ``subjects`` subjects)
    dropped from the live ones, and the scopes ``sealed`` (tenant, query type) never
    charged again; ``kept``: their final spend moved to the sealed accounts. Older
    resets: no ``sealed`` reset every scope of the window and let it start again from
    zero, no ``kept`` kept nothing, ``closed_at`` said when they ran."""

    action: ClassVar[str] = "reset"
    window: str
    accounts: int
    subjects: int | None = None
    sealed: tuple[tuple[str, str], ...] | None = None
    kept: bool = False
    closed_at: str | None = None


ENTRY_KINDS: dict[str, type[Entry]] = {
    kind.action: kind
    for kind in (
        CreateEntry,
        PolicyEntry,
        AdminKeyEntry,
        AdoptKeyEntry,
        QuarantineEntry,
        UnquarantineEntry,
        ReserveEntry,
        CommitEntry,
        ReapEntry,
        ReleaseEntry,
        ReuseEntry,
        CorrectionEntry,
        RescopeEntry,
        ResetEntry,
    )
}
"""Every kind of entry, by the action it names."""
