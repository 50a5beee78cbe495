"""Checkpoints: the chain heads of a verified ledger, kept where its database cannot reach.

Whoever can write the ledger database can delete its newest entries and move the chain
heads back, and (without the chain key) recompute every link. A checkpoint records each
chain's head at a verify that passed, outside the database: in a file, or in Airflow's
own metadata database through the maintenance DAG. The next verify requires each
checkpointed entry to be there, unchanged, so what was checkpointed can no longer be
erased, truncated or rewritten unnoticed. A checkpoint carries a MAC under the chain
key, so a forged checkpoint is refused too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dp_budget_provider.ledger.errors import LedgerCorrupt
from dp_budget_provider.ledger.records import VerifyReport
from dp_budget_provider.ledger.storage import history

FORMAT = "dp-budget-checkpoint/1"


class CheckpointUnreadable(LedgerCorrupt):
    """The latest checkpoint is not a checkpoint at all (not JSON, not its shape).

    In a store only maintenance writes, that is damage, like a forged one. A file named on
    the command line can tell it before the verify (:meth:`CheckpointFile.check`): there
    it is most likely the wrong file, not tampering.
    """


@dataclass(frozen=True)
class Checkpoint:
    """Every chain head of one ledger at a verify that passed."""

    ledger: str  # the ledger's identity: the link of its creation entry
    at: str
    entries: int
    heads: tuple[tuple[int, int, str], ...]  # (chain, seq, link)
    key_id: str | None

    @classmethod
    def of(
        cls, ledger: str, at: str, entries: int, heads: Any, key: history.ChainKey
    ) -> Checkpoint:
        """A checkpoint of ``heads`` (chain, seq, link) made with ``key``."""
        listed = tuple(sorted((int(c), int(s), str(h)) for c, s, h in heads))
        return cls(ledger, at, int(entries), listed, key.key_id)

    def _body(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "ledger": self.ledger,
            "at": self.at,
            "entries": self.entries,
            "heads": [list(head) for head in self.heads],
            "key_id": self.key_id,
        }

    def to_json(self, key: history.ChainKey) -> str:
        """One line of JSON, sealed with a MAC under ``key`` (sha256 when unkeyed)."""
        body = self._body()
        return history.canonical_json({**body, "mac": key.digest(history.canonical_json(body))})

    @classmethod
    def parse(cls, text: str) -> tuple[Checkpoint, object]:
        """The checkpoint ``text`` holds and its MAC, not yet checked against any key;
        :class:`CheckpointUnreadable` when the text is not a checkpoint at all."""
        try:
            record = json.loads(text)
            mac = record.pop("mac")
            if record.get("format") != FORMAT:
                raise ValueError(f"format {record.get('format')!r}")
            checkpoint = cls(
                ledger=record["ledger"],
                at=record["at"],
                entries=int(record["entries"]),
                heads=tuple((int(c), int(s), str(h)) for c, s, h in record["heads"]),
                key_id=record["key_id"],
            )
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise CheckpointUnreadable(f"checkpoint is unreadable ({error})") from error
        return checkpoint, mac

    @classmethod
    def from_json(cls, text: str, key: history.ChainKey) -> Checkpoint:
        """Read a checkpoint, refusing one that ``key`` did not seal (forged or edited)."""
        checkpoint, mac = cls.parse(text)
        if checkpoint.key_id != key.key_id:
            raise LedgerCorrupt(
                f"checkpoint was sealed with chain key id {checkpoint.key_id!r}, not the "
                f"ledger's {key.key_id!r}"
            )
        expected = key.digest(history.canonical_json(checkpoint._body()))
        if not isinstance(mac, str) or mac != expected:
            raise LedgerCorrupt("checkpoint's MAC does not match: it was forged or edited")
        return checkpoint

    def marks(self) -> dict[int, tuple[int, str]]:
        """seq -> (chain, link) of each entry the history must still hold."""
        return history.marks(self.heads)


class CheckpointFile:
    """Checkpoints appended to a file, one JSON line each; the last line is the latest.

    The file is created readable by its owner only and each line is flushed to disk
    before ``append`` returns. Keep it where the ledger database's users cannot write.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser().resolve()

    def append(self, checkpoint: Checkpoint, key: history.ChainKey) -> None:
        """Record ``checkpoint`` as the latest."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = checkpoint.to_json(key) + "\n"
        descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(descriptor, "a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())

    def _last_line(self) -> str:
        """The file's last non-blank line ("" when there is none or no file)."""
        if not self.path.exists():
            return ""
        last_line = ""
        try:
            with self.path.open(encoding="utf-8") as handle:
                for line in handle:
                    if line.strip():
                        last_line = line
        except UnicodeDecodeError as error:
            raise CheckpointUnreadable(f"checkpoint is unreadable ({error})") from error
        return last_line

    def check(self) -> None:
        """Raise :class:`CheckpointUnreadable` if the file's latest line is not a checkpoint
        at all; what no key can judge is said before a verify reads it as tampering."""
        last_line = self._last_line()
        if last_line:
            Checkpoint.parse(last_line)

    def last(self, key: history.ChainKey) -> Checkpoint | None:
        """The latest checkpoint, None if the file does not exist or holds none."""
        last_line = self._last_line()
        return Checkpoint.from_json(last_line, key) if last_line else None


class CheckpointStore(Protocol):
    """Where checkpoints are kept (a file, an Airflow Variable): outside the ledger database."""

    def last(self, key: history.ChainKey) -> Checkpoint | None:
        """The latest checkpoint (None before the first)."""

    def append(self, checkpoint: Checkpoint, key: history.ChainKey) -> None:
        """Record ``checkpoint`` as the latest."""


class AuditedLedger(Protocol):
    """What a verify-and-checkpoint run needs of a ledger."""

    @property
    def chain_key(self) -> history.ChainKey: ...

    def verify(self, checkpoint: Checkpoint | None = None) -> VerifyReport: ...

    def checkpoint(self, report: VerifyReport) -> Checkpoint: ...

    def quarantine(self, reason: str, problems: Sequence[str] = ()) -> bool: ...


def verify_and_checkpoint(ledger: AuditedLedger, store: CheckpointStore) -> VerifyReport:
    """Verify against the store's latest checkpoint; record a new one if the verify passed.

    A checkpoint that cannot be read (forged, edited, another key) fails the verify and
    quarantines the ledger, like any other problem: it is never silently replaced.
    """
    try:
        previous = store.last(ledger.chain_key)
    except LedgerCorrupt as error:
        reason = f"the last checkpoint was refused: {error}"
        ledger.quarantine(reason)
        return VerifyReport(entries=0, accounts=0, problems=[reason])
    report = ledger.verify(previous)
    if report.ok:
        store.append(ledger.checkpoint(report), ledger.chain_key)
    return report
