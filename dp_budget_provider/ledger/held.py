"""What many keys hold, read as distinct states: one budget check over a whole cohort.

A release charges every key it covers the same cost, so the keys of a cohort hold few
distinct (committed, pending) states however many subjects it has. Reading them grouped
by state lets one check decide for a million keys with a handful of conversions; the
subjects travel to the database as one parameter per window and chunk (a list the
server unpacks), never as one bound parameter or one round trip per key.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, text

from dp_budget_provider.ledger.keys import LedgerKey
from dp_budget_provider.ledger.spend import Pending, Spend
from dp_budget_provider.ledger.statements import newline_joined

# Subjects per statement: bounds the parameter (and the server's unpacked list) in memory.
CHUNK = 100_000

# The stored spend columns, in the order Spend.from_columns and Pending.from_columns read.
_STATE = "rho, residual, gaussian_mu2, pending_rho, pending_residual, pending_mu2, pending_others"
# Re-scoped accounts form their own groups: no release may charge them.
_GROUPED = (
    f"SELECT {_STATE}, count(*), min(subject), rescoped_to FROM dp_accounts "
    'WHERE tenant = :tenant AND query_type = :query_type AND "window" = :window '
    "AND subject {members} GROUP BY {_STATE}, rescoped_to"
)
# Canonical key parts hold no control character, so a newline separates subjects safely
# (``newline_joined`` refuses a part that holds one).
_MEMBERS = {
    "postgresql": "= ANY(string_to_array(:subjects, E'\\n'))",
    "sqlite": "IN (SELECT value FROM json_each(:subjects))",
}


@dataclass(frozen=True)
class HeldState:
    """One distinct state among the keys asked about, and how many keys hold it.

    ``example`` is the least key holding it; None only for the untouched (zero) state of
    a window some of whose keys are touched: zero spend is below every touched state of
    the same scope, so it is never the worst and never needs naming. ``rescoped_to`` is
    the query type the keys' spend moved to if they were re-scoped (never chargeable).
    """

    tenant: str
    query_type: str
    spend: Spend
    pending: Pending
    keys: int
    example: LedgerKey | None
    rescoped_to: str | None = None


def held_states(connection: Connection, keys: Sequence[LedgerKey], size: int) -> list[HeldState]:
    """The distinct (committed, pending) states of ``keys`` (distinct keys), grouped per
    window; a key with no account holds the zero state."""
    members = _MEMBERS.get(connection.dialect.name)
    if members is None:
        raise ValueError(f"no grouped read for the {connection.dialect.name} dialect")
    statement = text(_GROUPED.format(members=members, _STATE=_STATE))
    by_window: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for key in keys:
        by_window[(key.tenant, key.query_type, key.window)].append(key.subject)
    states: list[HeldState] = []
    for (tenant, query_type, window), subjects in by_window.items():
        for start in range(0, len(subjects), CHUNK):
            chunk = subjects[start : start + CHUNK]
            packed = (
                json.dumps(chunk) if connection.dialect.name == "sqlite" else newline_joined(chunk)
            )
            rows = connection.execute(
                statement,
                {"tenant": tenant, "query_type": query_type, "window": window, "subjects": packed},
            ).all()
            touched = 0
            for row in rows:
                touched += row[7]
                states.append(
                    HeldState(
                        tenant,
                        query_type,
                        Spend.from_columns(row[0], row[1], row[2], size),
                        Pending.from_columns(row[3], row[4], row[5], row[6], size),
                        row[7],
                        LedgerKey.from_canonical(tenant, row[8], query_type, window),
                        row[9],
                    )
                )
            if touched < len(chunk):
                example = (
                    None
                    if rows
                    else LedgerKey.from_canonical(tenant, min(chunk), query_type, window)
                )
                states.append(
                    HeldState(tenant, query_type, Spend(), Pending(), len(chunk) - touched, example)
                )
    return states
