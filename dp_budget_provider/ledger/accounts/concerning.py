"""Which history entries and reservations concern a key: an account's, or a subject's.

An account key (a ``Class-...`` label, or a subject's key from before spend classes) is
named by value: in the key columns of its single-key entries and in its reservations'
key rows. A subject key is named by neither once its charges go to classes: a subject's
charges are found through the cohorts that hold it (``dp_charge_cohorts`` links each
charge entry to the cohorts it covered), so they survive the splits and resets of the
accounts it passed through; its reservations are those of its charge entries. Both are
plain selects of ids, each branch an indexed lookup, for the reader to filter by.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import and_, select, union

from dp_budget_provider.ledger.accounts import classes
from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.storage.schema import (
    ChargeCohort,
    Cohort,
    CohortMember,
    HistoryEntry,
    ReservationKey,
)


def _named(columns: tuple[Any, Any, Any, Any], key: LedgerKey) -> Any:
    tenant, subject, query_type, window = columns
    return and_(
        tenant == key.tenant,
        subject == key.subject,
        query_type == key.query_type,
        window == key.window,
    )


def charges(key: LedgerKey) -> Any:
    """Seqs of the charge entries (reserve, correction, rescope) covering subject ``key``
    through one of its cohorts."""
    return (
        select(ChargeCohort.seq)
        .join(CohortMember, CohortMember.cohort_id == ChargeCohort.cohort_id)
        .join(Cohort, Cohort.id == ChargeCohort.cohort_id)
        .where(
            CohortMember.subject == key.subject,
            Cohort.tenant == key.tenant,
            ChargeCohort.query_type == key.query_type,
            ChargeCohort.window == key.window,
        )
    )


def reservations(key: LedgerKey) -> Any:
    """Ids of the reservations holding ``key``: by value (an account key, or a subject's
    from before classes), and for a subject those its charges reserved."""
    columns = (
        ReservationKey.tenant,
        ReservationKey.subject,
        ReservationKey.query_type,
        ReservationKey.window,
    )
    by_value = select(ReservationKey.reservation_id).where(_named(columns, key))
    if classes.is_label(key.subject):
        return by_value
    reserved = select(HistoryEntry.reservation_id).where(
        HistoryEntry.seq.in_(charges(key)), HistoryEntry.reservation_id.is_not(None)
    )
    return union(by_value, reserved)


def entries(key: LedgerKey, *also: Any) -> Any:
    """Seqs of the history entries concerning ``key``: those naming it, those of its
    reservations and, for a subject, the charges of its cohorts; and those of the
    selects ``also`` (one UNION: each branch an indexed lookup, never an OR that would
    scan the history)."""
    columns = (
        HistoryEntry.tenant,
        HistoryEntry.subject,
        HistoryEntry.query_type,
        HistoryEntry.window,
    )
    own = select(HistoryEntry.seq).where(_named(columns, key))
    held = select(HistoryEntry.seq).where(HistoryEntry.reservation_id.in_(reservations(key)))
    if classes.is_label(key.subject):
        return union(own, held, *also)
    return union(own, held, charges(key), *also)
