"""The journal: how every part of the ledger appends to its history.

One object holds what every history entry is linked and signed with: the chain key (which
an administrator may adopt while the ledger is open, for every part at once), the number
of chains, and the actor the entries name.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection

from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.storage import history, pipeline


class Journal:
    """Appends the ledger's history entries, linked under its chain key."""

    def __init__(self, key: history.ChainKey, chains: int, actor: str) -> None:
        self.key = key
        self.chains = chains
        self.actor = actor

    def chain(self, key: LedgerKey) -> int:
        """The history chain of entries about ``key`` (or a release whose first key it is)."""
        return history.chain_of(key, self.chains)

    def append(self, connection: Connection, **entry: Any) -> int:
        """Append an entry by this journal's actor; returns its number."""
        return history.append(connection, self.key, actor=self.actor, **entry)

    def append_piped(self, pipe: pipeline.Pipeline, **entry: Any) -> int:
        """:meth:`append`, last in a pipelined transaction."""
        return pipe.append_history(self.key, actor=self.actor, **entry)

    def keyless(
        self, connection: Connection, action: str, now: str, payload: dict[str, Any]
    ) -> int:
        """Append an entry about no key (a reset, a quarantine) on the keyless chain."""
        return self.append(
            connection, chain=history.KEYLESS_CHAIN, at=now, action=action, payload=payload
        )

    def adopt(self, key: history.ChainKey) -> None:
        """Link every entry from now on under ``key`` (the history adopted it)."""
        self.key = key
