"""The history replayed: read in order with each entry's reservation keys and cohort links,
and each entry applied by the acts (``replay_acts``) or the charges (``replay_charges``)
its action names.
"""

from __future__ import annotations

import itertools
import json
import operator
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from sqlalchemy import Connection, func, select

from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.audit.replay_acts import Configuration
from dp_budget_provider.ledger.audit.replay_charges import Charges
from dp_budget_provider.ledger.audit.replay_state import (
    BATCH,
    ENTRY_BATCH,
    AuditSettings,
    Findings,
)
from dp_budget_provider.ledger.audit.replay_stored import KeptAnswers
from dp_budget_provider.ledger.errors import LedgerCorrupt
from dp_budget_provider.ledger.storage.entries import ENTRY_KINDS, RefiningEntry
from dp_budget_provider.ledger.storage.schema import (
    ChargeCohort,
    Cohort,
    HistoryEntry,
    ReservationKey,
)


class Replay:
    """The history applied in order: what every table must hold, and every breach on the way."""

    def __init__(self, settings: AuditSettings) -> None:
        self.findings = Findings()
        self.configuration = Configuration(self.findings, settings)
        self.charges = Charges(settings, self.configuration, self.findings)
        self.kept = KeptAnswers(self.findings)
        self._handlers = {
            **self.configuration.handlers(),
            **self.charges.handlers(),
            **self.kept.handlers(),
        }

    def apply(self, entry: Any, keys: list[LedgerKey], links: list[tuple[str, ...]]) -> None:
        """Apply one entry (with its reservation's keys, in order, and the cohorts
        ``dp_charge_cohorts`` links it to: (tenant, digest, query type, window)): its
        payload is read once, as the record of its kind, which its handler applies."""
        try:
            payload = json.loads(entry.payload)
            # An action is found whether its words are joined by "-" or "_", as it was when
            # the replay looked its handler up by name.
            kind = ENTRY_KINDS.get(entry.action.replace("_", "-"))
            if kind is None:
                self.findings.problem(entry, "an action the ledger never writes")
                return
            record = kind.from_payload(payload)
            self._handlers[kind](entry, record, keys)
            self.kept.note(entry, record)
            charged = record.cohorts if isinstance(record, RefiningEntry) else None
            covered = [(c.tenant, c.cohort, c.query_type, c.window) for c in charged or ()]
            if sorted(links) != sorted(covered):
                self.findings.problem(
                    entry, "its rows in dp_charge_cohorts are not the cohorts it covered"
                )
        except (ValueError, KeyError, TypeError, AttributeError, LedgerCorrupt) as error:
            self.findings.problem(entry, f"unreadable payload ({error!r}); edited?")


def read_history(
    connection: Connection,
) -> Iterator[tuple[Any, list[LedgerKey], list[tuple[str, ...]]]]:
    """Every entry in order, streamed, with its reservation's keys in position order and
    the cohorts ``dp_charge_cohorts`` links it to ((tenant, digest, query type, window);
    a link to no stored cohort has an empty tenant and digest).

    The entries, their key rows and their links are streams merged by seq, so that an
    entry's payload is read once, not once per key row: a charge's payload lists the
    accounts and refinements of its cohorts, as many as its key rows. Entries come in
    smaller batches than other rows for the same reason.
    """
    keys = ReservationKey.__table__.alias("k")
    entries = connection.execution_options(yield_per=ENTRY_BATCH).execute(
        select(HistoryEntry).order_by(HistoryEntry.seq)
    )
    keys_of = _by_seq(
        connection.execution_options(yield_per=BATCH).execute(
            select(
                HistoryEntry.seq,
                keys.c.tenant.label("k_tenant"),
                keys.c.subject.label("k_subject"),
                keys.c.query_type.label("k_query_type"),
                keys.c.window.label("k_window"),
                keys.c.position.label("k_position"),
            )
            .join(keys, keys.c.reservation_id == HistoryEntry.reservation_id)
            .order_by(HistoryEntry.seq, keys.c.position)
        )
    )
    links_of = _by_seq(
        connection.execution_options(yield_per=BATCH).execute(
            select(
                ChargeCohort.seq,
                func.coalesce(Cohort.tenant, ""),
                func.coalesce(Cohort.digest, ""),
                ChargeCohort.query_type,
                ChargeCohort.window,
            )
            .join(HistoryEntry, HistoryEntry.seq == ChargeCohort.seq)
            .outerjoin(Cohort, Cohort.id == ChargeCohort.cohort_id)
            .order_by(ChargeCohort.seq)
        )
    )
    for entry in entries:
        rows_of_entry = keys_of(entry.seq)
        listed = [_reservation_key(row) for row in rows_of_entry]
        if any(row.k_position != index for index, row in enumerate(rows_of_entry)):
            listed.insert(0, _MISNUMBERED)  # its reserved keys can no longer match their digest
        yield entry, listed, [tuple(row[1:]) for row in links_of(entry.seq)]


def _by_seq(rows: Iterable[Any]) -> Callable[[int], list[Any]]:
    """The rows of each entry, from ``rows`` ordered by seq (their first column, each
    an entry's): asked for every entry in order, it reads each row once."""
    groups = itertools.groupby(rows, key=operator.itemgetter(0))
    current = next(groups, None)

    def of(seq: int) -> list[Any]:
        nonlocal current
        if current is None or current[0] != seq:
            return []
        found = list(current[1])
        current = next(groups, None)
        return found

    return of


# Stands in for key rows whose positions are not 0..n-1 (edited in SQL).
_MISNUMBERED = LedgerKey.from_canonical("", "", "", "positions edited")


def _reservation_key(row: Any) -> LedgerKey:
    return LedgerKey.from_canonical(row.k_tenant, row.k_subject, row.k_query_type, row.k_window)
