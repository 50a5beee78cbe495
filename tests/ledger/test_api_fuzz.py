"""Fuzzing the ledger's public API with wrong types and out-of-range values.

Issue 15: only ``ValueError`` or a ``LedgerError`` may escape (no TypeError, OverflowError,
database driver errors, nor a driver's words dressed as a ValueError), and a refused call
writes nothing: every table the ledger keeps is compared before and after. Each operation
gets its own run, its arguments valid but one (now and then two) drawn from a garbage pool;
the ledger is a copy of a seeded SQLite file per operation (and one seeded PostgreSQL
database for a shorter run), so accepted calls pile up state the next examples meet.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from dp_budget_provider.accounting import GaussianMechanism, LaplaceMechanism
from dp_budget_provider.ledger import (
    BudgetCap,
    Cohort,
    LedgerError,
    LedgerKey,
    Policy,
    PrivacyBudgetLedger,
    Reservation,
    WindowCalendar,
    key_for,
)
from dp_budget_provider.ledger.accounts.classes import cohort_digest
from dp_budget_provider.ledger.storage.schema import (
    Account,
    ChainHead,
    ChargeCohort,
    CohortAccount,
    CohortMember,
    HistoryEntry,
    LedgerConfig,
    Member,
    PolicyRow,
    ReservationKey,
    Window,
)
from dp_budget_provider.ledger.storage.schema import Cohort as CohortRow
from dp_budget_provider.ledger.storage.schema import Reservation as ReservationRow
from tests.admin import AdminLedger
from tests.ledger_time import ledger_time_in

UTC = timezone.utc
CLOSED = "2020-w01"
OPEN = WindowCalendar().window_of(datetime.now(UTC))
ALICE = key_for("alice", "heatmap", CLOSED)
BOB = key_for("bob", "heatmap", OPEN)
CAROL = key_for("carol", "count", OPEN, tenant="acme")
# A cohort the seed registers, charged through its handle (content-addressed: known here).
CREW = Cohort("default", cohort_digest(["alice", "frank"]), 2)


class Opaque:
    """An object of no type the ledger knows, with a hostile repr."""

    def __repr__(self) -> str:
        return "<Opaque /etc/passwd\n>"


# Wrong types and out-of-range values, for any parameter.
GARBAGE = st.one_of(
    st.sampled_from(
        [
            None,
            True,
            False,
            0,
            -1,
            2**53 + 1,
            2**63,
            10**19,
            10**400,
            -(10**400),
            0.0,
            -0.0,
            1e-320,
            1e308,
            math.inf,
            -math.inf,
            math.nan,
            Decimal("NaN"),
            Decimal("1e400"),
            Fraction(1, 3),
            1 + 1j,
            np.float64("nan"),
            np.int64(2**62),
            np.float32(3.0),
            "",
            " ",
            "\x00",
            "a\x00b",
            "\u200b",
            "a\u034fb",
            "\ufe0f",
            "\ud800",
            "\udcff",
            "x" * 257,
            "y" * 3000,
            "z" * 70_000,
            "1",
            "nan",
            b"bytes",
            [],
            [1, 2],
            (),
            {},
            {"kind": "gaussian"},
            {"kind": "gaussian", "noise_multiplier": math.nan},
            {"kind": "gaussian", "noise_multiplier": 1e-200},
            {"kind": "gaussian", "noise_multiplier": "4"},
            {"kind": "laplace", "epsilon": 10**400},
            {"kind": "\x00"},
            timedelta.max,
            timedelta.min,
            timedelta(0),
            timedelta(seconds=-1),
            timedelta(microseconds=1),
            datetime.max,
            datetime.min,
            datetime(2026, 7, 14),
            datetime.max.replace(tzinfo=UTC),
            datetime.min.replace(tzinfo=UTC),
            datetime.min.replace(tzinfo=timezone(timedelta(hours=14))),
            datetime.max.replace(tzinfo=timezone(timedelta(hours=-14))),
            Opaque(),
            object,
            ALICE,
            WindowCalendar("fixed", 1),
        ]
    ),
    st.integers(),
    st.floats(),
    st.text(max_size=12),
)

KEYS = st.sampled_from([ALICE, BOB, CAROL, key_for("dave", "heatmap", OPEN)])
MECHANISMS = st.sampled_from(
    [
        GaussianMechanism(8.0),
        LaplaceMechanism(0.05),
        {"kind": "gaussian", "noise_multiplier": 6.0},
        {"kind": "laplace", "epsilon": 0.1},
    ]
)
COUNTS = st.sampled_from([1, 2])
REASONS = st.sampled_from(["", "operator note"])
TEXT = st.sampled_from(["default", "acme", "heatmap", "count", OPEN, CLOSED])


@dataclasses.dataclass
class Context:
    ledger: PrivacyBudgetLedger
    url: str
    serial: int = 0

    def attempt(self) -> str:
        self.serial += 1
        return f"fuzz/task/run/{self.serial}"


def _reservation(ctx: Context, draw: st.DrawFn) -> Any:
    """A reservation: the real one, one with its fields swapped for garbage, or garbage."""
    try:
        real = ctx.ledger.reserve(BOB, LaplaceMechanism(0.01), attempt=ctx.attempt())
    except LedgerError:  # BOB's budget is spent: reserve on a fresh subject
        ctx.serial += 1
        subject = key_for(f"s{ctx.serial}", "heatmap", OPEN)
        real = ctx.ledger.reserve(subject, LaplaceMechanism(0.01), attempt=ctx.attempt())
    kind = draw(st.integers(0, 2))
    if kind == 0:
        return real
    if kind == 1:
        field = draw(st.sampled_from(["id", "token", "keys", "count", "attempt_id"]))
        return dataclasses.replace(real, **{field: draw(GARBAGE)})
    return draw(GARBAGE)


# Each operation: (name, the valid strategy of each argument, the call).
Operation = tuple[str, list[Any], Callable[..., Any]]


def _policy(cap, warn, tenant, query_type, kind, length, min_window, clause, grace):
    return Policy(
        cap_epsilon=cap,
        warn_fraction=warn,
        tenant=tenant,
        query_type=query_type,
        calendar=WindowCalendar(kind, length),
        min_window=min_window,
        compliance_clause=clause,
        grace=grace,
    )


NOW = st.sampled_from([None, datetime.now(UTC)])
OPERATIONS: list[Operation] = [
    (
        "reserve",
        [
            st.one_of(
                KEYS,
                st.lists(KEYS, min_size=1, max_size=3),
                st.just(CREW.in_window("heatmap", OPEN)),
            ),
            MECHANISMS,
            COUNTS,
            st.none(),
        ],
        lambda ctx, keys, mech, count, attempt: ctx.ledger.reserve(
            keys, mech, count, attempt if attempt is not None else ctx.attempt()
        ),
    ),
    (
        "spend",
        [KEYS, MECHANISMS, COUNTS, st.none()],
        lambda ctx, key, mech, count, attempt: ctx.ledger.spend(
            key, mech, count, attempt if attempt is not None else ctx.attempt()
        ),
    ),
    ("commit", ["reservation"], lambda ctx, reservation: ctx.ledger.commit(reservation)),
    (
        "release",
        ["reservation", REASONS],
        lambda ctx, reservation, reason: ctx.ledger.release(reservation, reason),
    ),
    ("renew", ["reservation"], lambda ctx, reservation: ctx.ledger.renew(reservation)),
    (
        "keep_alive",
        ["reservation"],
        lambda ctx, reservation: ctx.ledger.keep_alive(reservation),
    ),
    (
        "reap",
        [st.sampled_from([None, timedelta(days=3650), timedelta(days=1)]), NOW],
        lambda ctx, older_than, now: ctx.ledger.reap(older_than, now=now),
    ),
    (
        "correct",
        [KEYS, MECHANISMS, COUNTS, st.just("missed release")],
        lambda ctx, key, mech, count, reason: ctx.ledger.correct(key, mech, count, reason),
    ),
    (
        "rescope",
        [
            st.just(key_for("erin", "snapshot", OPEN)),
            st.just(key_for("erin", "trajectory", OPEN)),
            REASONS,
        ],
        lambda ctx, old, new, reason: ctx.ledger.rescope(old, new, reason),
    ),
    ("reset", [st.sampled_from([CLOSED, OPEN, "2019-w52"])], lambda ctx, w: ctx.ledger.reset(w)),
    (
        "cohort",
        [
            st.lists(st.sampled_from(["alice", "Frank", "zed", 17]), min_size=1, max_size=3),
            st.sampled_from(["default", "acme"]),
        ],
        lambda ctx, subjects, tenant: ctx.ledger.cohort(subjects, tenant),
    ),
    (
        "accounts",
        [
            st.sampled_from([None, CLOSED]),
            st.sampled_from([None, "acme"]),
            st.sampled_from([None, 1, 10]),
            st.sampled_from([0, 1]),
        ],
        lambda ctx, window, tenant, limit, offset: ctx.ledger.accounts(
            window=window, tenant=tenant, limit=limit, offset=offset
        ),
    ),
    (
        "history",
        [st.sampled_from([None, ALICE]), st.sampled_from([0, 3]), st.sampled_from([None, 5])],
        lambda ctx, key, after, limit: ctx.ledger.history(key, after_seq=after, limit=limit),
    ),
    (
        "policy set",
        [
            st.sampled_from([2.0, 5.0]),
            st.sampled_from([0.8, 1.0]),
            st.sampled_from(["*", "acme"]),
            st.sampled_from(["*", "fresh"]),
            st.just("iso_week"),
            st.none(),
            st.just(timedelta(days=1)),
            st.sampled_from(["", "DPA s.3"]),
            st.just(timedelta(days=3)),
        ],
        lambda ctx, *fields: ctx.ledger.set_policy(_policy(*fields)),
    ),
    ("set_policy", [st.just(Policy(3.0))], lambda ctx, policy: ctx.ledger.set_policy(policy)),
    (
        "verify",
        [st.none(), st.just(True)],
        lambda ctx, checkpoint, quarantine: ctx.ledger.verify(checkpoint, quarantine=quarantine),
    ),
    (
        "windows_for",
        [
            TEXT,
            TEXT,
            st.just(datetime(2026, 7, 14, tzinfo=UTC)),
            st.sampled_from([None, datetime(2026, 8, 1, tzinfo=UTC)]),
        ],
        lambda ctx, tenant, query_type, start, end: ctx.ledger.windows_for(
            tenant, query_type, start, end
        ),
    ),
    (
        "prospective_epsilon",
        [KEYS, MECHANISMS, COUNTS],
        lambda ctx, key, mech, count: ctx.ledger.prospective_epsilon(key, mech, count),
    ),
    (
        "would_exceed",
        [KEYS, MECHANISMS, COUNTS],
        lambda ctx, key, mech, count: ctx.ledger.would_exceed(key, mech, count),
    ),
    ("receipt", [KEYS], lambda ctx, key: ctx.ledger.receipt(key)),
    ("policy_for", [KEYS], lambda ctx, key: ctx.ledger.policy_for(key)),
    (
        "policy_for_scope",
        [TEXT, TEXT],
        lambda ctx, tenant, query_type: ctx.ledger.policy_for_scope(tenant, query_type),
    ),
    ("clear_quarantine", [REASONS], lambda ctx, reason: ctx.ledger.clear_quarantine(reason)),
    (
        "open (actor, chain_key)",
        [st.sampled_from([None, "fuzz@example"]), st.none()],
        lambda ctx, actor, chain_key: AdminLedger(
            url=ctx.url, actor=actor, chain_key=chain_key
        ).close(),
    ),
    (
        "key_for",
        [TEXT, TEXT, TEXT, TEXT],
        lambda ctx, subject, query_type, window, tenant: key_for(
            subject, query_type, window, tenant=tenant
        ),
    ),
]

# A driver's or codec's own words passed through as a ValueError are not a clear error.
RAW_WORDS = ("codec can't", "NUL (0x00)", "(sqlite3.", "(psycopg2.", "Background on this error")
TABLES = (
    Account,
    Member,
    CohortRow,
    CohortMember,
    CohortAccount,
    ChargeCohort,
    ReservationRow,
    ReservationKey,
    Window,
    PolicyRow,
    ChainHead,
    LedgerConfig,
)


def snapshot(ledger: PrivacyBudgetLedger) -> tuple[Any, ...]:
    """Every row the ledger keeps (history by count and last link)."""
    with ledger.reading() as connection:
        tables = tuple(
            sorted(tuple(map(repr, row)) for row in connection.execute(select(table)).all())
            for table in TABLES
        )
        entries = connection.execute(
            select(func.count(), func.max(HistoryEntry.seq)).select_from(HistoryEntry)
        ).one()
    return (*tables, tuple(entries))


def seed(url: str) -> None:
    then = pytest.MonkeyPatch()
    ledger_time_in(then, CLOSED)  # CLOSED takes its release while it is open
    ledger = AdminLedger(BudgetCap(3.0, 1e-5), url=url)
    try:
        ledger.spend(ALICE, GaussianMechanism(4.0), count=2, attempt="seed/1")
        then.undo()  # the rest at the real clock, in OPEN
        ledger.spend(BOB, GaussianMechanism(6.0), attempt="seed/2")
        ledger.set_policy(Policy(2.0, tenant="acme", compliance_clause="DPA s.3"))
        ledger.spend(key_for("erin", "snapshot", OPEN), LaplaceMechanism(0.2), attempt="seed/3")
        ledger.reserve(CAROL, LaplaceMechanism(0.1), attempt="seed/4")
        assert ledger.cohort(["Frank", "alice"]) == CREW
    finally:
        then.undo()
        ledger.close()


@st.composite
def arguments(draw: st.DrawFn, ctx: Context, specs: list[Any]) -> list[Any]:
    """The operation's arguments: valid but one (now and then two) garbage values."""
    bad = {draw(st.integers(0, len(specs) - 1))}
    if len(specs) > 1 and draw(st.integers(0, 3)) == 0:
        bad.add(draw(st.integers(0, len(specs) - 1)))
    values = []
    for index, spec in enumerate(specs):
        if spec == "reservation":
            values.append(_reservation(ctx, draw))  # garbage in a third of the draws
        elif index in bad:
            values.append(draw(GARBAGE))
        else:
            values.append(draw(spec))
    return values


def check_call(ctx: Context, name: str, call: Callable[..., Any], values: list[Any]) -> None:
    before = snapshot(ctx.ledger)
    shown = f"{name}{tuple(repr(v)[:80] for v in values)}"
    try:
        call(ctx, *values)
    except (ValueError, LedgerError) as error:
        message = str(error)
        assert not any(words in message for words in RAW_WORDS), f"{shown}: {message[:500]}"
        assert "\n" not in message.strip(), f"{shown}: {message[:500]}"
        assert snapshot(ctx.ledger) == before, f"{shown} was refused ({message[:200]}) but wrote"
    except Exception as error:  # noqa: BLE001 - the finding
        raise AssertionError(f"{shown} raised {type(error).__name__}: {error}") from error


def fuzz(ctx: Context, operation: Operation, examples: int) -> None:
    name, specs, call = operation

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=st.data())
    def run(data):
        check_call(ctx, name, call, data.draw(arguments(ctx, specs)))

    run()


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("api-fuzz-template") / "ledger.db"
    seed(f"sqlite:///{path}")
    return path


@pytest.mark.parametrize("operation", OPERATIONS, ids=[op[0] for op in OPERATIONS])
def test_sqlite_refusals_are_value_or_ledger_errors_and_write_nothing(
    operation, template, tmp_path
):
    path = tmp_path / "ledger.db"
    shutil.copyfile(template, path)
    url = f"sqlite:///{path}"
    ledger = AdminLedger(url=url)
    try:
        fuzz(Context(ledger, url), operation, examples=12 + 8 * len(operation[1]))
    finally:
        ledger.close()


def test_postgresql_refusals_are_value_or_ledger_errors_and_write_nothing(postgres_url):
    seed(postgres_url)
    ledger = AdminLedger(url=postgres_url)
    try:
        ctx = Context(ledger, postgres_url)
        for operation in OPERATIONS:
            fuzz(ctx, operation, examples=3 + 2 * len(operation[1]))
    finally:
        ledger.close()


# The issue's Python probes, pinned.
@pytest.mark.parametrize(
    ("name", "call"),
    [
        (
            "count=10**19",
            lambda ledger, held: ledger.spend(ALICE, LaplaceMechanism(0.1), count=10**19),
        ),
        ("reap(timedelta.max)", lambda ledger, held: ledger.reap(timedelta.max)),
        ("commit(123)", lambda ledger, held: ledger.commit(123)),
        ("actor of 300", lambda ledger, held: AdminLedger(url=ledger.url, actor="a" * 300)),
        # What this fuzzer found (TypeError, AttributeError, OverflowError, codec errors).
        ("reserve(None)", lambda ledger, held: ledger.reserve(None, LaplaceMechanism(0.1))),
        ("receipt(None)", lambda ledger, held: ledger.receipt(None)),
        ("history(True)", lambda ledger, held: ledger.history(True)),
        ("policy_for(None)", lambda ledger, held: ledger.policy_for(None)),
        ("reap(now=True)", lambda ledger, held: ledger.reap(timedelta(days=1), now=True)),
        (
            "reap(naive now)",
            lambda ledger, held: ledger.reap(timedelta(1), now=datetime(2026, 1, 1)),
        ),
        (
            "windows_for(year 1 at +14:00)",
            lambda ledger, held: ledger.windows_for(
                "default", "count", datetime.min.replace(tzinfo=timezone(timedelta(hours=14)))
            ),
        ),
        (
            "commit(forged id)",
            lambda ledger, held: ledger.commit(dataclasses.replace(held, id=Opaque())),
        ),
        (
            "release(token None)",
            lambda ledger, held: ledger.release(dataclasses.replace(held, token=None)),
        ),
        (
            "release(reason NaN)",
            lambda ledger, held: ledger.release(held, Decimal("NaN")),
        ),
        (
            "clause surrogate",
            lambda ledger, held: ledger.set_policy(
                Policy(3.0, tenant="z", compliance_clause="\ud800")
            ),
        ),
        (
            "attempt surrogate",
            lambda ledger, held: ledger.spend(BOB, LaplaceMechanism(0.1), 1, "\ud800"),
        ),
        (
            "fixed window past a timedelta",
            lambda ledger, held: ledger.set_policy(
                Policy(3.0, calendar=WindowCalendar("fixed", 2**62))
            ),
        ),
    ],
)
def test_issue_probes(name, call, template, tmp_path):
    path = tmp_path / "ledger.db"
    shutil.copyfile(template, path)
    ledger = AdminLedger(url=f"sqlite:///{path}")
    try:
        held = ledger.reserve(BOB, LaplaceMechanism(0.01), attempt="probe/1")
        before = snapshot(ledger)
        try:
            call(ledger, held)  # reap(timedelta.max) reaps nothing; the others are refused
        except (ValueError, LedgerError) as refused:
            assert not any(words in str(refused) for words in RAW_WORDS), refused
        else:
            assert name == "reap(timedelta.max)", f"{name} was accepted"
        assert snapshot(ledger) == before
    finally:
        ledger.close()


def test_every_public_write_is_fuzzed():
    names = {operation[0] for operation in OPERATIONS}
    wanted = {"reserve", "spend", "commit", "release", "renew", "reap", "correct", "rescope"}
    wanted |= {"reset", "keep_alive", "cohort"}
    assert wanted | {"accounts", "history", "policy set", "verify"} <= names
    assert all(isinstance(key, LedgerKey) for key in (ALICE, BOB, CAROL))
    assert Reservation  # the type the commit/release fuzz forges
