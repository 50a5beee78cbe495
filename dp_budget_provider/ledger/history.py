"""The append-only, hash-chained audit history.

Each entry's hash is sha256 over the previous hash and the entry's canonical JSON, so
an edited, deleted, inserted or reordered entry breaks every later link. The chain head
row is locked as the last step of each write transaction: entries are appended in
commit order with consecutive sequence numbers.

The canonical JSON ends with the sequence number (``"seq"`` sorts last), so everything
before it, the *link prefix*, is known before the chain head is locked. On PostgreSQL
the server function ``dp_append`` locks the head, appends the number and hashes, so the
lock every writer needs is held inside the server only; SQLite (one writer at a time
anyway) links in Python. Both compute :func:`entry_hash`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

from sqlalchemy import Connection, bindparam, insert, select, update

from dp_budget_provider.ledger.keys import LedgerKey
from dp_budget_provider.ledger.schema import ChainHead, HistoryEntry

GENESIS = "0" * 64


def canonical_json(value: Any) -> str:
    """Deterministic JSON (sorted keys, no spaces; floats by repr, so they round-trip)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def keys_digest(keys: Iterable[LedgerKey]) -> str:
    """sha256 over the canonical key list, binding a reservation to exactly its keys.

    Each line is ``canonical_json(key.as_dict())``, written out directly (the parts'
    names in sorted order, each part JSON-encoded) because a release may hold 10^5 keys.
    """
    quote = encode_basestring_ascii
    text = "".join(
        f'{{"query_type":{quote(k.query_type)},"subject":{quote(k.subject)},'
        f'"tenant":{quote(k.tenant)},"window":{quote(k.window)}}}\n'
        for k in keys
    )
    return hashlib.sha256(text.encode()).hexdigest()


def link_prefix(at: str, action: str, actor: str, body: dict) -> str:
    """The entry's canonical JSON up to its sequence number (which sorts last)."""
    content = canonical_json({"at": at, "action": action, "actor": actor, "body": body})
    return content[:-1] + ',"seq":'


def link_hash(prev_hash: str, prefix: str, seq: int) -> str:
    """sha256 over the previous hash and the entry's canonical JSON (prefix + seq)."""
    return hashlib.sha256(f"{prev_hash}\n{prefix}{seq}}}".encode()).hexdigest()


def entry_hash(prev_hash: str, seq: int, at: str, action: str, actor: str, body: dict) -> str:
    """The link hash of one entry."""
    return link_hash(prev_hash, link_prefix(at, action, actor, body), seq)


def entry_body(row: Any) -> dict[str, Any]:
    """The hashed part of a stored row besides seq/at/action/actor."""
    return {
        "reservation_id": row.reservation_id,
        "key": None
        if row.tenant is None
        else [row.tenant, row.subject, row.query_type, row.window],
        "payload": row.payload,
    }


def entry_columns(
    *,
    at: str,
    action: str,
    actor: str,
    payload: dict[str, Any],
    reservation_id: str | None = None,
    key: LedgerKey | None = None,
) -> dict[str, Any]:
    """The stored columns of a new entry, except seq and the hashes, plus its link prefix."""
    row = {
        "at": at,
        "action": action,
        "actor": actor,
        "reservation_id": reservation_id,
        "tenant": key.tenant if key else None,
        "subject": key.subject if key else None,
        "query_type": key.query_type if key else None,
        "window": key.window if key else None,
        "payload": canonical_json(payload),
    }
    row["link_prefix"] = link_prefix(at, action, actor, entry_body(_Row(row)))
    return row


# The server-side append (PostgreSQL, migration 0002); parameters from entry_columns.
SERVER_APPEND = (
    "SELECT dp_append(%(at)s, %(action)s, %(actor)s, %(reservation_id)s, %(tenant)s, "
    "%(subject)s, %(query_type)s, %(window)s, %(payload)s, %(link_prefix)s)"
)


# The client-side append's statements (SQLite), built once.
_HEAD_FOR_UPDATE = select(ChainHead.seq, ChainHead.hash).where(ChainHead.id == 1).with_for_update()
_INSERT_ENTRY = insert(HistoryEntry)
_MOVE_HEAD = (
    update(ChainHead)
    .where(ChainHead.id == 1)
    .values(seq=bindparam("new_seq"), hash=bindparam("new_hash"))
)


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
    row = entry_columns(
        at=at, action=action, actor=actor, payload=payload, reservation_id=reservation_id, key=key
    )
    if connection.dialect.name == "postgresql":
        return int(connection.exec_driver_sql(SERVER_APPEND, row).scalar_one())
    head = connection.execute(_HEAD_FOR_UPDATE).one()
    seq = head.seq + 1
    row["seq"] = seq
    row["prev_hash"] = head.hash
    row["hash"] = link_hash(head.hash, row.pop("link_prefix"), seq)
    connection.execute(_INSERT_ENTRY, row)
    connection.execute(_MOVE_HEAD, {"new_seq": seq, "new_hash": row["hash"]})
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
