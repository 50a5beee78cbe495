"""What many keys hold, read as distinct states: one budget check over a whole cohort.

A release charges every key it covers the same cost, so the keys of a cohort hold few
distinct (committed, pending) states however many subjects it has. Reading them grouped
by state lets one check decide for a million keys with a handful of conversions; the
subjects travel to the database as one parameter per window and chunk (a list the
server unpacks), never as one bound parameter or one round trip per key. Equal states
of different chunks and windows are merged: one state per scope and stored value.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from sqlalchemy import Connection, Select, any_, bindparam, func, literal, literal_column, select

from dp_budget_provider.ledger.keys import LedgerKey
from dp_budget_provider.ledger.schema import Account, Member
from dp_budget_provider.ledger.spend import Pending, Spend
from dp_budget_provider.ledger.standing import SPEND_COLUMNS
from dp_budget_provider.ledger.statements import member_account, newline_joined

# Subjects per statement: bounds the parameter (and the server's unpacked list) in memory.
# One statement scans the window's accounts once (~1.2 s for 10^6 on PostgreSQL); ten
# chunks of a million-subject cohort would scan it ten times.
CHUNK = 1_000_000


def _grouped(dialect: str) -> Select:
    """Distinct stored spends of one window's listed subjects (through the accounts of
    their classes), with how many subjects hold each.

    The subjects are one parameter that the server unpacks: PostgreSQL splits a
    newline-separated text (canonical key parts hold no control character), SQLite reads
    a JSON array.
    """
    subjects = bindparam("subjects")
    if dialect == "postgresql":
        members = Member.subject == any_(func.string_to_array(subjects, literal("\n")))
    elif dialect == "sqlite":
        listed = select(literal_column("value")).select_from(func.json_each(subjects))
        members = Member.subject.in_(listed.scalar_subquery())
    else:
        raise ValueError(f"no grouped read for the {dialect} dialect")
    # Re-scoped accounts form their own groups: no release may charge them.
    grouping = (*SPEND_COLUMNS, Account.rescoped_to)
    return (
        select(*grouping, func.count().label("holders"), func.min(Member.subject).label("first"))
        .select_from(Member)
        .join(Account, member_account())
        .where(
            Member.tenant == bindparam("tenant"),
            Member.query_type == bindparam("query_type"),
            Member.window == bindparam("window"),
            members,
        )
        .group_by(*grouping)
    )


@dataclass(frozen=True)
class HeldState:
    """One distinct state among the keys asked about, and how many keys hold it.

    ``example`` is the least key holding it; None only for the untouched (zero) state
    when every chunk of keys it came from also held touched keys: zero spend is below
    every touched state of the same scope, so it is never the worst and never needs
    naming. ``rescoped_to`` is the query type the keys' spend moved to if they were
    re-scoped (never chargeable).
    """

    tenant: str
    query_type: str
    spend: Spend
    pending: Pending
    keys: int
    example: LedgerKey | None
    rescoped_to: str | None = None


def _least(a: LedgerKey | None, b: LedgerKey | None) -> LedgerKey | None:
    return b if a is None else a if b is None else min(a, b)


def held_states(connection: Connection, keys: Sequence[LedgerKey], size: int) -> list[HeldState]:
    """The distinct (committed, pending) states of ``keys`` (distinct keys), one per scope
    and stored value; a key with no account holds the zero state."""
    dialect = connection.dialect.name
    statement = _grouped(dialect)
    by_window: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for key in keys:
        by_window[(key.tenant, key.query_type, key.window)].append(key.subject)
    merged: dict[tuple[object, ...], HeldState] = {}

    def add(signature: tuple[object, ...], state: HeldState) -> None:
        seen = merged.get(signature)
        if seen is not None:
            example = _least(seen.example, state.example)
            state = replace(seen, keys=seen.keys + state.keys, example=example)
        merged[signature] = state

    for (tenant, query_type, window), subjects in by_window.items():
        for start in range(0, len(subjects), CHUNK):
            chunk = subjects[start : start + CHUNK]
            packed = json.dumps(chunk) if dialect == "sqlite" else newline_joined(chunk)
            rows = connection.execute(
                statement,
                {"tenant": tenant, "query_type": query_type, "window": window, "subjects": packed},
            ).all()
            touched = 0
            for row in rows:
                touched += row.holders
                stored = tuple(getattr(row, column.key) for column in SPEND_COLUMNS)
                add(
                    (tenant, query_type, row.rescoped_to, stored),
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
                        row.rescoped_to,
                    ),
                )
            if touched < len(chunk):
                first = (
                    None
                    if rows
                    else LedgerKey.from_canonical(tenant, min(chunk), query_type, window)
                )
                add(
                    (tenant, query_type, None, "untouched"),
                    HeldState(tenant, query_type, Spend(), Pending(), len(chunk) - touched, first),
                )
    return list(merged.values())
