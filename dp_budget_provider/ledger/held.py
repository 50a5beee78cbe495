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

from sqlalchemy import Connection, Select, any_, bindparam, func, literal, literal_column, select

from dp_budget_provider.ledger.keys import LedgerKey
from dp_budget_provider.ledger.schema import Account
from dp_budget_provider.ledger.spend import Pending, Spend
from dp_budget_provider.ledger.standing import SPEND_COLUMNS

# Subjects per statement: bounds the parameter (and the server's unpacked list) in memory.
CHUNK = 100_000


def _grouped(dialect: str) -> Select:
    """Distinct stored spends of one window's listed subjects, with how many hold each.

    The subjects are one parameter that the server unpacks: PostgreSQL splits a
    newline-separated text (canonical key parts hold no control character), SQLite reads
    a JSON array.
    """
    subjects = bindparam("subjects")
    if dialect == "postgresql":
        members = Account.subject == any_(func.string_to_array(subjects, literal("\n")))
    elif dialect == "sqlite":
        listed = select(literal_column("value")).select_from(func.json_each(subjects))
        members = Account.subject.in_(listed.scalar_subquery())
    else:
        raise ValueError(f"no grouped read for the {dialect} dialect")
    return (
        select(
            *SPEND_COLUMNS, func.count().label("holders"), func.min(Account.subject).label("first")
        )
        .where(
            Account.tenant == bindparam("tenant"),
            Account.query_type == bindparam("query_type"),
            Account.window == bindparam("window"),
            members,
        )
        .group_by(*SPEND_COLUMNS)
    )


@dataclass(frozen=True)
class HeldState:
    """One distinct state among the keys asked about, and how many keys hold it.

    ``example`` is the least key holding it; None only for the untouched (zero) state of
    a window some of whose keys are touched: zero spend is below every touched state of
    the same scope, so it is never the worst and never needs naming.
    """

    tenant: str
    query_type: str
    spend: Spend
    pending: Pending
    keys: int
    example: LedgerKey | None


def held_states(connection: Connection, keys: Sequence[LedgerKey], size: int) -> list[HeldState]:
    """The distinct (committed, pending) states of ``keys`` (distinct keys), grouped per
    window; a key with no account holds the zero state."""
    dialect = connection.dialect.name
    statement = _grouped(dialect)
    by_window: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for key in keys:
        by_window[(key.tenant, key.query_type, key.window)].append(key.subject)
    states: list[HeldState] = []
    for (tenant, query_type, window), subjects in by_window.items():
        for start in range(0, len(subjects), CHUNK):
            chunk = subjects[start : start + CHUNK]
            packed = json.dumps(chunk) if dialect == "sqlite" else "\n".join(chunk)
            rows = connection.execute(
                statement,
                {"tenant": tenant, "query_type": query_type, "window": window, "subjects": packed},
            ).all()
            touched = 0
            for row in rows:
                touched += row.holders
                states.append(
                    HeldState(
                        tenant,
                        query_type,
                        Spend.from_columns(row.rho, row.residual, row.gaussian_mu2, size),
                        Pending.from_columns(
                            row.pending_rho,
                            row.pending_residual,
                            row.pending_mu2,
                            row.pending_others,
                            size,
                        ),
                        row.holders,
                        LedgerKey.from_canonical(tenant, row.first, query_type, window),
                    )
                )
            if touched < len(chunk):
                first = min(chunk)
                example = (
                    None if rows else LedgerKey.from_canonical(tenant, first, query_type, window)
                )
                states.append(
                    HeldState(tenant, query_type, Spend(), Pending(), len(chunk) - touched, example)
                )
    return states
