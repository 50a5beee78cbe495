"""One account over time: the history entries concerning a key, and its cumulative epsilon.

An account page shows what happened to one key: a page of the history entries that
concern it (its charges, the reservations holding it, the resets and rescopes that closed
it), each with its reservation's mechanism and count (:func:`key_history`), and the chart
of its epsilon after each charge, replayed from that history (:func:`spend_series`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Connection, and_, case, func, select

from dp_budget_provider.ledger.accounts import concerning
from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.accounts.spend import Spend
from dp_budget_provider.ledger.ledger import PrivacyBudgetLedger
from dp_budget_provider.ledger.storage import history
from dp_budget_provider.ledger.storage.schema import HistoryEntry
from dp_budget_provider.ledger.storage.schema import Reservation as ReservationRow
from dp_budget_provider.ledger.views.pages import Epsilons, Page, page_bounds

_CHARGES = ("commit", "reap")
CLOSINGS = ("reset", "rescope-away")  # series actions that end a key's account, not its spend


@dataclass(frozen=True)
class SeriesPoint:
    """The account's cumulative epsilon right after history entry ``seq``."""

    seq: int
    at: str
    action: str
    epsilon: float


@dataclass(frozen=True)
class SpendSeries:
    """Cumulative epsilon over time; ``points`` is at most ``max_points`` of ``events``."""

    events: int
    points: list[SeriesPoint]


def _concerning(connection: Connection, key: LedgerKey) -> Any:
    """Seqs of the entries concerning ``key`` (:func:`concerning.entries`) and of those
    that closed it (:func:`_closings`)."""
    closing_seqs = [seq for seq, _, _ in _closings(connection, key)]
    closed = select(HistoryEntry.seq).where(HistoryEntry.seq.in_(closing_seqs))
    return concerning.entries(key, closed).subquery("concerning")


def _closings(connection: Connection, key: LedgerKey) -> list[tuple[int, str, str]]:
    """(seq, at, action) of the entries that ended ``key``'s account: resets of its window
    that sealed its scope, and rescopes away from it (action ``rescope-away``).

    Neither names ``key`` (a reset is keyless, a rescope names the new account, and the
    old one in its payload), so the history table would miss them and the chart would
    change with no matching row; both are read here, for both. A subject's rescope away
    from it is one of its charges already (:func:`concerning.charges`), found here too
    only when written before spend classes (its payload names the subject's key).
    """
    entries = select(HistoryEntry.seq, HistoryEntry.at, HistoryEntry.action, HistoryEntry.payload)
    moved = entries.where(
        HistoryEntry.action == "rescope",
        HistoryEntry.tenant == key.tenant,
        HistoryEntry.window == key.window,
    )
    found = [
        (row.seq, row.at, "rescope-away")
        for row in connection.execute(moved)
        if LedgerKey(**json.loads(row.payload)["from"]) == key
    ]
    resets = entries.where(HistoryEntry.action == "reset")
    found += [
        (row.seq, row.at, "reset")
        for row in connection.execute(resets)
        if _reset_closes(json.loads(row.payload), key)
    ]
    return found


def _reset_closes(payload: dict[str, Any], key: LedgerKey) -> bool:
    """Whether a reset entry dropped ``key``'s account: its window, and its scope among the
    sealed ones (entries written before windows were sealed name no scopes: all of them)."""
    if payload.get("window") != key.window:
        return False
    sealed = payload.get("sealed")
    return sealed is None or [key.tenant, key.query_type] in sealed


def key_history(
    ledger: PrivacyBudgetLedger,
    key: LedgerKey,
    *,
    limit: int = 50,
    offset: int = 0,
    newest_first: bool = True,
) -> Page[dict[str, Any]]:
    """One page of the history entries concerning ``key``, with the total count.

    Each entry is the ledger's history dict (seq, at, action, actor, reservation_id, key,
    payload, hash) plus, when it belongs to a reservation, that reservation's
    ``attempt_id``, ``mechanism``, ``count``, ``key_count`` and ``state``.
    """
    limit, offset = page_bounds(limit, offset)
    columns = (
        HistoryEntry.seq,
        HistoryEntry.at,
        HistoryEntry.action,
        HistoryEntry.actor,
        HistoryEntry.reservation_id,
        HistoryEntry.tenant,
        HistoryEntry.subject,
        HistoryEntry.query_type,
        HistoryEntry.window,
        HistoryEntry.payload,
        HistoryEntry.hash,
    )
    with ledger.reading() as connection:
        seqs = _concerning(connection, key)
        total = int(connection.execute(select(func.count()).select_from(seqs)).scalar_one())
        # The page's seqs first, then only their rows.
        order = seqs.c.seq.desc() if newest_first else seqs.c.seq.asc()
        page = select(seqs.c.seq).order_by(order).offset(offset).limit(limit)
        order = HistoryEntry.seq.desc() if newest_first else HistoryEntry.seq.asc()
        query = select(*columns).where(HistoryEntry.seq.in_(page)).order_by(order)
        rows = list(connection.execute(query))
        reservations = _reservations_by_id(
            connection, sorted({r.reservation_id for r in rows if r.reservation_id})
        )
    items = []
    for row in rows:
        entry = history.entry_record(row)
        reservation = reservations.get(row.reservation_id or "")
        if reservation is not None:
            entry.update(
                attempt_id=reservation.attempt_id,
                mechanism=json.loads(reservation.mechanism),
                count=reservation.count,
                key_count=reservation.key_count,
                state=reservation.state,
            )
        items.append(entry)
    return Page(total=total, offset=offset, limit=limit, items=items)


def _reservations_by_id(connection: Connection, ids: Sequence[str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for start in range(0, len(ids), 1000):
        chunk = ids[start : start + 1000]
        for row in connection.execute(select(ReservationRow).where(ReservationRow.id.in_(chunk))):
            found[row.id] = row
    return found


Event = tuple[int, str, str, Spend]  # (seq, at, action, cost)


def spend_series(
    ledger: PrivacyBudgetLedger, key: LedgerKey, *, max_points: int = 200
) -> SpendSeries:
    """``key``'s cumulative epsilon after each charge, replayed from the history.

    Charges are commits and reaps of reservations holding the key, corrections of the key
    and spend carried onto it by a rescope. A reset of its window or a rescope away from
    it ends the account but refunds nothing (the window or the key is sealed), so the
    curve is the key's lifetime spend: it never drops, and such a closing is a point at
    the level reached, matching the history row that :func:`key_history` lists for it.
    With more than ``max_points`` events, an evenly spaced subset (first and last always
    included) is converted, plus every closing; the curve is monotone, so the subset is an
    honest picture.
    """
    if not isinstance(max_points, int) or max_points < 2:
        raise ValueError(f"max_points must be an integer >= 2, got {max_points!r}")
    size = np.asarray(ledger.orders).size
    needs_payload = HistoryEntry.action.in_(("correction", "rescope"))
    columns = (
        HistoryEntry.seq,
        HistoryEntry.at,
        HistoryEntry.action,
        HistoryEntry.query_type,
        case((needs_payload, HistoryEntry.payload), else_=None).label("payload"),
        ReservationRow.cost_rho,
        ReservationRow.cost_residual,
        ReservationRow.cost_gaussian_mu2,
    )
    events: list[Event] = []
    with ledger.reading() as connection:
        closing_seqs = {seq for seq, _, _ in _closings(connection, key)}
        seqs = _concerning(connection, key)
        query = (
            select(*columns)
            .where(HistoryEntry.seq.in_(select(seqs.c.seq)))
            .outerjoin(
                ReservationRow,
                and_(
                    ReservationRow.id == HistoryEntry.reservation_id,
                    HistoryEntry.action.in_(_CHARGES),
                ),
            )
        )
        for row in connection.execute(query):
            event = _event(row, key, row.seq in closing_seqs, size)
            if event is not None:
                events.append(event)
    events.sort(key=lambda event: event[0])
    closings = {index for index, event in enumerate(events) if event[2] in CLOSINGS}
    wanted = _sample(len(events), max_points) | closings
    epsilons = Epsilons(ledger)
    total = Spend()
    points = []
    for index, (seq, at, action, cost) in enumerate(events):
        total = total.plus(cost)
        if index in wanted:
            points.append(SeriesPoint(seq, at, action, epsilons.of_spend(total)))
    return SpendSeries(events=len(events), points=points)


def _event(row: Any, key: LedgerKey, closing: bool, size: int) -> Event | None:
    """What one entry concerning ``key`` adds to its spend: (seq, at, action, cost), None
    for an entry that charges nothing (reserve, release).

    A commit or reap charges its reservation's cost, a correction its own, a rescope onto
    the key what it carried; a rescope away (a rescope of another query type) and a reset
    close the account, adding nothing.
    """
    if row.action in _CHARGES:
        cost = Spend.from_columns(row.cost_rho, row.cost_residual, row.cost_gaussian_mu2, size)
        return row.seq, row.at, row.action, cost
    if row.action == "correction":
        cost = Spend.from_payload(json.loads(row.payload)["cost"], size)
        return row.seq, row.at, row.action, cost
    if row.action == "rescope" and row.query_type == key.query_type:
        cost = Spend.from_payload(json.loads(row.payload)["carried"], size)
        return row.seq, row.at, row.action, cost
    if row.action == "rescope":
        return row.seq, row.at, "rescope-away", Spend()
    if closing:
        return row.seq, row.at, row.action, Spend()
    return None


def _sample(count: int, max_points: int) -> set[int]:
    if count <= max_points:
        return set(range(count))
    return {int(round(i)) for i in np.linspace(0, count - 1, max_points)}
