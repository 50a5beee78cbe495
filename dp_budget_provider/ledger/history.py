"""The append-only, hash-chained audit history.

Each entry's hash is sha256 over the previous hash *on its chain* and the entry's
canonical JSON, so an edited, deleted, inserted or reordered entry breaks every later
link of its chain. The history is split into :data:`CHAINS` chains by key
(:func:`chain_of`): writers on different keys lock different chain heads, instead of
all queueing on one row. A chain's head row is locked as the last step of each write
transaction, so each chain is appended in commit order. ``seq`` numbers the whole
history (the order replays and pages use); it is hashed with the entry, rises along
every chain and follows the commit order of each account.

The canonical JSON ends with the sequence number (``"seq"`` sorts last), so everything
before it, the *link prefix*, is known before the chain head is locked. On PostgreSQL
the server function ``dp_append`` locks the head, appends the number and hashes, so the
lock every writer needs is held inside the server only; SQLite (one writer at a time
anyway) links in Python. Both compute :func:`entry_hash`.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

from sqlalchemy import Connection, Engine, bindparam, func, insert, select, text, update

from dp_budget_provider.ledger import database
from dp_budget_provider.ledger.errors import LedgerCorrupt
from dp_budget_provider.ledger.keys import LedgerKey
from dp_budget_provider.ledger.schema import ChainHead, HistoryEntry

GENESIS = "0" * 64
# Chains of a ledger made now (fixed per ledger in dp_ledger_config.chains).
CHAINS = 64
# The chain of entries about no key, or about a whole window.
KEYLESS_CHAIN = 1


def chain_of(key: LedgerKey | None, chains: int) -> int:
    """The chain (1..chains) an entry about ``key`` is linked on: a stable hash of the key.

    Any chain would do for integrity; spreading keys over chains is what lets writers
    on different keys link their entries without waiting for each other.
    """
    if key is None or chains <= 1:
        return KEYLESS_CHAIN
    text = "\x1f".join((key.tenant, key.subject, key.query_type, key.window))
    return zlib.crc32(text.encode()) % chains + 1


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
    chain: int,
    at: str,
    action: str,
    actor: str,
    payload: dict[str, Any],
    reservation_id: str | None = None,
    key: LedgerKey | None = None,
) -> dict[str, Any]:
    """The stored columns of a new entry, except seq and the hashes, plus its link prefix."""
    return _entry_row(
        chain=chain,
        at=at,
        action=action,
        actor=actor,
        payload_text=canonical_json(payload),
        reservation_id=reservation_id,
        key=key,
    )


def _entry_row(
    *,
    chain: int,
    at: str,
    action: str,
    actor: str,
    payload_text: str,
    reservation_id: str | None,
    key: LedgerKey | None,
) -> dict[str, Any]:
    row = {
        "chain": chain,
        "at": at,
        "action": action,
        "actor": actor,
        "reservation_id": reservation_id,
        "tenant": key.tenant if key else None,
        "subject": key.subject if key else None,
        "query_type": key.query_type if key else None,
        "window": key.window if key else None,
        "payload": payload_text,
    }
    row["link_prefix"] = link_prefix(at, action, actor, entry_body(_Row(row)))
    return row


# The server-side append (PostgreSQL, migration 0003); parameters from entry_columns.
SERVER_APPEND = (
    "SELECT dp_append(%(chain)s, %(at)s, %(action)s, %(actor)s, %(reservation_id)s, %(tenant)s, "
    "%(subject)s, %(query_type)s, %(window)s, %(payload)s, %(link_prefix)s)"
)


# The client-side append's statements (SQLite, one writer at a time), built once.
_HEAD_HASH = select(ChainHead.hash).where(ChainHead.id == bindparam("chain"))
_LAST_SEQ = select(func.coalesce(func.max(HistoryEntry.seq), 0))
_INSERT_ENTRY = insert(HistoryEntry)
_MOVE_HEAD = (
    update(ChainHead)
    .where(ChainHead.id == bindparam("chain"))
    .values(seq=bindparam("new_seq"), hash=bindparam("new_hash"))
)


def append(
    connection: Connection,
    *,
    chain: int,
    at: str,
    action: str,
    actor: str,
    payload: dict[str, Any],
    reservation_id: str | None = None,
    key: LedgerKey | None = None,
) -> int:
    """Append one entry on ``chain`` (call last in the transaction); returns its seq."""
    row = entry_columns(
        chain=chain,
        at=at,
        action=action,
        actor=actor,
        payload=payload,
        reservation_id=reservation_id,
        key=key,
    )
    if connection.dialect.name == "postgresql":
        return int(connection.exec_driver_sql(SERVER_APPEND, row).scalar_one())
    prev = connection.execute(_HEAD_HASH, {"chain": chain}).scalar_one_or_none()
    if prev is None:
        raise LedgerCorrupt(f"dp_chain_head has no row for chain {chain}")
    seq = connection.execute(_LAST_SEQ).scalar_one() + 1
    row["seq"] = seq
    row["prev_hash"] = prev
    row["hash"] = link_hash(prev, row.pop("link_prefix"), seq)
    connection.execute(_INSERT_ENTRY, row)
    connection.execute(_MOVE_HEAD, {"chain": chain, "new_seq": seq, "new_hash": row["hash"]})
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


def chain_problems(
    connection: Connection, chains: int, batch: int = 5000
) -> Iterator[ChainProblem]:
    """Walk the whole history in ``seq`` order, every chain at once; report broken links.

    Each entry must link to the previous entry of its own chain and hash to what it
    holds; each of the ``chains`` heads (the number is fixed in the ledger's config) must
    name its chain's last entry, so an entry removed from the end of a chain is found too.
    """
    last: dict[int, tuple[int, str]] = {}  # chain -> (seq, hash) of its last entry so far
    result = connection.execution_options(yield_per=batch).execute(
        select(HistoryEntry).order_by(HistoryEntry.seq)
    )
    for row in result:
        if not 1 <= row.chain <= chains:
            yield ChainProblem(row.seq, f"entry names chain {row.chain}, outside 1..{chains}")
        prev = last.get(row.chain, (0, GENESIS))[1]
        if row.prev_hash != prev:
            yield ChainProblem(
                row.seq,
                f"previous-hash link does not match the preceding entry of chain {row.chain} "
                "(entries missing, moved or inserted)",
            )
        recomputed = entry_hash(
            row.prev_hash, row.seq, row.at, row.action, row.actor, entry_body(row)
        )
        if recomputed != row.hash:
            yield ChainProblem(row.seq, "content does not match its hash (entry edited)")
        last[row.chain] = (row.seq, row.hash)
    heads = {row.id: row for row in connection.execute(select(ChainHead))}
    for chain in range(1, chains + 1):
        head = heads.pop(chain, None)
        seq, hash_ = last.get(chain, (0, GENESIS))
        if head is None:
            yield ChainProblem(seq, f"the head of chain {chain} is missing")
        elif (head.seq, head.hash) != (seq, hash_):
            yield ChainProblem(
                head.seq, f"head of chain {chain} does not match its last entry (entries removed)"
            )
    for extra in heads.values():
        yield ChainProblem(
            extra.seq, f"a head for chain {extra.id}, which the ledger does not have"
        )


def settled_seq(engine: Engine) -> int | None:
    """The highest ``seq`` below which no entry can still appear (PostgreSQL), else None.

    On PostgreSQL an entry takes its number while its transaction holds its chain head,
    and transactions on different chains commit in any order: entry 101 may be visible
    while entry 100 is still being committed. Every number handed out so far belongs to
    a transaction that holds a chain head until it ends, so once every head has been
    share-locked (waiting for those transactions), each number up to the one read before
    is committed or never will be. SQLite numbers under its single write lock, in commit
    order, so it has no such window (None: no limit needed).
    """
    if engine.dialect.name != "postgresql":
        return None
    with database.transaction(engine, write=True) as connection:
        handed_out = connection.execute(
            text(
                "SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END "
                "FROM dp_history_seq"
            )
        ).scalar_one()
        connection.execute(text("SELECT id FROM dp_chain_head FOR SHARE")).all()
    return int(handed_out)


def heads_digest(connection: Connection) -> tuple[int, str]:
    """(last seq, sha256 over every chain head): changes whenever anything is appended."""
    rows = connection.execute(select(ChainHead.id, ChainHead.seq, ChainHead.hash)).all()
    text = "\n".join(f"{row.id}:{row.hash}" for row in sorted(rows))
    return max((row.seq for row in rows), default=0), hashlib.sha256(text.encode()).hexdigest()
