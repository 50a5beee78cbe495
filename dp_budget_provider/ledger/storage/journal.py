"""The journal: how every part of the ledger appends to its history.

One object holds what every history entry is linked and signed with: the chain key (which
an administrator may adopt while the ledger is open, for every part at once), the number
of chains, and the actor the entries name. It appends typed entries (:mod:`entries`), so
no writer builds a payload of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection

from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.storage import history, pipeline
from dp_budget_provider.ledger.storage.payloads import Entry


class Journal:
    """Appends the ledger's history entries, linked under its chain key."""

    def __init__(self, key: history.ChainKey, chains: int, actor: str) -> None:
        self.key = key
        self.chains = chains
        self.actor = actor

    def append(
        self,
        connection: Connection,
        entry: Entry,
        *,
        at: str,
        keys: Sequence[LedgerKey] = (),
        reservation_id: str | None = None,
    ) -> int:
        """Append ``entry`` by this journal's actor, last in the transaction; its number.

        An entry about ``keys`` (in lock order) is linked on the chain of the first, and
        names that key when it is the only one; an entry about none (a reset, a policy, a
        quarantine) goes on the keyless chain. ``reservation_id``: the reservation it
        opens, charges or closes.
        """
        columns = self._columns(entry, at, keys, reservation_id)
        return history.append(connection, self.key, **columns)

    def append_piped(
        self,
        pipe: pipeline.Pipeline,
        entry: Entry,
        *,
        at: str,
        keys: Sequence[LedgerKey] = (),
        reservation_id: str | None = None,
    ) -> int:
        """:meth:`append`, last in a pipelined transaction."""
        columns = self._columns(entry, at, keys, reservation_id)
        return pipe.append_history(self.key, **columns)

    def _columns(
        self, entry: Entry, at: str, keys: Sequence[LedgerKey], reservation_id: str | None
    ) -> dict[str, Any]:
        """What :func:`history.append` takes for ``entry`` (see :meth:`append`)."""
        return {
            "chain": history.chain_of(keys[0] if keys else None, self.chains),
            "at": at,
            "action": entry.action,
            "actor": self.actor,
            "payload": entry.payload(),
            "reservation_id": reservation_id,
            "key": keys[0] if len(keys) == 1 else None,
        }

    def adopt(self, key: history.ChainKey) -> None:
        """Link every entry from now on under ``key`` (the history adopted it)."""
        self.key = key
