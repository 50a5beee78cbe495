"""Ledgers of an earlier schema revision, filled in SQL the way that revision's code wrote.

The migration tests need data of the era each migration met: accounts kept per subject,
reservation keys by subject, history entries without cohorts. This package's ledger
cannot make them any more (every charge it makes goes to spend classes, which revision
0008 refuses to take below itself), so :class:`LegacyLedger` writes them: the rows and
the history entries the code of revisions 0002 to 0007 wrote for a reserve, commit,
release and reset, with the ledger's own arithmetic (:class:`Spend`, :class:`Pending`)
and the history's own links (:mod:`history`), and with only the columns and payload
fields the database's revision has. Its ledger is one this package created and took
down while empty (the ``ledger_at`` fixture), so its creation and policy entries are
the package's, and a legacy ledger verifies once upgraded.

The writer is the ledger's only writer while it is used, keeps the accounts it wrote in
memory, links without a chain key and checks no cap (the tests stay far below theirs:
verify would report a breach).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sqlalchemy as sa

from dp_budget_provider.accounting import Mechanism
from dp_budget_provider.ledger import LedgerKey
from dp_budget_provider.ledger.accounts.spend import Pending, Spend, prospective
from dp_budget_provider.ledger.releases.lease import DEFAULT_LEASE
from dp_budget_provider.ledger.storage import clock, history, statements

ACTOR = "old-version"


def insert_row(connection: sa.Connection, table: str, row: Mapping[str, Any]) -> None:
    """One row, its columns quoted (``window`` is a keyword)."""
    columns = ", ".join(f'"{column}"' for column in row)
    values = ", ".join(f":{column}" for column in row)
    connection.execute(sa.text(f"INSERT INTO {table} ({columns}) VALUES ({values})"), dict(row))


def insert(url: str, table: str, *rows: Mapping[str, Any]) -> None:
    """``rows`` into ``table``, in one transaction."""
    engine = sa.create_engine(url)
    try:
        with engine.begin() as connection:
            for row in rows:
                insert_row(connection, table, row)
    finally:
        engine.dispose()


@dataclass(frozen=True)
class LegacyReservation:
    """A reservation as the legacy writer made it."""

    id: str
    attempt_id: str
    keys: tuple[LedgerKey, ...]
    cost: Spend
    count: int
    digest: str


@dataclass
class _Account:
    """One subject's account row as revision 0007 and earlier kept it."""

    spend: Spend = field(default_factory=Spend)
    pending: Pending = field(default_factory=Pending)
    open: int = 0
    releases: int = 0
    updated_at: str = ""
    stored: bool = False


class LegacyLedger:
    """Writes, in SQL, what the per-subject code of the database's revision wrote."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._accounts: dict[LedgerKey, _Account] = {}
        self._open: dict[str, LegacyReservation] = {}
        with self._transaction() as connection:
            inspector = sa.inspect(connection)
            self._columns = {
                table: {column["name"] for column in inspector.get_columns(table)}
                for table in inspector.get_table_names()
            }
            config = connection.execute(sa.text("SELECT * FROM dp_ledger_config")).one()
            charged = connection.execute(sa.text("SELECT count(*) FROM dp_accounts")).scalar()
        if charged:
            raise AssertionError("a legacy ledger starts empty: its writer keeps the accounts")
        self._orders = np.array(json.loads(config.orders), dtype=np.float64)
        self._delta, self._conversion = config.delta, config.conversion
        self._chains = getattr(config, "chains", 1)  # revision 0002 had one chain
        # PostgreSQL numbers entries with dp_history_seq from revision 0003 (the chains) on;
        # before it, and on SQLite, the next number follows the last entry.
        self._sequence = "chain" in self._columns["dp_history"]

    # ------------------------------------------------------------------ the era's writes

    def reserve(
        self, keys: Iterable[LedgerKey], mechanism: Mechanism, count: int = 1
    ) -> LegacyReservation:
        """Hold the cost of a release on every key (each subject's own account)."""
        ordered = sorted(set(keys), key=statements.key_tuple)
        cost = Spend.of_release(mechanism, count, self._orders)
        moment = clock.now()
        at = clock.stamp(moment)
        worst = 0.0
        for key in ordered:
            account = self._account(key)
            total = prospective(account.spend, account.pending, cost)
            epsilon = total.epsilon(self._orders, self._delta, self._conversion).epsilon
            worst = max(worst, epsilon)
            account.pending = account.pending.add(cost)
            account.open += 1
            account.updated_at = at
        token_hash = hashlib.sha256(secrets.token_urlsafe(32).encode()).hexdigest()
        reservation = LegacyReservation(
            id=str(uuid.uuid4()),
            attempt_id=f"anonymous:{uuid.uuid4()}",
            keys=tuple(ordered),
            cost=cost,
            count=count,
            digest=history.keys_digest(ordered),
        )
        spec = mechanism.to_spec()
        payload = {
            "attempt_id": reservation.attempt_id,
            "mechanism": spec,
            "count": count,
            "cost": cost.as_payload(),
            "key_count": len(ordered),
            "keys_digest": reservation.digest,
            "prospective_epsilon": worst,
        }
        if "token_hash" in self._columns["dp_reservations"]:  # from revision 0005 on
            payload["token_hash"] = token_hash
        with self._transaction() as connection:
            self._store_accounts(connection, ordered)
            if "dp_windows" in self._columns:  # from revision 0005 on
                self._open_windows(connection, ordered, at)
            self._insert(
                connection,
                "dp_reservations",
                {
                    "id": reservation.id,
                    "attempt_id": reservation.attempt_id,
                    "token_hash": token_hash,
                    "state": "open",
                    "mechanism": history.canonical_json(spec),
                    "count": count,
                    "cost_rho": cost.rho,
                    "cost_residual": cost.residual_json(),
                    "cost_gaussian_mu2": cost.gaussian_mu2,
                    "key_count": len(ordered),
                    "keys_digest": reservation.digest,
                    "prospective_epsilon": worst,
                    "actor": ACTOR,
                    "created_at": at,
                    "lease_expires_at": clock.stamp(moment + DEFAULT_LEASE),
                },
            )
            for position, key in enumerate(ordered):
                self._insert(
                    connection,
                    "dp_reservation_keys",
                    {"reservation_id": reservation.id, "position": position, **key.as_dict()},
                )
            self._append(connection, "reserve", at, payload, reservation=reservation)
        self._open[reservation.id] = reservation
        return reservation

    def commit(self, reservation: LegacyReservation) -> None:
        """Charge an open reservation to its keys."""
        self._close(reservation, "commit", charged=True)

    def release(self, reservation: LegacyReservation, reason: str = "") -> None:
        """Drop an open reservation, charging nothing."""
        self._close(reservation, "release", charged=False, reason=reason)

    def spend(self, key: LedgerKey, mechanism: Mechanism, count: int = 1) -> None:
        """Reserve and commit one release on one key."""
        self.commit(self.reserve([key], mechanism, count))

    def reset(self, window: str) -> None:
        """Drop a window's accounts and record it. From revision 0005 on, the reset seals
        the window's charged scopes first; before, it sealed nothing (the window could be
        charged again from zero) and named no scope."""
        at = self._now()
        dropped = [key for key in self._accounts if key.window == window]
        payload: dict[str, Any] = {"window": window, "accounts": len(dropped)}
        with self._transaction() as connection:
            if "dp_windows" in self._columns:
                scopes = connection.execute(
                    sa.text(
                        'SELECT tenant, query_type FROM dp_windows WHERE "window" = :window '
                        "AND sealed_at IS NULL ORDER BY tenant, query_type"
                    ),
                    {"window": window},
                ).all()
                connection.execute(
                    sa.text('UPDATE dp_windows SET sealed_at = :at WHERE "window" = :window'),
                    {"at": at, "window": window},
                )
                payload["sealed"] = [list(scope) for scope in scopes]
            else:
                payload["closed_at"] = at
            connection.execute(
                sa.text('DELETE FROM dp_accounts WHERE "window" = :window'), {"window": window}
            )
            self._append(connection, "reset", at, payload)
        for key in dropped:
            del self._accounts[key]

    # ------------------------------------------------------------------ rows and entries

    def _close(
        self, reservation: LegacyReservation, action: str, *, charged: bool, reason: str = ""
    ) -> None:
        self._open.pop(reservation.id)  # KeyError if closed already: a test's mistake
        at = self._now()
        for key in reservation.keys:
            account = self._accounts[key]
            account.pending = (
                Pending() if account.open == 1 else account.pending.remove(reservation.cost)
            )
            account.open -= 1
            account.updated_at = at
            if charged:
                account.spend = account.spend.plus(reservation.cost)
                account.releases += reservation.count
        if charged:
            payload = {
                "attempt_id": reservation.attempt_id,
                "cost": reservation.cost.as_payload(),
                "count": reservation.count,
                "key_count": len(reservation.keys),
                "keys_digest": reservation.digest,
            }
        else:
            payload = {"attempt_id": reservation.attempt_id, "reason": reason}
        with self._transaction() as connection:
            self._store_accounts(connection, reservation.keys)
            connection.execute(
                sa.text(
                    "UPDATE dp_reservations SET state = :state, resolved_at = :at WHERE id = :id"
                ),
                {"state": "committed" if charged else "released", "at": at, "id": reservation.id},
            )
            self._append(connection, action, at, payload, reservation=reservation)

    def _account(self, key: LedgerKey) -> _Account:
        account = self._accounts.get(key)
        if account is None:
            account = self._accounts[key] = _Account()
        return account

    def _store_accounts(self, connection: sa.Connection, keys: Sequence[LedgerKey]) -> None:
        for key in keys:
            account = self._accounts[key]
            values = {
                "rho": account.spend.rho,
                "residual": account.spend.residual_json(),
                "gaussian_mu2": account.spend.gaussian_mu2,
                "releases": account.releases,
                "open_reservations": account.open,
                "pending_rho": account.pending.rho,
                "pending_residual": account.pending.residual_json(),
                "pending_mu2": account.pending.mu2,
                "pending_others": account.pending.others,
                "updated_at": account.updated_at,
            }
            if account.stored:
                assignments = ", ".join(f"{column} = :{column}" for column in values)
                connection.execute(
                    sa.text(
                        f"UPDATE dp_accounts SET {assignments} WHERE tenant = :tenant AND "
                        'subject = :subject AND query_type = :query_type AND "window" = :window'
                    ),
                    {**values, **key.as_dict()},
                )
            else:
                self._insert(connection, "dp_accounts", {**key.as_dict(), **values})
                account.stored = True

    def _open_windows(self, connection: sa.Connection, keys: Sequence[LedgerKey], at: str) -> None:
        """The window rows of the scopes ``keys`` charge first, stamped with that charge."""
        for parts in sorted({(k.tenant, k.query_type, k.window) for k in keys}):
            scope = dict(zip(("tenant", "query_type", "window"), parts, strict=True))
            known = connection.execute(
                sa.text(
                    "SELECT count(*) FROM dp_windows WHERE tenant = :tenant AND "
                    'query_type = :query_type AND "window" = :window'
                ),
                scope,
            ).scalar_one()
            if not known:
                self._insert(connection, "dp_windows", {**scope, "created_at": at})

    def _append(
        self,
        connection: sa.Connection,
        action: str,
        at: str,
        payload: dict[str, Any],
        reservation: LegacyReservation | None = None,
    ) -> None:
        """Link one entry on its chain (a reservation's first key's; chain 1 without one)."""
        keys = reservation.keys if reservation else ()
        row = history.entry_columns(
            chain=history.chain_of(keys[0] if keys else None, self._chains),
            at=at,
            action=action,
            actor=ACTOR,
            payload=payload,
            reservation_id=reservation.id if reservation else None,
            key=keys[0] if len(keys) == 1 else None,
        )
        prev = connection.execute(
            sa.text("SELECT hash FROM dp_chain_head WHERE id = :chain"), {"chain": row["chain"]}
        ).scalar_one()
        if self._sequence and connection.dialect.name == "postgresql":
            numbering = "SELECT nextval('dp_history_seq')"
        else:
            numbering = "SELECT coalesce(max(seq), 0) + 1 FROM dp_history"
        seq = connection.execute(sa.text(numbering)).scalar_one()
        values = history.linked(row, (prev, seq, None), history.UNKEYED)
        self._insert(connection, "dp_history", values)
        connection.execute(
            sa.text("UPDATE dp_chain_head SET seq = :seq, hash = :hash WHERE id = :chain"),
            {"seq": values["seq"], "hash": values["hash"], "chain": row["chain"]},
        )

    def _insert(self, connection: sa.Connection, table: str, row: Mapping[str, Any]) -> None:
        """``row`` with only the columns ``table`` has at this revision (a column a later
        revision added is left out; one this revision requires and ``row`` lacks fails)."""
        present = self._columns[table]
        insert_row(connection, table, {k: v for k, v in row.items() if k in present})

    @staticmethod
    def _now() -> str:
        return clock.stamp(clock.now())

    @contextmanager
    def _transaction(self) -> Iterator[sa.Connection]:
        engine = sa.create_engine(self.url)
        try:
            with engine.begin() as connection:
                yield connection
        finally:
            engine.dispose()
