"""Auditing a ledger: the hash chain, reservation key sets, and a replay of the history.

The replay recomputes every live account's spend from the history alone (commits, reaps,
corrections, re-scopes, resets) and compares it with the stored accounts, so lowering an
account's spend directly in SQL is caught even though the chain itself is intact. The
same goes for the pending spend of open reservations, which the prospective check reads.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, func, select

from dp_budget_provider.ledger import history
from dp_budget_provider.ledger.errors import LedgerCorrupt
from dp_budget_provider.ledger.keys import LedgerKey
from dp_budget_provider.ledger.records import VerifyReport
from dp_budget_provider.ledger.schema import (
    Account,
    HistoryEntry,
    LedgerConfig,
    Reservation,
    ReservationKey,
    Window,
)
from dp_budget_provider.ledger.spend import Pending, Spend


def _key_of(row: Any) -> LedgerKey:
    return LedgerKey.from_canonical(row.tenant, row.subject, row.query_type, row.window)


class _Replay:
    """Account spends, open-reservation counts and pending spends as the history says."""

    def __init__(
        self, keys_of: Mapping[str, list[LedgerKey]], digests: Mapping[str, str], size: int
    ) -> None:
        self.keys_of = keys_of
        self.digests = digests
        self.size = size
        self.expected: dict[LedgerKey, Spend] = defaultdict(Spend)
        self.open_count: dict[LedgerKey, int] = defaultdict(int)
        self.pending: dict[LedgerKey, Pending] = defaultdict(Pending)
        self.cost_of: dict[str, Spend] = {}
        self.rescoped: dict[LedgerKey, str] = {}  # sealed key -> the query type it moved to
        self.sealed: set[tuple[str, str, str]] = set()  # (tenant, query_type, window)

    def _close(self, entry: Any, keys: list[LedgerKey]) -> None:
        """One reservation closes on ``keys``: its cost leaves their pending spend."""
        cost = self.cost_of.get(entry.reservation_id or "", Spend())
        for key in keys:
            self.open_count[key] -= 1
            left = self.open_count[key] > 0
            self.pending[key] = self.pending[key].remove(cost) if left else Pending()

    def apply(self, entry: Any) -> list[str]:
        """Apply one entry; returns problems it shows (bad payloads raise)."""
        payload = json.loads(entry.payload)
        keys = self.keys_of.get(entry.reservation_id or "", [])
        if entry.action == "reserve":
            cost = self.cost_of[entry.reservation_id] = Spend.from_payload(
                payload["cost"], self.size
            )
            for key in keys:
                self.open_count[key] += 1
                self.pending[key] = self.pending[key].add(cost)
                self.expected.setdefault(key, Spend())
            if payload.get("keys_digest") != self.digests.get(entry.reservation_id):
                return [f"entry {entry.seq}: reservation digest differs from its entry"]
        elif entry.action in ("commit", "reap"):
            cost = Spend.from_payload(payload["cost"], self.size)
            for key in keys:
                self.expected[key] = self.expected[key].plus(cost)
            self._close(entry, keys)
        elif entry.action == "release":
            self._close(entry, keys)
        elif entry.action == "correction":
            key = _key_of(entry)
            self.expected[key] = self.expected[key].plus(
                Spend.from_payload(payload["cost"], self.size)
            )
        elif entry.action == "rescope":
            old, new = LedgerKey(**payload["from"]), _key_of(entry)
            carried = self.expected.setdefault(old, Spend())
            self.expected[new] = self.expected[new].plus(carried)
            if old.query_type != new.query_type and (old.tenant, old.subject, old.window) == (
                new.tenant,
                new.subject,
                new.window,
            ):
                self.rescoped[old] = new.query_type  # the key stays, sealed
            else:  # an entry of an earlier version, which dropped the old key
                del self.expected[old]
                self.open_count.pop(old, None)
                self.pending.pop(old, None)
        elif entry.action == "reset":
            window = payload["window"]
            sealed = payload.get("sealed")  # None: an earlier version's reset of every scope
            scopes = None if sealed is None else {tuple(scope) for scope in sealed}
            for key in [k for k in self.expected if k.window == window]:
                if scopes is None or (key.tenant, key.query_type) in scopes:
                    del self.expected[key]
                    self.open_count.pop(key, None)
                    self.pending.pop(key, None)
                    self.rescoped.pop(key, None)
            self.sealed |= {(t, q, window) for t, q in scopes or ()}
        return []


def _seal_problems(
    connection: Connection, replay: _Replay, accounts: Mapping[LedgerKey, Any]
) -> list[str]:
    """Seals as the history made them: sealed windows and re-scoped keys, never undone.

    Unsealing a window or clearing a key's re-scope mark in SQL would let it be charged
    again from where its accounts left off (or from zero), so either is reported.
    """
    problems = []
    stored = {
        (row.tenant, row.query_type, row.window): row.sealed_at
        for row in connection.execute(select(Window))
    }
    for scope in sorted(replay.sealed):
        if stored.get(scope) is None:
            problems.append(f"window {scope}: sealed by a reset in the history but not sealed")
    for key, row in accounts.items():
        if (key.tenant, key.query_type, key.window) not in stored:
            problems.append(f"account {key}: its window has no row in dp_windows")
        if row.rescoped_to != replay.rescoped.get(key):
            problems.append(
                f"account {key}: re-scope mark {row.rescoped_to!r} differs from the history's "
                f"{replay.rescoped.get(key)!r}"
            )
    return problems


def verify(connection: Connection, size: int) -> VerifyReport:
    """Audit the ledger seen through ``connection`` (one consistent snapshot)."""
    chains = connection.execute(
        select(LedgerConfig.chains).where(LedgerConfig.id == 1)
    ).scalar_one()
    problems = [f"entry {p.seq}: {p.problem}" for p in history.chain_problems(connection, chains)]
    digests = dict(connection.execute(select(Reservation.id, Reservation.keys_digest)).all())
    keys_of: dict[str, list[LedgerKey]] = defaultdict(list)
    for row in connection.execute(
        select(ReservationKey).order_by(ReservationKey.reservation_id, ReservationKey.position)
    ):
        keys_of[row.reservation_id].append(_key_of(row))
    for reservation_id, digest in digests.items():
        if history.keys_digest(keys_of[reservation_id]) != digest:
            problems.append(f"reservation {reservation_id}: key set does not match its digest")
    problems += [
        f"reservation {reservation_id}: key rows of a reservation that does not exist"
        for reservation_id in sorted(keys_of.keys() - digests.keys())
    ]
    replay = _Replay(keys_of, digests, size)
    for entry in connection.execute(select(HistoryEntry).order_by(HistoryEntry.seq)):
        try:
            problems += replay.apply(entry)
        except (ValueError, KeyError, TypeError, LedgerCorrupt) as error:
            problems.append(f"entry {entry.seq}: unreadable payload ({error!r}); edited?")
    accounts = {_key_of(row): row for row in connection.execute(select(Account))}
    problems += _seal_problems(connection, replay, accounts)
    for key, row in accounts.items():
        stored = Spend.from_columns(row.rho, row.residual, row.gaussian_mu2, size)
        if key not in replay.expected:
            if stored.rho or stored.residual is not None:
                problems.append(f"account {key}: spend that no history entry charged")
            continue
        if not stored.close_to(replay.expected[key]):
            problems.append(f"account {key}: stored spend differs from the history's sum")
        if row.open_reservations != replay.open_count[key]:
            problems.append(f"account {key}: open reservation count differs from the history")
        pending = Pending.from_columns(
            row.pending_rho, row.pending_residual, row.pending_mu2, row.pending_others, size
        )
        if not pending.close_to(replay.pending[key]):
            problems.append(
                f"account {key}: pending spend differs from its open reservations' cost"
            )
    for key, spend in replay.expected.items():
        if key not in accounts and (spend.rho or spend.residual is not None):
            problems.append(f"account {key}: charged in the history but missing")
    entries = connection.execute(select(func.count()).select_from(HistoryEntry)).scalar_one()
    return VerifyReport(entries=entries, accounts=len(accounts), problems=problems)
