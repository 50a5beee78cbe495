"""Reservation rows read back: by attempt, as :class:`Reservation` values, with their keys.

Shared by the reservations (a reused attempt, a repeated commit) and the reading of open
reservations, so a stored reservation is read one way.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Connection, select

from dp_budget_provider.accounting import Mechanism
from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.accounts.pricing import Pricing
from dp_budget_provider.ledger.records import Reservation
from dp_budget_provider.ledger.storage.schema import Reservation as ReservationRow
from dp_budget_provider.ledger.storage.schema import ReservationKey


def by_attempt(connection: Connection, attempt_id: str) -> Any:
    """The reservation row ``attempt_id`` made, None if it made none."""
    return connection.execute(
        select(ReservationRow).where(ReservationRow.attempt_id == attempt_id)
    ).one_or_none()


def reservation_of(row: Any, keys: tuple[LedgerKey, ...], pricing: Pricing) -> Reservation:
    """A stored reservation as the value ``reserve`` returned (without its token)."""
    prospective = row.prospective_epsilon
    if prospective is None:  # decided by the server: it recorded the spend
        prospective = pricing.stored_epsilon(row.prospective_rho, row.prospective_mu2)
    return Reservation(
        id=row.id,
        attempt_id=row.attempt_id,
        keys=keys,
        mechanism=Mechanism.from_spec(json.loads(row.mechanism)),
        count=row.count,
        state=row.state,
        prospective_epsilon=prospective,
        created_at=row.created_at,
        lease_expires_at=row.lease_expires_at,
    )


def keys_of(connection: Connection, reservation_id: str) -> list[LedgerKey]:
    """The accounts a reservation holds, in key order: those it was made on and the
    parts that splits carried to it later (stored after them)."""
    rows = connection.execute(
        select(ReservationKey).where(ReservationKey.reservation_id == reservation_id)
    )
    return sorted(LedgerKey.from_row(row) for row in rows)
