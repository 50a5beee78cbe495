"""The append-only, hash-chained audit history.

Each entry's hash is sha256 over the previous hash and the entry's canonical JSON, so
an edited, deleted, inserted or reordered entry breaks every later link. The chain head
row is locked as the last step of each write transaction: entries are appended in
commit order with consecutive sequence numbers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, insert, select, update

from dp_budget_provider.ledger.keys import LedgerKey
from dp_budget_provider.ledger.schema import ChainHead, HistoryEntry

GENESIS = "0" * 64


def canonical_json(value: Any) -> str:
    """Deterministic JSON (sorted keys, no spaces; floats by repr, so they round-trip)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def keys_digest(keys: Iterable[LedgerKey]) -> str:
    """sha256 over the canonical key list, binding a reservation to exactly its keys."""
    digest = hashlib.sha256()
    for key in keys:
        digest.update(canonical_json(key.as_dict()).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def entry_hash(prev_hash: str, seq: int, at: str, action: str, actor: str, body: dict) -> str:
    """The link hash of one entry."""
    content = canonical_json({"seq": seq, "at": at, "action": action, "actor": actor, "body": body})
    return hashlib.sha256(f"{prev_hash}\n{content}".encode()).hexdigest()


def entry_body(row: Any) -> dict[str, Any]:
    """The hashed part of a stored row besides seq/at/action/actor."""
    return {
        "reservation_id": row.reservation_id,
        "key": None
        if row.tenant is None
        else [row.tenant, row.subject, row.query_type, row.window],
        "payload": row.payload,
    }


def append(
    connection: Connection,
    *,
    at: str,
    action: str,
    actor: str,
    payload: dict[str, Any],
    reservation_id: str | None = None,
    key: LedgerKey | None = None,
) -> int:
    """Append one entry, locking the chain head (call last in the transaction); returns seq."""
    head = connection.execute(
        select(ChainHead.seq, ChainHead.hash).where(ChainHead.id == 1).with_for_update()
    ).one()
    seq = head.seq + 1
    row = {
        "seq": seq,
        "at": at,
        "action": action,
        "actor": actor,
        "reservation_id": reservation_id,
        "tenant": key.tenant if key else None,
        "subject": key.subject if key else None,
        "query_type": key.query_type if key else None,
        "window": key.window if key else None,
        "payload": canonical_json(payload),
        "prev_hash": head.hash,
    }
    body = entry_body(_Row(row))
    row["hash"] = entry_hash(head.hash, seq, at, action, actor, body)
    connection.execute(insert(HistoryEntry), [row])
    connection.execute(update(ChainHead).where(ChainHead.id == 1).values(seq=seq, hash=row["hash"]))
    return seq


def entry_record(row: Any) -> dict[str, Any]:
    """A stored entry as plain JSON values (API, CLI, reports)."""
    key = None
    if row.tenant is not None:
        key = {
            "tenant": row.tenant,
            "subject": row.subject,
            "query_type": row.query_type,
            "window": row.window,
        }
    return {
        "seq": row.seq,
        "at": row.at,
        "action": row.action,
        "actor": row.actor,
        "reservation_id": row.reservation_id,
        "key": key,
        "payload": json.loads(row.payload),
        "hash": row.hash,
    }


class _Row:
    """Attribute access over a dict, so entry_body reads fresh and stored rows alike."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)


@dataclass(frozen=True)
class ChainProblem:
    """Where the chain is broken and how."""

    seq: int
    problem: str


def chain_problems(connection: Connection, batch: int = 5000) -> Iterator[ChainProblem]:
    """Walk the whole history in order and report every broken link."""
    expected_seq, prev = 1, GENESIS
    result = connection.execution_options(yield_per=batch).execute(
        select(HistoryEntry).order_by(HistoryEntry.seq)
    )
    for row in result:
        if row.seq != expected_seq:
            yield ChainProblem(row.seq, f"expected entry {expected_seq}: entries missing or moved")
        if row.prev_hash != prev:
            yield ChainProblem(row.seq, "previous-hash link does not match the preceding entry")
        recomputed = entry_hash(
            row.prev_hash, row.seq, row.at, row.action, row.actor, entry_body(row)
        )
        if recomputed != row.hash:
            yield ChainProblem(row.seq, "content does not match its hash (entry edited)")
        expected_seq, prev = row.seq + 1, row.hash
    head = connection.execute(select(ChainHead.seq, ChainHead.hash).where(ChainHead.id == 1)).one()
    if head.seq != expected_seq - 1 or head.hash != prev:
        yield ChainProblem(head.seq, "chain head does not match the last entry (entries removed)")
