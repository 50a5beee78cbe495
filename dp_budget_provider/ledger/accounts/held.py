"""What many keys hold, read as distinct states: one budget check over a whole cohort.

A release charges every key it covers the same cost, so the keys of a cohort hold few
distinct (committed, pending) states however many subjects it has. Reading them grouped
by state lets one check decide for a million keys with a handful of conversions; the
subjects travel to the database as one parameter per window and chunk (a list the
server unpacks), never as one bound parameter or one round trip per key. Equal states
of different chunks and windows are merged: one state per scope and stored value.
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Select,
    any_,
    bindparam,
    func,
    literal,
    literal_column,
    select,
)

from dp_budget_provider.ledger.accounts.classes import CohortKeys, registered_id
from dp_budget_provider.ledger.accounts.grouped import grouped_spend
from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.accounts.memberships import Arm, in_scope
from dp_budget_provider.ledger.accounts.spend import Pending, Spend
from dp_budget_provider.ledger.accounts.standing import SPEND_COLUMNS
from dp_budget_provider.ledger.storage.schema import Account, Cohort, CohortAccount, CohortMember
from dp_budget_provider.ledger.storage.statements import newline_joined

# Subjects per statement: bounds the parameter (and the server's unpacked list) in memory.
# One statement scans the window's accounts once (~1.2 s for 10^6 on PostgreSQL); ten
# chunks of a million-subject cohort would scan it ten times.
CHUNK = 1_000_000


# What a held state is: the stored spend, and the query type the spend moved to if the
# account was re-scoped (re-scoped accounts form their own states: no release may charge them).
STATE_COLUMNS = (*SPEND_COLUMNS, Account.rescoped_to)


def _grouped(dialect: str) -> Select:
    """Distinct stored spends of one window's listed subjects (through the accounts of
    their classes, both arms of ``memberships``), with how many subjects hold each
    (``size``) and the least of them (``subject``).

    The subjects are one parameter that the server unpacks: PostgreSQL splits a
    newline-separated text (canonical key parts hold no control character), SQLite reads
    a JSON array.
    """
    subjects = bindparam("subjects")
    if dialect == "postgresql":
        listed: Any = func.string_to_array(subjects, literal("\n"))
    elif dialect == "sqlite":
        listed = select(literal_column("value")).select_from(func.json_each(subjects))
    else:
        raise ValueError(f"no grouped read for the {dialect} dialect")

    def named(arm: Arm) -> list[ColumnElement[bool]]:
        member = (
            arm.subject == any_(listed)
            if dialect == "postgresql"
            else arm.subject.in_(listed.scalar_subquery())
        )
        scope = in_scope(bindparam("tenant"), bindparam("query_type"), bindparam("window"))
        return [*scope(arm), member]

    return grouped_spend(STATE_COLUMNS, named, per_subject=True, least=True)


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
            scope = (tenant, query_type, window)
            _add_rows(add, rows, scope, size, len(chunk), functools.partial(min, chunk))
    return list(merged.values())


def _add_rows(
    add: Callable[[tuple[object, ...], HeldState], None],
    rows: Sequence[Any],
    scope: tuple[str, str, str],
    size: int,
    asked: int,
    least: Callable[[], str],
) -> None:
    """The states of grouped rows of one window (``size`` subjects each, ``subject`` the
    least); the ``asked`` subjects no row holds are untouched, the zero state, named by
    ``least()`` only when no row holds any (see :class:`HeldState`)."""
    tenant, query_type, window = scope
    touched = 0
    for row in rows:
        touched += int(row.size)
        stored = tuple(getattr(row, column.key) for column in SPEND_COLUMNS)
        add(
            (tenant, query_type, row.rescoped_to, stored),
            HeldState(
                tenant,
                query_type,
                Spend.from_columns(row.rho, row.residual, row.gaussian_mu2, size),
                Pending.from_columns(
                    row.pending_rho, row.pending_residual, row.pending_mu2, row.pending_others, size
                ),
                int(row.size),
                LedgerKey.from_canonical(tenant, row.subject, query_type, window),
                row.rescoped_to,
            ),
        )
    if touched < asked:
        first = None if rows else LedgerKey.from_canonical(tenant, least(), query_type, window)
        add(
            (tenant, query_type, None, "untouched"),
            HeldState(tenant, query_type, Spend(), Pending(), asked - touched, first),
        )


def cohort_states(connection: Connection, covered: CohortKeys, size: int) -> list[HeldState]:
    """The distinct states of a registered cohort's subjects in one window.

    A cohort its window has seen is partitioned by the accounts listed for it: one
    grouped read of those accounts, however many subjects (a state's example is then an
    account key). A cohort new to the window is read through its members' accounts.
    """
    tenant, query_type, window = covered.tenant, covered.query_type, covered.window
    found = connection.execute(
        select(Cohort.id, Cohort.size).where(
            Cohort.tenant == tenant, Cohort.digest == covered.cohort.digest
        )
    ).one_or_none()
    cohort_id = registered_id(covered.cohort, None if found is None else tuple(found))
    listed = select(CohortAccount.account).where(
        CohortAccount.cohort_id == cohort_id,
        CohortAccount.query_type == query_type,
        CohortAccount.window == window,
    )

    def listed_accounts(accounts: Any) -> list[ColumnElement[bool]]:
        return [*in_scope(tenant, query_type, window)(accounts), accounts.subject.in_(listed)]

    # an account's label names the state (an account key), not its least member
    least_label = func.min(Account.subject).label("subject")
    rows = connection.execute(
        grouped_spend(STATE_COLUMNS, listed_accounts).add_columns(least_label)
    ).all()
    if not rows:
        cohort = select(CohortMember.subject).where(CohortMember.cohort_id == cohort_id)

        def members(arm: Arm) -> list[ColumnElement[bool]]:
            return [*in_scope(tenant, query_type, window)(arm), arm.subject.in_(cohort)]

        rows = connection.execute(
            grouped_spend(STATE_COLUMNS, members, per_subject=True, least=True)
        ).all()
    merged: dict[tuple[object, ...], HeldState] = {}

    def least() -> str:
        return connection.execute(
            select(func.min(CohortMember.subject)).where(CohortMember.cohort_id == cohort_id)
        ).scalar_one()

    _add_rows(
        merged.__setitem__, rows, (tenant, query_type, window), size, covered.cohort.size, least
    )
    return list(merged.values())
