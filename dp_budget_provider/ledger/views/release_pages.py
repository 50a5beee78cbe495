"""Releases: what one release held, and the releases that held one key.

A release is a reservation, whatever became of it (open, committed, released, reaped). Its
page, which the task link of a release opens, shows it with a page of the accounts it
held, each a subject's or a spend class's covering many subjects (:func:`release`); an
account's page lists the reservations that held its key (:func:`key_reservations`). How
many subjects a reservation covered is what its ``reserve`` entry charged: the sizes of
its cohorts (:func:`reserve_cohorts`), since one account may be a class of 10^5 subjects.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, func, select

from dp_budget_provider.ledger.accounts import concerning
from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.ledger import PrivacyBudgetLedger
from dp_budget_provider.ledger.records import COMMITTED, OPEN, REAPED, RELEASED
from dp_budget_provider.ledger.storage.schema import HistoryEntry, ReservationKey
from dp_budget_provider.ledger.storage.schema import Reservation as ReservationRow
from dp_budget_provider.ledger.views.pages import Epsilons, Page, page_bounds

RESERVATION_STATES = (OPEN, COMMITTED, RELEASED, REAPED)


def reserve_cohorts(
    connection: Connection, reservation_ids: Iterable[str]
) -> dict[str, list[dict[str, Any]]]:
    """Reservation id -> the cohorts its ``reserve`` entry charged (their sizes count the
    subjects a reservation covers: one account may be a class of 10^5 of them). Ids whose
    entry predates spend classes are absent."""
    ids = sorted(set(reservation_ids))
    found: dict[str, list[dict[str, Any]]] = {}
    for start in range(0, len(ids), 1000):
        rows = connection.execute(
            select(HistoryEntry.reservation_id, HistoryEntry.payload).where(
                HistoryEntry.action == "reserve",
                HistoryEntry.reservation_id.in_(ids[start : start + 1000]),
            )
        )
        for reservation_id, payload in rows:
            cohorts = json.loads(payload).get("cohorts")
            if cohorts is not None:
                found[reservation_id] = cohorts
    return found


def _reservation_item(
    row: Any, cohorts: list[dict[str, Any]] | None, epsilons: Epsilons
) -> dict[str, Any]:
    """A reservation as the pages and the API show it (``cohorts``: its reserve entry's)."""
    return {
        "id": row.id,
        "attempt_id": row.attempt_id,
        "state": row.state,
        "mechanism": json.loads(row.mechanism),
        "count": row.count,
        "key_count": row.key_count,
        # before spend classes each key was a subject
        "subjects": row.key_count if cohorts is None else sum(c["size"] for c in cohorts),
        "cost_epsilon": epsilons.of_columns(
            row.cost_rho, row.cost_residual, row.cost_gaussian_mu2
        ).epsilon,
        "prospective_epsilon": row.prospective_epsilon
        if row.prospective_epsilon is not None
        else epsilons.of_columns(row.prospective_rho, None, row.prospective_mu2).epsilon,
        "actor": row.actor,
        "created_at": row.created_at,
        "resolved_at": row.resolved_at,
    }


@dataclass(frozen=True)
class Release:
    """One release (a reservation, whatever became of it) and a page of the accounts it
    held: each a subject's, or a spend class's covering many subjects."""

    reservation: dict[str, Any]
    windows: list[str]
    accounts: Page[LedgerKey]


def release(
    ledger: PrivacyBudgetLedger, reservation_id: str, *, limit: int = 50, offset: int = 0
) -> Release | None:
    """The release of ``reservation_id`` (None if there is none): what the task link of a
    release opens, for a release over one subject or a million."""
    limit, offset = page_bounds(limit, offset)
    keys = select(
        ReservationKey.tenant,
        ReservationKey.subject,
        ReservationKey.query_type,
        ReservationKey.window,
    )
    with ledger.reading() as connection:
        row = connection.execute(
            select(ReservationRow).where(ReservationRow.id == reservation_id)
        ).first()
        if row is None:
            return None
        cohorts = reserve_cohorts(connection, [reservation_id]).get(reservation_id)
        held = ReservationKey.reservation_id == reservation_id
        windows = sorted(connection.scalars(select(ReservationKey.window).where(held).distinct()))
        total = connection.execute(
            select(func.count()).select_from(ReservationKey).where(held)
        ).scalar_one()
        found = connection.execute(
            keys.where(held).order_by(ReservationKey.position).offset(offset).limit(limit)
        ).all()
    return Release(
        reservation=_reservation_item(row, cohorts, Epsilons(ledger)),
        windows=windows,
        accounts=Page(
            total=total, offset=offset, limit=limit, items=[LedgerKey.from_row(k) for k in found]
        ),
    )


def key_reservations(
    ledger: PrivacyBudgetLedger,
    key: LedgerKey,
    *,
    states: Iterable[str] | None = None,
    limit: int = 50,
    offset: int = 0,
) -> Page[dict[str, Any]]:
    """Reservations holding ``key`` (newest first), optionally only in ``states``."""
    limit, offset = page_bounds(limit, offset)
    wanted = None if states is None else sorted(set(states))
    for state in wanted or []:
        if state not in RESERVATION_STATES:
            raise ValueError(f"reservation state must be one of {RESERVATION_STATES}: {state!r}")
    base = select(ReservationRow).where(ReservationRow.id.in_(concerning.reservations(key)))
    if wanted is not None:
        base = base.where(ReservationRow.state.in_(wanted))
    counted = base.with_only_columns(func.count()).order_by(None)
    page = base.order_by(ReservationRow.created_at.desc(), ReservationRow.id).offset(offset)
    epsilons = Epsilons(ledger)
    with ledger.reading() as connection:
        total = int(connection.execute(counted).scalar_one())
        rows = list(connection.execute(page.limit(limit)))
        cohorts = reserve_cohorts(connection, [row.id for row in rows])
    items = [_reservation_item(row, cohorts.get(row.id), epsilons) for row in rows]
    return Page(total=total, offset=offset, limit=limit, items=items)
