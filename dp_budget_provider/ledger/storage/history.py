"""The append-only audit history: a chain of keyed links.

Each entry's link is a MAC over the previous link *on its chain* and the entry's
canonical JSON, so an edited, deleted, inserted or reordered entry breaks every later
link of its chain. With a chain key (an HMAC-SHA256 key kept outside the ledger
database: an Airflow connection, a secrets backend or an environment variable), nobody
who can only write the database can make a link that verifies: rewriting history needs
the key. A ledger without a key links with plain sha256, which finds accidents and
edits that are not recomputed, not an insider who recomputes the chain; checkpoints
(:mod:`checkpoints`) kept outside the database bound what such an insider can rewrite.

The history is split into :data:`CHAINS` chains by key (:func:`chain_of`): writers on
different keys lock different chain heads, instead of all queueing on one row. A chain's
head row is locked as the last step of each write transaction, so each chain is
appended in commit order. ``seq`` numbers the whole history (the order replays and
pages use); it is taken while the head is held, is linked with the entry, rises along
every chain and follows the commit order of each account.

The canonical JSON ends with the sequence number (``"seq"`` sorts last), so everything
before it, the *link prefix*, is made before the chain head is locked. The link is
always made here, in the client, on every database: the key never travels to the
database server.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

from sqlalchemy import Connection, Engine, select, text

from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.errors import LedgerConfigMismatch, LedgerCorrupt
from dp_budget_provider.ledger.storage import database
from dp_budget_provider.ledger.storage.schema import ChainHead, HistoryEntry

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


def ledger_identity(connection: Connection) -> str:
    """What names a ledger (in its checkpoints, and in what its administrator signs): the
    link of its creation entry."""
    found = connection.execute(
        select(HistoryEntry.hash)
        .where(HistoryEntry.action == "create")
        .order_by(HistoryEntry.seq)
        .limit(1)
    ).scalar_one_or_none()
    return found or ""


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


MIN_KEY_BYTES = 16
# Where the CLI (and the Airflow hook, when its connection names no key) reads the key.
CHAIN_KEY_ENV = "DP_BUDGET_CHAIN_KEY"
_KEY_ID_LABEL = b"dp-budget-provider chain key id v1"


class ChainKey:
    """How links are made: HMAC-SHA256 under a secret key, or plain sha256 without one.

    The key never leaves the process: the database stores only :attr:`key_id`, an HMAC
    of a fixed label, which names the key without revealing it (and lets a ledger refuse
    to open with the wrong one).
    """

    def __init__(self, secret: str | bytes | None = None) -> None:
        if secret is None:
            self._secret: bytes | None = None
            return
        if isinstance(secret, str):
            raw = secret.encode()
        elif isinstance(secret, bytes):
            raw = secret
        else:
            raise ValueError(f"a chain key is a string or bytes, got {type(secret).__name__}")
        if len(raw) < MIN_KEY_BYTES:
            raise ValueError(
                f"a chain key needs at least {MIN_KEY_BYTES} bytes (use 32 random ones, e.g. "
                "python -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
        self._secret = raw

    def __repr__(self) -> str:
        return f"ChainKey(key_id={self.key_id!r})" if self._secret else "ChainKey(None)"

    @property
    def keyed(self) -> bool:
        """True when links are HMACs under a secret."""
        return self._secret is not None

    @property
    def key_id(self) -> str | None:
        """A public name of the key (None without one)."""
        if self._secret is None:
            return None
        return hmac.new(self._secret, _KEY_ID_LABEL, hashlib.sha256).hexdigest()

    def digest(self, text: str, *, keyed: bool = True) -> str:
        """The MAC of ``text`` (sha256 when unkeyed, or ``keyed=False`` for old links)."""
        data = text.encode()
        if keyed and self._secret is not None:
            return hmac.new(self._secret, data, hashlib.sha256).hexdigest()
        return hashlib.sha256(data).hexdigest()


UNKEYED = ChainKey(None)


def link_hash(
    prev_hash: str, prefix: str, seq: int, key: ChainKey = UNKEYED, *, keyed: bool = True
) -> str:
    """The link over the previous link and the entry's canonical JSON (prefix + seq)."""
    return key.digest(f"{prev_hash}\n{prefix}{seq}}}", keyed=keyed)


def entry_hash(
    prev_hash: str,
    seq: int,
    at: str,
    action: str,
    actor: str,
    body: dict,
    key: ChainKey = UNKEYED,
    *,
    keyed: bool = True,
) -> str:
    """The link of one entry."""
    return link_hash(prev_hash, link_prefix(at, action, actor, body), seq, key, keyed=keyed)


def link_holds(row: Any, key: ChainKey, keyed_from: int | None) -> bool:
    """Whether a stored entry carries the link its content makes on its previous link: an
    HMAC under ``key`` from entry ``keyed_from`` on (the ledger's history is keyed from
    there), plain sha256 before. Under a key, only the ledger can have written it."""
    keyed = keyed_from is not None and row.seq >= keyed_from
    recomputed = entry_hash(
        row.prev_hash, row.seq, row.at, row.action, row.actor, entry_body(row), key, keyed=keyed
    )
    return hmac.compare_digest(recomputed, row.hash)


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


# Lock a chain's head and number the entry while holding it: the number is taken
# after the lock (a CTE, not a locking SELECT's own target list, which PostgreSQL
# evaluates before it waits), so numbers rise along every chain.
PG_LOCK_HEAD = (
    "WITH head AS (SELECT hash, key_id FROM dp_chain_head WHERE id = %(chain)s FOR UPDATE) "
    "SELECT hash, nextval('dp_history_seq'), key_id FROM head"
)
# SQLite holds its one write lock already; numbers follow the last entry.
SQLITE_LOCK_HEAD = (
    "SELECT hash, (SELECT coalesce(max(seq), 0) + 1 FROM dp_history), key_id "
    "FROM dp_chain_head WHERE id = %(chain)s"
)
INSERT_ENTRY = (
    "INSERT INTO dp_history (seq, chain, at, action, actor, reservation_id, tenant, subject, "
    'query_type, "window", payload, prev_hash, hash) VALUES (%(seq)s, %(chain)s, %(at)s, '
    "%(action)s, %(actor)s, %(reservation_id)s, %(tenant)s, %(subject)s, %(query_type)s, "
    "%(window)s, %(payload)s, %(prev_hash)s, %(hash)s)"
)
MOVE_HEAD = "UPDATE dp_chain_head SET seq = %(seq)s, hash = %(hash)s WHERE id = %(chain)s"


def lock_head_sql(postgresql: bool) -> str:
    """The statement that locks a chain head and returns (its link, the next seq, its key id)."""
    return PG_LOCK_HEAD if postgresql else SQLITE_LOCK_HEAD


def linked(row: dict[str, Any], head: Any, key: ChainKey) -> dict[str, Any]:
    """Complete an entry's columns (:func:`entry_columns`) from its locked chain head."""
    if head is None:
        raise LedgerCorrupt(f"dp_chain_head has no row for chain {row['chain']}")
    prev, seq, key_id = head
    if key_id != key.key_id:
        raise LedgerConfigMismatch(
            f"chain {row['chain']} is linked with chain key {_short(key_id)}, but this "
            f"process holds {_short(key.key_id)}: reopen the ledger with its chain key"
        )
    values = {k: v for k, v in row.items() if k != "link_prefix"}
    values.update(seq=int(seq), prev_hash=prev)
    values["hash"] = link_hash(prev, row["link_prefix"], int(seq), key)
    return values


def _short(key_id: str | None) -> str:
    return "none (unkeyed)" if key_id is None else f"id {key_id[:12]}"


def append(connection: Connection, chain_key: ChainKey, /, **entry: Any) -> int:
    """Append one entry (call last in the transaction; see :func:`entry_columns`); its seq."""
    postgresql = connection.dialect.name == "postgresql"
    row = entry_columns(**entry)
    head = execute(connection, lock_head_sql(postgresql), {"chain": row["chain"]}).one_or_none()
    values = linked(row, head, chain_key)
    execute(connection, INSERT_ENTRY, values)
    execute(connection, MOVE_HEAD, values)
    return int(values["seq"])


def execute(connection: Connection, sql: str, params: dict[str, Any]) -> Any:
    """Run a ``%(name)s`` statement on either database."""
    if connection.dialect.name != "postgresql":
        sql = named(sql)
    return connection.exec_driver_sql(sql, params)


def named(sql: str) -> str:
    """``%(name)s`` parameters as SQLite's ``:name``."""
    return _PYFORMAT.sub(r":\1", sql)


_PYFORMAT = re.compile(r"%\((\w+)\)s")


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
    connection: Connection,
    chains: int,
    key: ChainKey = UNKEYED,
    keyed_from: int | None = None,
    marks: Mapping[int, tuple[int, str]] | None = None,
    batch: int = 5000,
) -> Iterator[ChainProblem]:
    """Walk the whole history in ``seq`` order, every chain at once; report broken links.

    Each entry must link to the previous entry of its own chain and carry the link its
    content makes: an HMAC under ``key`` from entry ``keyed_from`` on (the ledger's
    history is keyed from there), plain sha256 before. Each of the ``chains`` heads (the
    number is fixed in the ledger's config) must name its chain's last entry, so an entry
    removed from the end of a chain is found too. ``marks`` (seq -> (chain, link): a
    checkpoint kept outside the database, the heads a key adoption sealed) name entries
    that must still be there, unchanged: so rewriting or truncating history up to a mark
    is found even when the links before it are unkeyed. Rows are streamed.
    """
    last: dict[int, tuple[int, str]] = {}  # chain -> (seq, hash) of its last entry so far
    expected = dict(marks or {})
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
        if not link_holds(row, key, keyed_from):
            keyed = keyed_from is not None and row.seq >= keyed_from
            what = "its keyed link" if keyed else "its hash"
            yield ChainProblem(row.seq, f"content does not match {what} (entry edited or forged)")
        mark = expected.pop(row.seq, None)
        if mark is not None and mark != (row.chain, row.hash):
            yield ChainProblem(
                row.seq, f"entry differs from a checkpoint's mark on chain {mark[0]} (rewritten)"
            )
        last[row.chain] = (row.seq, row.hash)
    for seq, (chain, _) in sorted(expected.items()):
        yield ChainProblem(
            seq, f"a checkpoint's entry {seq} of chain {chain} is gone (history truncated)"
        )
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


def marks(heads: Iterable[Iterable[Any]]) -> dict[int, tuple[int, str]]:
    """seq -> (chain, link) of the non-empty heads in (chain, seq, link) rows."""
    found = {}
    for chain, seq, link in heads:
        if int(seq) > 0:
            found[int(seq)] = (int(chain), str(link))
    return found


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
    with database.transaction(engine, write=False) as connection:  # it locks, writes nothing
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
