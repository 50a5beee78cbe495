"""Cohorts and spend classes: which accounts a charge over many subjects goes to.

A release charges the same cost to every subject it covers, so subjects that every
release so far covered all together or not at all hold the same spend: they form a
*class*, and one account holds its spend. A charge over a set of subjects is made to
accounts, never to subjects one by one:

* the subjects of each (tenant, query type, window) form a *cohort*, stored once and
  named by its content (the sha256 of its sorted canonical ids);
* a cohort charged in that window before is charged through the accounts listed for
  it there (``dp_cohort_accounts``): the work is one row per class, whatever the size;
* a cohort new to the window *refines* the window's classes: an account it covers
  wholly is kept, one it covers in part splits in two (the covered part gets a new
  account holding a copy of the parent's spend), and subjects the window has never
  seen form one new account. Every cohort that listed a split account lists both parts,
  so each listing stays an exact partition of its cohort;
* a cohort that covers none of the window's classes makes one class of all its subjects,
  which *refers* to the cohort (``dp_accounts.cohort_id``): its members are the cohort's,
  never written again, so the first release over a new population costs the cohort and a
  few rows. A split of such a class lists its members in ``dp_members`` first
  (``memberships`` reads both).

The refinement happens inside the charge's transaction, with the window locked
exclusively, and is recorded in the charge's history entry (``refined``), so ``verify``
can replay every account's spend and prove every subject's membership. A split account's
open reservations are carried to its new part: the part copies the pending spend, and
each of those reservations holds it as one more key, so its commit (or reap) charges
both parts and its release frees both.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, select

from dp_budget_provider.ledger.accounts.keys import LedgerKey, canonical_part, keys_for
from dp_budget_provider.ledger.accounts.memberships import REFERRING, least_member
from dp_budget_provider.ledger.errors import LedgerCorrupt
from dp_budget_provider.ledger.storage import pipeline, statements
from dp_budget_provider.ledger.storage.entries import ChargedCohort, NewClass, Refinement, Split
from dp_budget_provider.ledger.storage.schema import Account
from dp_budget_provider.ledger.storage.statements import newline_joined

# An account label: never a canonical subject, which is case-folded (no upper case).
LABEL_PREFIX = "Class-"
_LABEL = re.compile(re.escape(LABEL_PREFIX) + "[0-9a-f]{12}")

Scope = tuple[str, str, str]  # (tenant, query_type, window)


def is_label(subject: str) -> bool:
    """Whether an account's subject part is a class label (not a subject of its own)."""
    return subject.startswith(LABEL_PREFIX)


def account_key(tenant: str, label: str, query_type: str, window: str) -> LedgerKey:
    """The key of account ``label`` from parts as a person gives them (a URL, a command
    line): the label exactly as the ledger made it (canonicalising would lower-case it
    into a subject), the other parts canonical. ValueError for a malformed label."""
    if _LABEL.fullmatch(label) is None:
        raise ValueError(f"{label!r} is not an account label ({LABEL_PREFIX} and 12 hex digits)")
    return LedgerKey.from_canonical(
        canonical_part("tenant", tenant),
        label,
        canonical_part("query_type", query_type),
        canonical_part("window", window),
    )


def new_label() -> str:
    """A fresh account label (48 random bits: unique within a window in practice, and a
    collision is refused by the accounts' unique key, never merged)."""
    return LABEL_PREFIX + secrets.token_hex(6)


def cohort_digest(subjects: Sequence[str]) -> str:
    """The content address of a cohort: sha256 of its sorted ids, one per line."""
    return hashlib.sha256(newline_joined(sorted(subjects)).encode()).hexdigest()


_DIGEST = re.compile("[0-9a-f]{64}")


@dataclass(frozen=True)
class Cohort:
    """A handle on a registered set of subjects of one tenant (see
    :meth:`~dp_budget_provider.ledger.ledger.PrivacyBudgetLedger.cohort`).

    It names the cohort by content without holding its ids, so an upstream task can
    register the subjects once and hand this on (``as_dict`` through XCom): a release
    over it never ships or hashes the ids again, and a release over a cohort its window
    has seen costs one row per class, whatever its size. Made however it is (a caller
    may build one), it is canonical: the tenant as a key's, the digest 64 lower-case hex
    digits, the size a positive integer; anything else is a ValueError.
    """

    tenant: str
    digest: str
    size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenant", canonical_part("tenant", self.tenant))
        digest = self.digest.lower() if isinstance(self.digest, str) else self.digest
        if not isinstance(digest, str) or _DIGEST.fullmatch(digest) is None:
            raise ValueError(f"a cohort's digest is 64 hex digits, got {self.digest!r}")
        object.__setattr__(self, "digest", digest)
        size = self.size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"a cohort's size is a positive integer, got {size!r}")

    def in_window(self, query_type: str, window: str) -> CohortKeys:
        """The keys of the cohort's subjects in one (query type, window): what ``reserve``
        and ``budget_check`` take in place of a list of keys."""
        return CohortKeys(self, query_type, window)

    def as_dict(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "digest": self.digest, "size": self.size}

    @classmethod
    def from_dict(cls, value: Any) -> Cohort:
        """A handle from :meth:`as_dict` (what XCom hands a downstream task)."""
        if not isinstance(value, dict) or set(value) != {"tenant", "digest", "size"}:
            raise ValueError(f"a cohort is a mapping of tenant, digest and size, got {value!r}")
        return cls(value["tenant"], value["digest"], value["size"])


@dataclass(frozen=True)
class CohortKeys:
    """The keys of a registered cohort's subjects in one (query type, window); its parts
    canonical however it is made (a query type spelled two ways would be two budgets)."""

    cohort: Cohort
    query_type: str
    window: str

    def __post_init__(self) -> None:
        if not isinstance(self.cohort, Cohort):
            raise ValueError(f"CohortKeys takes a Cohort, got {type(self.cohort).__name__}")
        for part in ("query_type", "window"):
            object.__setattr__(self, part, canonical_part(part, getattr(self, part)))

    @property
    def tenant(self) -> str:
        return self.cohort.tenant


def is_cohort(subjects: object) -> bool:
    """Whether a release's subjects are a cohort handle (or its ``as_dict`` via XCom)."""
    return isinstance(subjects, Cohort) or (
        isinstance(subjects, dict) and set(subjects) == {"tenant", "digest", "size"}
    )


def covered_by(
    subjects: Any, query_type: str, windows: Sequence[str], tenant: str
) -> list[LedgerKey] | list[CohortKeys]:
    """What a release over ``subjects`` in ``windows`` charges: a cohort handle's keys in
    each window, or one key per subject and window (:func:`~.keys.keys_for`)."""
    if not is_cohort(subjects):
        return keys_for(subjects, query_type, windows, tenant=tenant)
    cohort = subjects if isinstance(subjects, Cohort) else Cohort.from_dict(subjects)
    if cohort.tenant != canonical_part("tenant", tenant):
        raise ValueError(
            f"the cohort was registered for tenant {cohort.tenant!r}, the release charges "
            f"tenant {tenant!r}"
        )
    return [cohort.in_window(query_type, window) for window in dict.fromkeys(windows)]


def subjects_in(covered: Sequence[LedgerKey] | Sequence[CohortKeys]) -> int:
    """How many (subject, window) pairs ``covered`` holds."""
    return sum(item.cohort.size if isinstance(item, CohortKeys) else 1 for item in covered)


@dataclass(frozen=True)
class CohortCharge:
    """One cohort as one charge covers it in one window: the accounts it is charged to,
    and how the window's classes were refined for it (None: known there already)."""

    scope: Scope
    cohort_id: int
    digest: str
    size: int
    accounts: tuple[str, ...]
    refined: Refinement | None = None

    def recorded(self) -> ChargedCohort:
        """The cohort as the charge's history entry records it."""
        tenant, query_type, window = self.scope
        return ChargedCohort(
            tenant=tenant,
            query_type=query_type,
            window=window,
            cohort=self.digest,
            size=self.size,
            accounts=self.accounts,
            refined=self.refined,
        )


@dataclass
class Charge:
    """The accounts a charge over subject keys goes to, in lock order, and its cohorts."""

    keys: list[LedgerKey]
    cohorts: list[CohortCharge] = field(default_factory=list)

    def recorded(self) -> tuple[ChargedCohort, ...]:
        """The cohorts as the charge's history entry records them."""
        return tuple(cohort.recorded() for cohort in self.cohorts)

    def link(self, pipe: pipeline.Pipeline, seq: int) -> None:
        """Record that history entry ``seq`` (this charge's) covered its cohorts."""
        for cohort in self.cohorts:
            _, query_type, window = cohort.scope
            pipe.send(
                'INSERT INTO dp_charge_cohorts (seq, cohort_id, query_type, "window") '
                "VALUES (%(seq)s, %(cohort)s, %(q)s, %(w)s)",
                {"seq": seq, "cohort": cohort.cohort_id, "q": query_type, "w": window},
            )

    def account_of(self, key: LedgerKey) -> LedgerKey:
        """The account of ``key``, a subject charged alone in its window (its class of one)."""
        scope = (key.tenant, key.query_type, key.window)
        for cohort in self.cohorts:
            if cohort.scope == scope and cohort.size == 1:
                return LedgerKey.from_canonical(
                    key.tenant, cohort.accounts[0], key.query_type, key.window
                )
        raise KeyError(key)


def accounts_for(
    pipe: pipeline.Pipeline,
    keys: Sequence[LedgerKey],
    now: str,
    cohorts: Sequence[CohortKeys] = (),
) -> Charge:
    """The accounts ``keys`` (subject keys, distinct, in key order) and ``cohorts``
    (registered cohorts in a window) are charged to.

    Registers each scope's cohort of listed keys if it is new, and refines the scope's
    classes if the cohort is new to it. The windows must already be locked exclusively
    (a scope's partition changes only under its window's lock). Returns account keys in
    key order.
    """
    by_scope: dict[Scope, list[str]] = {}
    for key in keys:
        by_scope.setdefault((key.tenant, key.query_type, key.window), []).append(key.subject)
    known: dict[Scope, Cohort] = {}
    for given in cohorts:
        scope = (given.tenant, given.query_type, given.window)
        if scope in by_scope or scope in known:
            raise ValueError(f"one release covers window {scope} with more than one cohort")
        known[scope] = given.cohort
    charge = Charge(keys=[])
    # Each scope's cohort, with its listing there, or what it covers of the scope's
    # classes (to refine them); a scope's refinement changes no other scope's.
    found: list[tuple[Scope, int, str, int, CohortCharge | None, dict[str, int]]] = []
    for scope in sorted({*by_scope, *known}):
        if scope in known:
            size = known[scope].size
            digest = known[scope].digest
            cohort_id = registered(pipe, known[scope])
        else:
            subjects = sorted(by_scope[scope])
            size = len(subjects)
            cohort_id, digest = register(pipe, scope[0], subjects, now)
        listed = _listed(pipe, scope, cohort_id, digest, size)
        covered = {} if listed is not None else covering(pipe, scope, cohort_id)
        found.append((scope, cohort_id, digest, size, listed, covered))
    lock_open_reservations(pipe, [(item[0], sorted(item[5])) for item in found])
    for scope, cohort_id, digest, size, listed, covered in found:
        cohort = listed or _refine(pipe, scope, cohort_id, digest, size, now, covered)
        charge.cohorts.append(cohort)
        tenant, query_type, window = scope
        charge.keys += [
            LedgerKey.from_canonical(tenant, label, query_type, window) for label in cohort.accounts
        ]
    charge.keys.sort(key=lambda k: (k.tenant, k.subject, k.query_type, k.window))
    return charge


def registered(pipe: pipeline.Pipeline, cohort: Cohort) -> int:
    """The id of a registered cohort; refused when the ledger holds no such cohort."""
    found = pipe.query(_COHORT, {"tenant": cohort.tenant, "digest": cohort.digest})
    return registered_id(cohort, tuple(found[0]) if found else None)


def registered_id(cohort: Cohort, stored: tuple[int, int] | None) -> int:
    """The id of ``cohort`` from its stored (id, size), None when the ledger has none. A
    handle naming no stored cohort, or another size, is the caller's mistake (a forged or
    mistyped handle, another ledger's): a ValueError, never retried. A stored cohort that
    disagrees with its members is verify's to find."""
    if stored is None or stored[1] != cohort.size:
        held = "" if stored is None else f" (it holds one of {stored[1]} subjects)"
        raise ValueError(
            f"no cohort {cohort.digest[:12]} of {cohort.size} subjects of tenant "
            f"{cohort.tenant!r} in this ledger{held}: register its subjects with "
            "ledger.cohort(...) first"
        )
    return int(stored[0])


_COHORT = "SELECT id, size FROM dp_cohorts WHERE tenant = %(tenant)s AND digest = %(digest)s"


def register(
    pipe: pipeline.Pipeline, tenant: str, subjects: Sequence[str], now: str
) -> tuple[int, str]:
    """The id and digest of the cohort of ``subjects`` (sorted canonical ids), stored with
    its members if new."""
    digest = cohort_digest(subjects)
    named = {"tenant": tenant, "digest": digest}
    found = pipe.query(
        "SELECT id, size FROM dp_cohorts WHERE tenant = %(tenant)s AND digest = %(digest)s", named
    )
    if not found:
        conflict = pipe.dialect.insert_once
        made = pipe.query(
            "INSERT INTO dp_cohorts (tenant, digest, size, created_at) "
            f"VALUES (%(tenant)s, %(digest)s, %(size)s, %(now)s) {conflict}RETURNING id",
            {**named, "size": len(subjects), "now": now},
        )
        if made:
            cohort_id = made[0][0]
            pipe.dialect.store_members(pipe, cohort_id, subjects)
            pipe.dialect.written(pipe, "dp_cohort_members", len(subjects))
            return cohort_id, digest
        # A concurrent charge stored it first (and committed: ON CONFLICT waited for it).
        found = pipe.query(
            "SELECT id, size FROM dp_cohorts WHERE tenant = %(tenant)s AND digest = %(digest)s",
            named,
        )
    cohort_id, size = found[0]
    if size != len(subjects):
        raise LedgerCorrupt(
            f"cohort {digest[:12]} of tenant {tenant!r} is stored with {size} subjects but its "
            f"digest names {len(subjects)}: dp_cohorts was edited"
        )
    return cohort_id, digest


def _listed(
    pipe: pipeline.Pipeline, scope: Scope, cohort_id: int, digest: str, size: int
) -> CohortCharge | None:
    """The accounts listed for a cohort in a window, None if it was never charged there."""
    _, query_type, window = scope
    rows = pipe.query(
        "SELECT account FROM dp_cohort_accounts WHERE cohort_id = %(cohort)s "
        'AND query_type = %(q)s AND "window" = %(w)s',
        {"cohort": cohort_id, "q": query_type, "w": window},
    )
    if not rows:
        return None
    return CohortCharge(scope, cohort_id, digest, size, tuple(sorted(row[0] for row in rows)))


def covering(pipe: pipeline.Pipeline, scope: Scope, cohort_id: int) -> dict[str, int]:
    """How many of a cohort's subjects each account of the scope holds (the accounts the
    cohort covers, wholly or in part), through both arms of membership (``memberships``)."""
    tenant, query_type, window = scope
    return dict(
        pipe.query(
            "SELECT m.account, count(*) FROM dp_cohort_members c JOIN dp_members m ON "
            'm.tenant = %(tenant)s AND m.query_type = %(q)s AND m."window" = %(w)s '
            "AND m.subject = c.subject WHERE c.cohort_id = %(cohort)s GROUP BY m.account "
            f"UNION ALL SELECT a.subject, count(*) FROM {REFERRING} JOIN dp_cohort_members c "
            "ON c.cohort_id = %(cohort)s AND c.subject = r.subject WHERE a.tenant = %(tenant)s "
            'AND a.query_type = %(q)s AND a."window" = %(w)s GROUP BY a.subject',
            {"tenant": tenant, "q": query_type, "w": window, "cohort": cohort_id},
        )
    )


def members_in(pipe: pipeline.Pipeline, account: LedgerKey, cohort_id: int) -> list[str]:
    """The subjects of a cohort that ``account`` (a class of its scope) holds, through
    both arms of membership."""
    return [
        row[0]
        for row in pipe.query(
            "SELECT m.subject FROM dp_cohort_members c JOIN dp_members m ON "
            'm.tenant = %(tenant)s AND m.query_type = %(q)s AND m."window" = %(w)s '
            "AND m.account = %(label)s AND m.subject = c.subject WHERE c.cohort_id = %(cohort)s "
            f"UNION ALL SELECT r.subject FROM {REFERRING} JOIN dp_cohort_members c "
            "ON c.cohort_id = %(cohort)s AND c.subject = r.subject WHERE a.tenant = %(tenant)s "
            'AND a.query_type = %(q)s AND a."window" = %(w)s AND a.subject = %(label)s',
            {
                "tenant": account.tenant,
                "q": account.query_type,
                "w": account.window,
                "label": account.subject,
                "cohort": cohort_id,
            },
        )
    ]


def cohort_members(pipe: pipeline.Pipeline, cohort_id: int) -> list[str]:
    """A registered cohort's subjects (in no particular order)."""
    return [
        row[0]
        for row in pipe.query(
            "SELECT subject FROM dp_cohort_members WHERE cohort_id = %(cohort)s",
            {"cohort": cohort_id},
        )
    ]


def _refine(
    pipe: pipeline.Pipeline,
    scope: Scope,
    cohort_id: int,
    digest: str,
    size: int,
    now: str,
    covered: dict[str, int],
) -> CohortCharge:
    """Split the window's classes along a cohort new to it (see the module docstring);
    ``covered``: what it covers of them (:func:`_covered`), whose open reservations are
    locked already."""
    tenant, query_type, window = scope
    where = {"tenant": tenant, "q": query_type, "w": window, "cohort": cohort_id, "now": now}
    in_scope = 'tenant = %(tenant)s AND query_type = %(q)s AND "window" = %(w)s'
    kept: list[str] = []
    splits: list[Split] = []
    listed = 0  # members written to dp_members (of split classes that referred to a cohort)
    lock = pipe.dialect.row_lock
    labels = sorted(covered)
    for chunk in statements.chunks(labels):
        rows = pipe.query(
            f"SELECT subject, size, open_reservations, cohort_id FROM dp_accounts WHERE {in_scope} "
            f"AND subject IN (SELECT s FROM {pipe.dialect.unpack()}) ORDER BY subject{lock}",
            {**where, "subjects": pipe.dialect.subjects_param(chunk)},
        )
        if len(rows) != len(chunk):
            raise LedgerCorrupt(
                f"{len(chunk) - len(rows)} account(s) named by dp_members of window {window!r} "
                f"(tenant {tenant!r}, query type {query_type!r}) do not exist"
            )
        for label, held, open_reservations, referred in rows:
            moved = covered[label]
            if moved == held:
                kept.append(label)
                continue
            if moved > held:
                raise LedgerCorrupt(f"account {label!r} holds {held} subjects but {moved} name it")
            child = new_label()
            carried = _carry(pipe, scope, label, child) if open_reservations else []
            splits.append(Split(parent=label, child=child, moved=moved, carried=tuple(carried)))
            _split(pipe, where, in_scope, label, child, moved, referred)
            listed += held if referred is not None else 0
    pipe.dialect.written(pipe, "dp_members", listed)
    new: NewClass | None = None
    fresh = size - sum(covered.values())
    if fresh:
        label = new_label()
        # A cohort that covers none of the window's classes makes one class of all its
        # subjects, which refers to the cohort: its members are not written again.
        referring = not covered
        new = NewClass(label=label, size=fresh, refers=referring)
        pipe.query(
            'INSERT INTO dp_accounts (tenant, subject, query_type, "window", rho, residual, '
            "gaussian_mu2, releases, open_reservations, pending_rho, pending_residual, "
            "pending_mu2, pending_others, updated_at, size, cohort_id) VALUES (%(tenant)s, "
            "%(label)s, %(q)s, %(w)s, 0, NULL, 0, 0, 0, 0, NULL, 0, 0, %(now)s, %(size)s, "
            "%(referred)s)",
            {**where, "label": label, "size": fresh, "referred": cohort_id if referring else None},
        )
        if not referring:
            # The cohort's subjects the window has no account for, as a set difference
            # (a hash or a merge: a NOT EXISTS was planned as a nested loop over the
            # window's members without statistics, 27 s for 10^5 new beside 10^4).
            pipe.query(
                'INSERT INTO dp_members (tenant, query_type, "window", subject, account) '
                "SELECT %(tenant)s, %(q)s, %(w)s, f.subject, %(label)s FROM (SELECT c.subject "
                "FROM dp_cohort_members c WHERE c.cohort_id = %(cohort)s EXCEPT SELECT "
                "m.subject FROM dp_members m JOIN dp_cohort_members h ON h.subject = m.subject "
                "AND h.cohort_id = %(cohort)s WHERE m.tenant = %(tenant)s AND m.query_type = "
                '%(q)s AND m."window" = %(w)s EXCEPT SELECT r.subject FROM '
                f"{REFERRING} JOIN dp_cohort_members h ON h.subject = r.subject AND "
                "h.cohort_id = %(cohort)s WHERE a.tenant = %(tenant)s AND a.query_type = %(q)s "
                'AND a."window" = %(w)s) f',
                {**where, "label": label},
            )
            pipe.dialect.written(pipe, "dp_members", fresh)
    accounts = sorted(kept + [split.child for split in splits] + ([new.label] if new else []))
    for label in accounts:
        pipe.query(
            'INSERT INTO dp_cohort_accounts (cohort_id, query_type, "window", account) '
            "VALUES (%(cohort)s, %(q)s, %(w)s, %(label)s)",
            {**where, "label": label},
        )
    refined = Refinement(kept=tuple(sorted(kept)), split=tuple(splits), new=new)
    return CohortCharge(scope, cohort_id, digest, size, tuple(accounts), refined)


def _split(
    pipe: pipeline.Pipeline,
    where: dict[str, Any],
    in_scope: str,
    parent: str,
    child: str,
    moved: int,
    referred: int | None,
) -> None:
    """Move a cohort's members of ``parent`` to a new account ``child`` holding a copy of
    the parent's committed and pending spend, and list the child wherever the parent is
    listed. A parent that refers to its cohort (``referred``) has its members written
    now, each straight to its part: its parts are no cohort's members."""
    named = {**where, "parent": parent, "child": child, "moved": moved, "referred": referred}
    pipe.query(
        'INSERT INTO dp_accounts (tenant, subject, query_type, "window", rho, residual, '
        "gaussian_mu2, releases, open_reservations, pending_rho, pending_residual, pending_mu2, "
        "pending_others, updated_at, rescoped_to, size) SELECT tenant, %(child)s, query_type, "
        '"window", rho, residual, gaussian_mu2, releases, open_reservations, pending_rho, '
        "pending_residual, pending_mu2, pending_others, %(now)s, rescoped_to, %(moved)s "
        f"FROM dp_accounts WHERE {in_scope} AND subject = %(parent)s",
        named,
    )
    pipe.query(
        f"UPDATE dp_accounts SET size = size - %(moved)s, cohort_id = NULL WHERE {in_scope} "
        "AND subject = %(parent)s",
        named,
    )
    if referred is None:
        pipe.query(
            f"UPDATE dp_members SET account = %(child)s WHERE {in_scope} AND account = "
            "%(parent)s AND subject IN (SELECT subject FROM dp_cohort_members WHERE "
            "cohort_id = %(cohort)s)",
            named,
        )
    else:
        # One pass over the referred cohort beside the new one (both in subject order),
        # never an update of rows written in the same transaction (no statistics yet).
        pipe.query(
            'INSERT INTO dp_members (tenant, query_type, "window", subject, account) '
            "SELECT %(tenant)s, %(q)s, %(w)s, r.subject, CASE WHEN h.subject IS NULL THEN "
            "%(parent)s ELSE %(child)s END FROM dp_cohort_members r LEFT JOIN "
            "dp_cohort_members h ON h.cohort_id = %(cohort)s AND h.subject = r.subject "
            "WHERE r.cohort_id = %(referred)s",
            named,
        )
    pipe.query(
        'INSERT INTO dp_cohort_accounts (cohort_id, query_type, "window", account) '
        'SELECT l.cohort_id, l.query_type, l."window", %(child)s FROM dp_cohort_accounts l '
        'JOIN dp_cohorts c ON c.id = l.cohort_id WHERE l.query_type = %(q)s AND l."window" = %(w)s '
        "AND l.account = %(parent)s AND c.tenant = %(tenant)s",
        named,
    )


def lock_open_reservations(
    pipe: pipeline.Pipeline, covered: Sequence[tuple[Scope, Sequence[str]]]
) -> None:
    """Lock the open reservations holding any account a charge refines (``covered``:
    labels by scope) before any account, all of them at once, in id order.

    A commit, release or reap locks its reservation first and its accounts next; a split
    gives the reservation a key, so it takes the locks in the same order: a commit then
    either closes before the split (and is not carried) or waits and finds the new key.
    Two charges never share a window, but one reservation may hold accounts in windows
    of both: had each charge locked the reservations of one window after another, two
    could each hold one the other waits for. No reservation can open on these accounts
    meanwhile, nor gain a key: either needs their windows' locks, which the charge holds.
    """

    def held_by() -> set[str]:
        # Only PostgreSQL asks (SQLite's write lock holds every reservation). Driven from the
        # open reservations (a LATERAL with LIMIT is never flattened), not from every key row
        # of the accounts, which grows with the history (250 ms a release, stale statistics).
        held: set[str] = set()
        for (tenant, query_type, window), labels in covered:
            for chunk in statements.chunks(labels):
                held.update(
                    row[0]
                    for row in pipe.query(
                        "SELECT r.id FROM dp_reservations r CROSS JOIN LATERAL (SELECT 1 "
                        "FROM dp_reservation_keys k WHERE k.reservation_id = r.id "
                        "AND k.tenant = %(t)s AND k.query_type = %(q)s "
                        'AND k."window" = %(w)s '
                        f"AND k.subject IN (SELECT s FROM {pipe.dialect.unpack()}) LIMIT 1) "
                        "AS holding WHERE r.state = 'open'",
                        {
                            "t": tenant,
                            "q": query_type,
                            "w": window,
                            "subjects": pipe.dialect.subjects_param(chunk),
                        },
                    )
                )
        return held

    pipe.dialect.lock_reservations(pipe, held_by)


def _carry(pipe: pipeline.Pipeline, scope: Scope, parent: str, child: str) -> list[str]:
    """Give every open reservation holding ``parent`` the key ``child`` too; their ids."""
    tenant, query_type, window = scope
    named = {"t": tenant, "q": query_type, "w": window, "parent": parent, "child": child}
    held_by = (
        "FROM dp_reservation_keys k JOIN dp_reservations r ON r.id = k.reservation_id "
        "WHERE r.state = 'open' AND k.tenant = %(t)s AND k.subject = %(parent)s "
        'AND k.query_type = %(q)s AND k."window" = %(w)s'
    )
    carried = sorted(row[0] for row in pipe.query(f"SELECT k.reservation_id {held_by}", named))
    pipe.query(
        "INSERT INTO dp_reservation_keys "
        '(reservation_id, position, tenant, subject, query_type, "window") '
        "SELECT k.reservation_id, (SELECT max(n.position) + 1 FROM dp_reservation_keys n "
        "WHERE n.reservation_id = k.reservation_id), %(t)s, %(child)s, %(q)s, %(w)s "
        f"{held_by}",
        named,
    )
    return carried


def example_subject(connection: Connection, key: LedgerKey) -> LedgerKey:
    """The least subject of account ``key`` as a subject key (what messages and receipts
    name): the account itself when it is a class of one made before classes existed."""
    if not is_label(key.subject):
        return key
    subject = connection.execute(
        select(least_member()).where(
            Account.tenant == key.tenant,
            Account.subject == key.subject,
            Account.query_type == key.query_type,
            Account.window == key.window,
        )
    ).scalar_one_or_none()
    if subject is None:
        return key
    return LedgerKey.from_canonical(key.tenant, subject, key.query_type, key.window)
