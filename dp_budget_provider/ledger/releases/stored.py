"""Stored releases: the answer a re-run of a release is handed instead of a new one.

A committed release's noisy answer is kept per release identity (``identity``), in the
same transaction as the commit that charged it, and the commit's history entry records
the digest binding the identity's document, the answer and the receipt its task was
given. A later run of the same identity is handed that answer, charging nothing, and the
history records the reuse. A release made again with ``refresh=True`` is charged in full
and its answer replaces the stored one: the stored answer is always that of the identity's
last commit.

Before an answer is served it is proven against the history: the row's digests are made
again from its columns, the commit entry of its reservation must record that digest, and
that entry must carry the link its content makes (under the chain key, the MAC only the
ledger can make: then only an HMAC link is accepted). An answer edited in the database is
therefore never served: the reuse is refused, with the reason sealed for the
administrator, and verify names the row. A row put back to an earlier answer of its
identity (one a refresh replaced) proves as that earlier commit's, and is served once:
verify names the reuse, which must hand out the identity's last kept answer, and a row
deleted before a commit shows in that commit's mark, which names the answer it replaced.

A stored answer is at most :data:`MAX_STORED_BYTES` of canonical JSON (a 256 x 256
heatmap of floats fits); a larger one is released and charged as usual but not kept, so
each re-run of it is a new release, charged again (the task log says so).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, select, text

from dp_budget_provider.ledger.errors import LedgerCorrupt
from dp_budget_provider.ledger.releases.identity import ReleaseIdentity, identity_digest
from dp_budget_provider.ledger.storage import history
from dp_budget_provider.ledger.storage.entries import CommitEntry, StoredMark
from dp_budget_provider.ledger.storage.schema import HistoryEntry
from dp_budget_provider.ledger.storage.schema import StoredRelease as StoredRow

#: The largest answer a ledger keeps for re-runs, in bytes of canonical JSON.
MAX_STORED_BYTES = 1 << 20

_UPSERT = text(
    "INSERT INTO dp_stored_releases (identity, reservation_id, document, value, receipt, "
    "digest, stored_at) VALUES (:identity, :reservation_id, :document, :value, :receipt, "
    ":digest, :stored_at) ON CONFLICT (identity) DO UPDATE SET "
    "reservation_id = excluded.reservation_id, document = excluded.document, "
    "value = excluded.value, receipt = excluded.receipt, digest = excluded.digest, "
    "stored_at = excluded.stored_at"
)


def stored_digest(document: str, value: str, receipt: str) -> str:
    """What binds a stored release's three texts (as stored, canonical JSON)."""
    return hashlib.sha256(history.canonical_json([document, value, receipt]).encode()).hexdigest()


@dataclass
class Keep:
    """A release's answer to keep with its commit: its identity, its answer and the
    receipt its task was given, each as canonical JSON. ``stored`` is what its commit
    recorded once it kept it (None: not kept, as by a commit that found its reservation
    already charged, by a reap)."""

    identity: ReleaseIdentity
    value: str
    receipt: str
    stored: StoredMark | None = field(default=None, init=False)

    @classmethod
    def of(cls, identity: ReleaseIdentity, value: Any, receipt: dict[str, Any]) -> Keep | None:
        """The answer to keep, or None when it is larger than :data:`MAX_STORED_BYTES`
        (or not JSON: then it is kept by no one either)."""
        try:
            value_text = history.canonical_json(value)
        except (TypeError, ValueError):
            return None
        if len(value_text.encode()) > MAX_STORED_BYTES:
            return None
        return cls(identity, value_text, history.canonical_json(receipt))

    def store(self, connection: Connection, reservation_id: str, now: str) -> StoredMark:
        """Keep it as the identity's answer, replacing the one kept before, before the
        commit's entry is appended; what that entry records.

        Commits of one identity are serialised here (PostgreSQL: a transaction lock on the
        identity; SQLite holds its one write lock), so the answer each replaces, which its
        mark names, is the one the previous commit kept: a row deleted or rolled back
        before a commit shows as a mark that replaces another answer than the history's
        last (verify), and the row kept is always the one of the later entry.
        """
        digest = self.identity.digest
        if connection.dialect.name == "postgresql":
            connection.execute(
                text("SELECT pg_advisory_xact_lock(:k)"), {"k": int(digest[:15], 16)}
            )
        replaces = connection.execute(
            select(StoredRow.reservation_id).where(StoredRow.identity == digest)
        ).scalar()
        mark = StoredMark(
            identity=digest,
            digest=stored_digest(self.identity.text, self.value, self.receipt),
            replaces=replaces,
        )
        connection.execute(
            _UPSERT,
            {
                "identity": mark.identity,
                "reservation_id": reservation_id,
                "document": self.identity.text,
                "value": self.value,
                "receipt": self.receipt,
                "digest": mark.digest,
                "stored_at": now,
            },
        )
        self.stored = mark
        return mark


@dataclass(frozen=True)
class StoredAnswer:
    """A stored release as it is served: proven against the history."""

    identity: str
    reservation_id: str
    value: Any
    receipt: dict[str, Any]
    digest: str


def row_problem(row: Any) -> str | None:
    """What is wrong with a stored row on its own (its digests), None if nothing."""
    if identity_digest(row.document) != row.identity:
        return "its identity is not the digest of its document"
    if not hmac.compare_digest(stored_digest(row.document, row.value, row.receipt), row.digest):
        return "its digest is not that of its document, answer and receipt"
    return None


def mark_of(entry: Any) -> StoredMark | None:
    """The stored answer a commit entry records (None: none), LedgerCorrupt if unreadable."""
    return CommitEntry.from_payload(json.loads(entry.payload)).stored


def served(
    connection: Connection, identity: ReleaseIdentity, key: history.ChainKey
) -> StoredAnswer | None:
    """The stored answer of ``identity``, proven against its commit's history entry;
    None when the identity has none. :class:`LedgerCorrupt` when the row does not prove:
    it is never served."""
    # Locked: a commit keeping another answer for the identity waits, or is waited for.
    row = connection.execute(
        select(StoredRow).where(StoredRow.identity == identity.digest).with_for_update()
    ).one_or_none()
    if row is None:
        return None
    problem = row_problem(row) or _entry_problem(connection, row, key)
    if problem is not None:
        raise LedgerCorrupt(
            f"the stored answer of release {identity.digest} (reservation {row.reservation_id}) "
            f"is not served: {problem}; run `dp-budget verify`"
        )
    return StoredAnswer(
        row.identity, row.reservation_id, json.loads(row.value), json.loads(row.receipt), row.digest
    )


def _entry_problem(connection: Connection, row: Any, key: history.ChainKey) -> str | None:
    """What is wrong with the stored row against the commit entry of its reservation."""
    entries = connection.execute(
        select(HistoryEntry).where(
            HistoryEntry.reservation_id == row.reservation_id, HistoryEntry.action == "commit"
        )
    ).all()
    if len(entries) != 1:
        return f"its reservation has {len(entries)} commit entries, not one"
    (entry,) = entries
    mark = mark_of(entry)
    if mark is None or (mark.identity, mark.digest) != (row.identity, row.digest):
        return "its commit's history entry records another answer"
    # Under a chain key only its MAC proves the entry, whatever the database says of when
    # the history was keyed (an insider could say "never"): an answer kept before the
    # ledger was keyed is refused too (made again with refresh=True).
    if not history.link_holds(entry, key, 0 if key.keyed else None):
        return "its commit's history entry does not carry the link its content makes"
    return None
