"""The ledger against an independent model: random sequences of the public API (SQLite and PG).

A hypothesis ``RuleBasedStateMachine`` drives reserve (over data intervals, in one or two
query types), commit, release, renew (leases), reap (by lease and by age), spend, correct,
rescope, reset, reset_closed, windows_for and set_policy, with a clock it moves forward
by minutes and hours (``ledger.clock.now``), over 2 tenants x 3 subjects x 2 query types in
ISO weeks. Every run starts with a week charged
and reset before it. The model decides every outcome from the documented rules alone: its
own ISO-week arithmetic, policy lookup and grace periods, and an ``RDPAccountant`` fed the
same mechanisms per key. After every step the ledger must agree with it: every live
account, every refusal (and that it wrote nothing), every new history entry. The
invariant that matters: no key's reserve-granted lifetime spend ever passes the cap in
force when it was last granted, although resets move accounts out of the live ones (never a
refund: a reset window is sealed for good, and every key of it reads its final spend, state
SEALED) and rescopes move spend; and a lease only ever decides when
an open reservation is charged: renewing writes nothing, and closes nothing.

Each example runs on a fresh database: a copy of the one the ``ledger_url`` fixture gave
(a SQLite file, or a PostgreSQL database cloned from it as a template).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import date, datetime, timedelta, timezone
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy.engine import make_url

from dp_budget_provider.accounting import GaussianMechanism, LaplaceMechanism, RDPAccountant
from dp_budget_provider.accounting.filter import filter_epsilon, filter_order
from dp_budget_provider.ledger import (
    ANY,
    AttemptReused,
    BudgetCap,
    BudgetExhausted,
    LedgerError,
    LedgerKey,
    Policy,
    Reservation,
    ReservationClosed,
    ReservationStateError,
    WindowBusy,
    WindowCalendar,
    WindowClosed,
    WindowSealed,
    key_for,
)
from dp_budget_provider.ledger.storage import clock as ledger_clock
from tests.admin import AdminLedger
from tests.scratch_postgres import scratch_database

# Over 20 s in all: scheduled before the light files (tests/conftest.py).
pytestmark = pytest.mark.heavy

UTC = timezone.utc
DELTA = 1e-5
CAP = 3.0
DEFAULT_GRACE = timedelta(days=3)
LEASE = timedelta(minutes=5)  # the ledger's lease: reservations due for reaping after it
WARN_FRACTION = 0.8  # the default: every policy here keeps it
START = datetime(2026, 11, 2, 12, tzinfo=UTC)  # a Monday noon: 2026-w45
TENANTS = ("acme", "globex")
SUBJECTS = ("alice", "bob", "carol")
QUERY_TYPES = ("heatmap", "trajectory")
# Gaussian(1.5) alone is eps ~2.75 of the 3.0 cap: caps are hit within a few releases.
# The Laplace release takes the non-Gaussian paths (residual curve, no analytic bound).
MECHANISMS = (
    GaussianMechanism(1.5),
    GaussianMechanism(3.0),
    GaussianMechanism(6.0),
    LaplaceMechanism(1.0),
)
# How far before the clock a data interval ends: mostly the last week, sometimes a backfill
# into weeks that are already past their grace period (refused: closed, and may be sealed).
BACK = st.one_of(st.integers(0, 7 * 24), st.integers(0, 35 * 24))
REL = 1e-9  # float tolerance of epsilon comparisons (the ledger sums in another order)
VERIFY_EVERY = 10  # steps between two full ledger.verify() runs (and at teardown)

SETTINGS = settings(
    max_examples=15,
    stateful_step_count=30,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

OPEN, COMMITTED, RELEASED, REAPED = "open", "committed", "released", "reaped"
OUTCOMES: Counter = Counter()  # what the runs reached, per rule outcome (print it to see)
# Outcomes every run reaches many times over (tens per run): if one is missing, the
# strategies no longer drive the ledger where it matters and the test proves little.
MUST_REACH = (
    "reserve: granted",
    "BudgetExhausted",
    "sealed window",
    "renew: open",
    "due, by lease",
)


def event(outcome: str) -> None:
    OUTCOMES[outcome] += 1


# ---------------------------------------------------------------- the model's own arithmetic


def iso_week_label(moment: datetime) -> str:
    year, week, _ = moment.astimezone(UTC).isocalendar()
    return f"{year:04d}-w{week:02d}"


def iso_weeks_overlapping(start: datetime, end: datetime) -> list[str]:
    """ISO weeks overlapping [start, end); the week of ``start`` when the interval is empty."""
    day = start.astimezone(UTC).date()
    monday = datetime.combine(day - timedelta(days=day.weekday()), datetime.min.time(), UTC)
    labels = [iso_week_label(monday)]
    monday += timedelta(days=7)
    while monday < end:
        labels.append(iso_week_label(monday))
        monday += timedelta(days=7)
    return labels


def iso_week_end(label: str) -> datetime:
    year, week = label.split("-w")
    monday = date.fromisocalendar(int(year), int(week), 1)
    return datetime.combine(monday, datetime.min.time(), UTC) + timedelta(days=7)


def close_to(a: float, b: float) -> bool:
    """Equal within REL relative (and 1e-12 absolute, for zeros)."""
    return abs(a - b) <= REL * max(abs(a), abs(b)) + 1e-12


class Clock:
    """The ledger's clock in these tests (``ledger._now`` is patched to read it)."""

    def __init__(self) -> None:
        self.moment = START

    def now(self) -> datetime:
        return self.moment


class Composer:
    """Epsilon of a multiset of (mechanism, count) releases: an RDPAccountant, cached; and
    what a cap checked as a privacy filter at one order counts of them."""

    def __init__(self, orders, delta: float) -> None:
        self._orders, self._delta = orders, delta
        self._cache: dict[tuple[frozenset, float | None], float] = {}

    def order_of(self, cap: float) -> float:
        """The order a cap is checked at by default (its own: ``filter_order="auto"``)."""
        return filter_order(self._orders, cap, self._delta, "improved")

    def epsilon(self, *spends: Counter) -> float:
        """The reported epsilon: the least over the grid (and the exact Gaussian bound)."""
        return self._converted(None, spends)

    def checked(self, order: float, *spends: Counter) -> float:
        """The filter's statistic at ``order``: the summed curve there, converted there
        alone (0 for nothing spent)."""
        return self._converted(order, spends)

    def _converted(self, order: float | None, spends: tuple[Counter, ...]) -> float:
        total: Counter = Counter()
        for spend in spends:
            total.update(spend)
        signature = (frozenset(total.items()), order)
        if signature not in self._cache:
            value = 0.0
            if total:
                accountant = RDPAccountant(self._orders)
                accountant.compose_many(list(total.items()))
                value = (
                    accountant.get_epsilon(self._delta)[0]
                    if order is None
                    else filter_epsilon(
                        self._orders, accountant.rdp, order, self._delta, "improved"
                    )
                )
            self._cache[signature] = value
        return self._cache[signature]


@dataclasses.dataclass
class ModelAccount:
    spend: Counter = dataclasses.field(default_factory=Counter)  # live committed releases
    releases: int = 0
    rescoped_to: str | None = None
    sealed_at: datetime | None = None  # when a reset sealed its window: the final spend


@dataclasses.dataclass
class ModelReservation:
    handle: Reservation
    keys: frozenset[LedgerKey]
    mechanism: object
    count: int
    attempt: str
    created: datetime
    lease_until: datetime
    state: str = OPEN


@contextlib.contextmanager
def fresh_copy(template_url: str) -> Iterator[str]:
    """A fresh database holding a copy of the closed, migrated ledger at ``template_url``: a
    copied SQLite file, or a PostgreSQL database made with it as its template. Dropped after."""
    url = make_url(template_url)
    if url.get_backend_name() == "sqlite":
        source = Path(url.database)
        target = source.with_name(f"example-{uuid.uuid4().hex[:12]}.db")
        shutil.copyfile(source, target)
        try:
            yield f"sqlite:///{target}"
        finally:
            target.unlink(missing_ok=True)
        return
    with scratch_database("dpb_model", f'TEMPLATE "{url.database}"') as (_, clone):
        yield clone


# ---------------------------------------------------------------- the state machine


def ledger_machine(clock: Clock, template_url: str) -> type[RuleBasedStateMachine]:
    """A state machine class whose every example opens a ledger on a fresh copy of the
    ledger at ``template_url``."""

    class LedgerAgainstModel(RuleBasedStateMachine):
        reservations = Bundle("reservations")

        def __init__(self) -> None:
            super().__init__()
            clock.moment = START
            self.database = contextlib.ExitStack()
            url = self.database.enter_context(fresh_copy(template_url))
            try:
                self.ledger = AdminLedger(BudgetCap(CAP, DELTA), url=url, lease=LEASE)
            except BaseException:
                self.database.close()
                raise
            self.composer = Composer(self.ledger.orders, self.ledger.delta)
            # (tenant, query type) -> (cap, grace, filter order)
            self.policies: dict[tuple[str, str], tuple[float, timedelta, float]] = {
                (ANY, ANY): (CAP, DEFAULT_GRACE, self.composer.order_of(CAP))
            }
            self.windows: dict[tuple[str, str, str], bool] = {}  # (tenant, qt, label): sealed
            self.accounts: dict[LedgerKey, ModelAccount] = {}
            self.sealed: dict[LedgerKey, ModelAccount] = {}  # sealed windows' final accounts
            self.lifetime: dict[LedgerKey, Counter] = {}  # everything ever charged, kept
            self.granted: dict[LedgerKey, Counter] = {}  # charged through reserve only
            self.grant_cap: dict[LedgerKey, float] = {}  # the cap when last granted
            self.grant_order: dict[LedgerKey, float] = {}  # and the order it was checked at
            self.exempt: set[LedgerKey] = set()  # charged by a correction or a rescope
            self.reserved: dict[str, ModelReservation] = {}
            self.granted_attempts: set[str] = set()
            self.refused_attempts: list[str] = []
            self.attempts = 0
            self.expected: list[tuple[str, str | None]] = []  # history entries due
            self.seen_reserves: dict[str, str] = {}  # reservation id -> attempt, from history
            self.seq = max((e["seq"] for e in self.ledger.history()), default=0)
            self.touched: set[LedgerKey] = set()
            self.steps = 0
            self.open_changed = False
            self.sealed_changed = False
            event("example")

        def teardown(self) -> None:
            try:
                if hasattr(self, "ledger"):
                    report = self.ledger.verify()
                    assert report.ok, report.problems
            finally:
                if hasattr(self, "ledger"):
                    self.ledger.close()
                    self.database.close()

        # ------------------------------------------------------------ model helpers

        def governing(self, tenant: str, query_type: str) -> tuple[str, str]:
            for scope in ((tenant, query_type), (tenant, ANY), (ANY, query_type), (ANY, ANY)):
                if scope in self.policies:
                    return scope
            raise AssertionError("the default policy is always there")

        def cap_and_grace(self, tenant: str, query_type: str) -> tuple[float, timedelta]:
            return self.policies[self.governing(tenant, query_type)][:2]

        def checked(self, key: LedgerKey, *spends: Counter) -> float:
            """What ``key``'s cap check counts of ``spends``: at its policy's order."""
            order = self.policies[self.governing(key.tenant, key.query_type)][2]
            return self.composer.checked(order, *spends)

        def open_on(self, key: LedgerKey) -> list[ModelReservation]:
            return [r for r in self.reserved.values() if r.state == OPEN and key in r.keys]

        def live(self, key: LedgerKey) -> float:
            account = self.accounts.get(key)
            return 0.0 if account is None else self.composer.epsilon(account.spend)

        def final(self, key: LedgerKey) -> float:
            """What reads answer for ``key``: its live account's eps, else its sealed
            window's final spend (a reset never makes a charged key read zero), else 0."""
            account = self.accounts.get(key, self.sealed.get(key))
            return 0.0 if account is None else self.composer.epsilon(account.spend)

        def closed(self, key: LedgerKey) -> bool:
            """Whether ``key``'s window ended its scope's grace period or more ago: a new
            release (reserve, spend) may not charge it any more."""
            grace = self.cap_and_grace(key.tenant, key.query_type)[1]
            return clock.moment - grace >= iso_week_end(key.window)

        def blocked(self, key: LedgerKey) -> str | None:
            """Why nothing may be charged to ``key`` any more, if so."""
            if self.windows.get((key.tenant, key.query_type, key.window), False):
                return "sealed window"
            account = self.accounts.get(key)
            if account is not None and account.rescoped_to is not None:
                return "re-scoped key"
            return None

        def touch(self, key: LedgerKey) -> ModelAccount:
            """What every successful charging write does: window row and account exist."""
            self.windows.setdefault((key.tenant, key.query_type, key.window), False)
            self.touched.add(key)
            return self.accounts.setdefault(key, ModelAccount())

        def charge(self, key: LedgerKey, mechanism: object, count: int, granted: bool) -> None:
            account = self.touch(key)
            account.spend[mechanism] += count
            account.releases += count
            self.lifetime.setdefault(key, Counter())[mechanism] += count
            if granted:
                self.granted.setdefault(key, Counter())[mechanism] += count

        def close(self, reservation: ModelReservation, state: str) -> None:
            if state in (COMMITTED, REAPED):
                for key in reservation.keys:
                    self.charge(key, reservation.mechanism, reservation.count, granted=True)
            reservation.state = state
            self.open_changed = True
            self.touched |= reservation.keys
            self.expected.append(
                ({COMMITTED: "commit", REAPED: "reap"}.get(state, "release"), reservation.handle.id)
            )

        def window_at(self, tenant: str, query_type: str, back_hours: int) -> str:
            moment = clock.moment - timedelta(hours=back_hours)
            label = iso_week_label(moment)
            assert self.ledger.windows_for(tenant, query_type, moment) == [label]
            return label

        def new_attempt(self) -> str:
            self.attempts += 1
            return f"model/dag/task/run/-1/1/{self.attempts}"

        def labels(self) -> list[str]:
            return sorted(
                {label for (_, _, label) in self.windows} | {iso_week_label(clock.moment)}
            )

        # ------------------------------------------------------------ reserve and spend

        def live_spend(self, key: LedgerKey) -> Counter:
            account = self.accounts.get(key)
            return Counter() if account is None else account.spend

        def prospective(self, key: LedgerKey, mechanism, count: int, check: bool = False) -> float:
            """eps of committed + every open reservation + this release, by the model (with
            ``check``: what the cap check counts of it)."""
            held = [Counter({r.mechanism: r.count}) for r in self.open_on(key)]
            spends = (self.live_spend(key), *held, Counter({mechanism: count}))
            return self.checked(key, *spends) if check else self.composer.epsilon(*spends)

        def expected_reserve(self, keys, mechanism, count, attempt) -> set:
            """The outcomes the rules allow: "granted", or any refusal that applies (the
            rules do not say which of several the ledger names first)."""
            refusals: set = set()
            if any(self.blocked(key) for key in keys):
                refusals.add(WindowSealed)
            if any(self.closed(key) for key in keys):
                refusals.add(WindowClosed)
            if attempt in self.granted_attempts:
                refusals.add(AttemptReused)
            tie = False
            for key in keys:
                prospective = self.prospective(key, mechanism, count, check=True)
                cap = self.cap_and_grace(key.tenant, key.query_type)[0]
                if close_to(prospective, cap):
                    tie = True  # either answer is sound
                elif prospective > cap:
                    refusals.add(BudgetExhausted)
            if tie:
                refusals.add(BudgetExhausted)
                return refusals if len(refusals) > 1 else {BudgetExhausted, "granted"}
            return refusals or {"granted"}

        def granted_reservation(self, handle: Reservation, keys, mechanism, count, attempt):
            model = ModelReservation(
                handle,
                frozenset(keys),
                mechanism,
                count,
                attempt,
                clock.moment,
                clock.moment + LEASE,
            )
            self.reserved[handle.id] = model
            self.granted_attempts.add(attempt)
            if attempt in self.refused_attempts:
                self.refused_attempts.remove(attempt)
            for key in keys:
                self.touch(key)
                self.grant_cap[key] = self.cap_and_grace(key.tenant, key.query_type)[0]
                self.grant_order[key] = self.policies[self.governing(key.tenant, key.query_type)][2]
            self.expected.append(("reserve", handle.id))
            self.open_changed = True
            return model

        def refused(self, what: str, error: Exception, allowed: set, keys, attempt) -> None:
            assert type(error) in allowed, (error, allowed)
            why = {self.blocked(key) for key in keys} - {None}
            if any(self.closed(key) for key in keys):
                why.add("closed window")
            event(
                f"{what}: {type(error).__name__}" + (f" ({', '.join(sorted(why))})" if why else "")
            )
            if attempt not in self.granted_attempts and attempt not in self.refused_attempts:
                self.refused_attempts.append(attempt)
            self.touched |= set(keys)

        def do_reserve(self, keys: list[LedgerKey], mechanism, count: int, attempt: str):
            allowed = self.expected_reserve(keys, mechanism, count, attempt)
            worst = max(self.prospective(key, mechanism, count) for key in keys)
            try:
                handle = self.ledger.reserve(keys, mechanism, count, attempt=attempt)
            except (BudgetExhausted, WindowSealed, WindowClosed, ReservationStateError) as error:
                self.refused("reserve", error, allowed, keys, attempt)
                return None
            assert "granted" in allowed, (allowed, keys, attempt)
            scopes = len({(key.tenant, key.query_type) for key in keys})
            event(f"reserve: granted on {min(len(keys), 3)} key(s), {scopes} scope(s)")
            # It holds the accounts of the keys' classes, in key order.
            assert list(handle.keys) == sorted(handle.keys)
            assert set(handle.keys) == {self.ledger.account_of(key) for key in keys}
            assert handle.state == OPEN and handle.attempt_id == attempt
            assert handle.count == count and handle.mechanism == mechanism
            assert datetime.fromisoformat(handle.created_at) == clock.moment
            assert datetime.fromisoformat(handle.lease_expires_at) == clock.moment + LEASE
            assert close_to(handle.prospective_epsilon, worst), (handle, worst)
            return self.granted_reservation(handle, keys, mechanism, count, attempt)

        def pick_key(self, data, tenant, query_type, subject, back_hours) -> LedgerKey:
            """A key holding an open reservation, a live account, any key charged before
            (re-scoped, or sealed by a reset), or the key of a recent moment."""
            sources = ["live", "recent", "charged", "held"]
            source = data.draw(st.sampled_from(sources), label="source")
            live = sorted(k for k, a in self.accounts.items() if a.rescoped_to is None)
            charged = sorted(set(self.accounts) | set(self.lifetime))
            held = sorted({k for r in self.reserved.values() if r.state == OPEN for k in r.keys})
            if source == "held" and held:
                return data.draw(st.sampled_from(held), label="held key")
            if source == "live" and live:
                return data.draw(st.sampled_from(live), label="live key")
            if source == "charged" and charged:
                return data.draw(st.sampled_from(charged), label="charged key")
            window = self.window_at(tenant, query_type, back_hours)
            return key_for(subject, query_type, window, tenant=tenant)

        @initialize(
            tenant=st.sampled_from(TENANTS),
            query_type=st.sampled_from(QUERY_TYPES),
            subjects=st.sets(st.sampled_from(SUBJECTS), min_size=1),
            mechanism=st.sampled_from(MECHANISMS),
        )
        def a_week_charged_and_sealed_before(self, tenant, query_type, subjects, mechanism):
            """Every run starts with a week charged while it was open and then reset (past
            its grace at START): its lifetime spend stays, and it is sealed for every later
            backfill. The charge is made with the clock in that week, two weeks back (and
            back again to where it was)."""
            label = iso_week_label(START - timedelta(days=14))
            keys = [key_for(s, query_type, label, tenant=tenant) for s in sorted(subjects)]
            now, clock.moment = clock.moment, START - timedelta(days=14)
            reservation = self.do_reserve(keys, mechanism, 1, self.new_attempt())
            assert reservation is not None
            self.do_commit(reservation)
            clock.moment = now
            plan, scopes, dropped = self.reset_plan(label)
            assert plan == "reset" and self.ledger.reset(label) == len(dropped) == len(keys)
            self.apply_reset(label, scopes, dropped)

        @initialize(
            tenant=st.sampled_from(TENANTS),
            query_type=st.sampled_from(QUERY_TYPES),
            subject=st.sampled_from(SUBJECTS),
            mechanism=st.sampled_from(MECHANISMS),
            renewed=st.booleans(),
        )
        def an_attempt_abandoned_before(self, tenant, query_type, subject, mechanism, renewed):
            """Every run also starts with an attempt whose worker died (after renewing once,
            or never): the reap a second before its lease ends leaves it, the one at the end
            charges it."""
            key = key_for(subject, query_type, iso_week_label(clock.moment), tenant=tenant)
            reservation = self.do_reserve([key], mechanism, 1, self.new_attempt())
            assert reservation is not None
            if renewed:
                clock.moment += timedelta(minutes=2)
                self.do_renew(reservation, own=True)
            clock.moment = reservation.lease_until - timedelta(seconds=1)
            self.do_reap(None, pass_now=False)
            assert reservation.state == OPEN
            clock.moment += timedelta(seconds=1)
            self.do_reap(None, pass_now=True)
            assert reservation.state == REAPED

        @rule(
            target=reservations,
            tenant=st.sampled_from(TENANTS),
            query_types=st.sets(st.sampled_from(QUERY_TYPES), min_size=1),
            subjects=st.sets(st.sampled_from(SUBJECTS), min_size=1),
            back_hours=BACK,
            length_hours=st.integers(0, 10 * 24),
            mechanism=st.sampled_from(MECHANISMS),
            count=st.integers(1, 2),
        )
        def reserve(
            self, tenant, query_types, subjects, back_hours, length_hours, mechanism, count
        ):
            """A release over the data interval [start, end), end at or before the clock, for
            some subjects in one or both query types: all or nothing."""
            end = clock.moment - timedelta(hours=back_hours)
            start = end - timedelta(hours=length_hours)
            keys = []
            for query_type in sorted(query_types):
                windows = self.ledger.windows_for(tenant, query_type, start, end)
                assert windows == iso_weeks_overlapping(start, end), (start, end, windows)
                keys += [
                    key_for(subject, query_type, window, tenant=tenant)
                    for subject in sorted(subjects)
                    for window in windows
                ]
            model = self.do_reserve(keys, mechanism, count, self.new_attempt())
            return multiple() if model is None else multiple(model)

        @rule(
            target=reservations,
            data=st.data(),
            attempt=st.sampled_from(["new", "used", "refused", "future"]),
            tenant=st.sampled_from(TENANTS),
            query_type=st.sampled_from(QUERY_TYPES),
            subject=st.sampled_from(SUBJECTS),
            back_hours=BACK,
            mechanism=st.sampled_from(MECHANISMS),
        )
        def reserve_one(self, data, attempt, tenant, query_type, subject, back_hours, mechanism):
            """One key; a new attempt id, one that reserved before (a deleted and re-created
            run with the same id), one whose reservation was refused (it wrote nothing, so
            the id is still unused), or a window that has not begun."""
            if attempt == "future":
                label = iso_week_label(clock.moment + timedelta(days=7 + back_hours % 21))
                key = key_for(subject, query_type, label, tenant=tenant)
                with pytest.raises(ValueError, match="has not begun"):
                    self.ledger.reserve([key], mechanism, attempt=self.new_attempt())
                event("reserve: not begun")
                return multiple()
            key = self.pick_key(data, tenant, query_type, subject, back_hours)
            if attempt == "used" and self.granted_attempts:
                attempt_id = data.draw(st.sampled_from(sorted(self.granted_attempts)))
            elif attempt == "refused" and self.refused_attempts:
                attempt_id = data.draw(st.sampled_from(self.refused_attempts))
            else:
                attempt_id = self.new_attempt()
            model = self.do_reserve([key], mechanism, 1, attempt_id)
            return multiple() if model is None else multiple(model)

        @rule(
            data=st.data(),
            tenant=st.sampled_from(TENANTS),
            query_type=st.sampled_from(QUERY_TYPES),
            subject=st.sampled_from(SUBJECTS),
            back_hours=BACK,
            mechanism=st.sampled_from(MECHANISMS),
        )
        def spend(self, data, tenant, query_type, subject, back_hours, mechanism):
            """Reserve and commit in one call."""
            key = self.pick_key(data, tenant, query_type, subject, back_hours)
            attempt = self.new_attempt()
            allowed = self.expected_reserve([key], mechanism, 1, attempt)
            try:
                receipt = self.ledger.spend(key, mechanism, attempt=attempt)
            except (BudgetExhausted, WindowSealed, WindowClosed) as error:
                self.refused("spend", error, allowed, [key], attempt)
                return
            assert "granted" in allowed, allowed
            event("spend: granted")
            reserved = [
                e["reservation_id"]
                for e in self.ledger.history(after_seq=self.seq)
                if e["action"] == "reserve" and e["payload"]["attempt_id"] == attempt
            ]
            assert len(reserved) == 1, reserved
            handle = Reservation(reserved[0], attempt, (key,), mechanism, 1, OPEN, 0.0, "")
            model = self.granted_reservation(handle, [key], mechanism, 1, attempt)
            self.close(model, COMMITTED)
            # The receipt names the account (spend class) the key is charged to.
            assert receipt.key == self.ledger.account_of(key)
            assert close_to(receipt.epsilon, self.live(key))

        # ------------------------------------------------------------ closing reservations

        def do_commit(self, reservation: ModelReservation) -> None:
            event(f"commit: {reservation.state}")
            if reservation.state == RELEASED:
                with pytest.raises(ReservationStateError, match="cannot be committed"):
                    self.ledger.commit(reservation.handle)
                return
            first = reservation.state == OPEN
            receipts = self.ledger.commit(reservation.handle)
            if first:
                self.close(reservation, COMMITTED)
            # One receipt per account it held, in key order; a second commit reads them
            # back, whatever happened since (a later split leaves some subjects elsewhere).
            by_account = {r.key: r for r in receipts}
            assert [r.key for r in receipts] == sorted(by_account)
            for key in reservation.keys:
                receipt = by_account.get(self.ledger.account_of(key))
                assert receipt is not None or not first, (key, receipts)
                if receipt is not None:
                    assert close_to(receipt.epsilon, self.final(key)), (key, receipt)

        def do_release(self, reservation: ModelReservation) -> None:
            event(f"release: {reservation.state}")
            if reservation.state in (COMMITTED, REAPED):
                with pytest.raises(ReservationStateError, match="cannot be released"):
                    self.ledger.release(reservation.handle, reason="never ran")
                return
            self.ledger.release(reservation.handle, reason="never ran")
            if reservation.state == OPEN:
                self.close(reservation, RELEASED)

        @rule(reservation=reservations)
        def commit(self, reservation: ModelReservation):
            self.do_commit(reservation)

        @rule(reservation=reservations)
        def release(self, reservation: ModelReservation):
            self.do_release(reservation)

        @precondition(lambda self: any(r.state == OPEN for r in self.reserved.values()))
        @rule(data=st.data(), charge=st.booleans())
        def finish_an_open_reservation(self, data, charge: bool):
            reservation = data.draw(
                st.sampled_from([r for r in self.reserved.values() if r.state == OPEN])
            )
            (self.do_commit if charge else self.do_release)(reservation)

        @rule(reservation=reservations, read_back=st.booleans())
        def close_without_the_token(self, reservation: ModelReservation, read_back: bool):
            """Ids are public; only the reserving attempt's token commits or releases."""
            handle = dataclasses.replace(reservation.handle, token="not-the-token")
            if read_back:
                listed = {r.id: r for r in self.ledger.open_reservations()}
                if reservation.handle.id not in listed:
                    assert reservation.state != OPEN
                    return
                handle = listed[reservation.handle.id]
            for close in (self.ledger.commit, self.ledger.release):
                with pytest.raises(ReservationStateError, match="only the attempt"):
                    close(handle)

        def do_renew(self, reservation: ModelReservation, own: bool) -> None:
            """Only the reserving attempt renews, only an open reservation, and a renewal
            moves the lease to a lease from now and writes nothing else."""
            if not own:
                handle = dataclasses.replace(reservation.handle, token="not-the-token")
                with pytest.raises(ReservationStateError, match="only the attempt"):
                    self.ledger.renew(handle)
                event("renew: not the attempt's")
                return
            if reservation.state != OPEN:
                with pytest.raises(ReservationClosed, match=f"was {reservation.state} at"):
                    self.ledger.renew(reservation.handle)
                event(f"renew: {reservation.state}")
                return
            assert self.ledger.renew(reservation.handle) == clock.moment + LEASE
            run_out = reservation.lease_until <= clock.moment
            reservation.lease_until = clock.moment + LEASE
            self.open_changed = True
            event(f"renew: open{', its lease had run out' if run_out else ''}")

        @rule(reservation=reservations, own=st.booleans())
        def renew(self, reservation: ModelReservation, own: bool):
            self.do_renew(reservation, own)

        def do_reap(self, older_than: timedelta | None, pass_now: bool) -> None:
            """Charged: every open reservation whose lease has run out, and with the bound
            every one older than it; nothing else."""
            due = [
                r
                for r in self.reserved.values()
                if r.state == OPEN
                and (
                    r.lease_until <= clock.moment
                    or (older_than is not None and r.created <= clock.moment - older_than)
                )
            ]
            alive = any(r.state == OPEN and r not in due for r in self.reserved.values())
            reaped = self.ledger.reap(older_than, now=clock.moment if pass_now else None)
            leased = any(r.lease_until <= clock.moment for r in due)
            event(
                f"reap: {'some' if due else 'none'} due{', by lease' if leased else ''}"
                f"{', some left alive' if alive else ''}"
            )
            assert sorted(reaped) == sorted(r.handle.id for r in due)
            for reservation in sorted(due, key=lambda r: r.created):
                self.close(reservation, REAPED)

        @rule(
            data=st.data(),
            older_than_hours=st.sampled_from([None, None, 0, 1, 24, 72, 168]),
            at_a_lease_end=st.booleans(),
            pass_now=st.booleans(),
        )
        def reap(self, data, older_than_hours: int | None, at_a_lease_end: bool, pass_now: bool):
            """Now, or once the clock has reached an open reservation's lease end (a
            second before, at, or a second after it: due at the end itself)."""
            open_ = [r for r in self.reserved.values() if r.state == OPEN]
            if at_a_lease_end and open_:
                reservation = data.draw(st.sampled_from(open_), label="open reservation")
                offset = timedelta(seconds=data.draw(st.sampled_from([-1, 0, 1]), label="offset"))
                clock.moment = max(clock.moment, reservation.lease_until + offset)
            older_than = None if older_than_hours is None else timedelta(hours=older_than_hours)
            self.do_reap(older_than, pass_now)

        # ------------------------------------------------------------ corrections, rescopes

        @rule(
            data=st.data(),
            tenant=st.sampled_from(TENANTS),
            query_type=st.sampled_from(QUERY_TYPES),
            subject=st.sampled_from(SUBJECTS),
            back_hours=BACK,
            mechanism=st.sampled_from(MECHANISMS),
            count=st.integers(1, 2),
        )
        def correct(self, data, tenant, query_type, subject, back_hours, mechanism, count):
            """A missed release is charged, cap or no cap; never to a sealed key."""
            key = self.pick_key(data, tenant, query_type, subject, back_hours)
            self.touched.add(key)
            if self.blocked(key):
                event(f"correct: {self.blocked(key)}")
                with pytest.raises(WindowSealed):
                    self.ledger.correct(key, mechanism, count, reason="missed release")
                return
            receipt = self.ledger.correct(key, mechanism, count, reason="missed release")
            event("correct: charged")
            self.charge(key, mechanism, count, granted=False)
            self.exempt.add(key)
            self.expected.append(("correction", None))
            assert close_to(receipt.epsilon, self.live(key)), receipt

        @rule(
            data=st.data(),
            tenant=st.sampled_from(TENANTS),
            query_type=st.sampled_from(QUERY_TYPES),
            subject=st.sampled_from(SUBJECTS),
            back_hours=BACK,
        )
        def rescope(self, data, tenant, query_type, subject, back_hours):
            old = self.pick_key(data, tenant, query_type, subject, back_hours)
            new_type = next(qt for qt in QUERY_TYPES if qt != old.query_type)
            new = key_for(old.subject, new_type, old.window, tenant=old.tenant)
            self.touched |= {old, new}
            if self.blocked(old) or self.blocked(new):
                event(f"rescope: {self.blocked(old) or self.blocked(new)}")
                with pytest.raises(WindowSealed):
                    self.ledger.rescope(old, new, reason="re-scored")
                return
            if self.open_on(old):
                event("rescope: open reservations")
                with pytest.raises(LedgerError, match="open reservations") as raised:
                    self.ledger.rescope(old, new, reason="re-scored")
                assert type(raised.value) is LedgerError
                return
            receipt = self.ledger.rescope(old, new, reason="re-scored")
            moved, target = self.touch(old), self.touch(new)
            event(f"rescope: moved {'some' if moved.spend else 'no'} spend")
            target.spend.update(moved.spend)  # the old row keeps its own: it is frozen
            target.releases += moved.releases
            self.lifetime.setdefault(new, Counter()).update(moved.spend)
            moved.rescoped_to = new_type
            self.exempt.add(new)
            self.expected.append(("rescope", None))
            assert receipt.key == new and close_to(receipt.epsilon, self.live(new)), receipt

        # ------------------------------------------------------------ windows and policies

        @rule(hours=st.integers(0, 10 * 24), minutes=st.integers(0, 6))
        def advance_clock(self, hours: int, minutes: int):
            """Hours (windows close) and minutes (leases of 5 minutes run out)."""
            clock.moment += timedelta(hours=hours, minutes=minutes)

        def reset_plan(self, label: str):
            """What reset(label) does now: ("open" | "noop" | "reset" | "grace" | "busy" |
            "grace, busy", the scopes it seals, the accounts it drops). A window that has not
            ended is refused, charged or not; one that has is reset once every unsealed scope
            charged in it is past its grace, with nothing open."""
            if clock.moment < iso_week_end(label):
                return "open", [], []
            scopes = sorted(
                (tenant, qt)
                for (tenant, qt, w), sealed in self.windows.items()
                if w == label and not sealed
            )
            if not scopes:
                return "noop", scopes, []
            in_grace = any(
                clock.moment - self.cap_and_grace(tenant, qt)[1] < iso_week_end(label)
                for tenant, qt in scopes
            )
            dropped = [
                k for k in self.accounts if k.window == label and (k.tenant, k.query_type) in scopes
            ]
            busy = any(self.open_on(key) for key in dropped)
            plan = ", ".join(name for name, due in (("grace", in_grace), ("busy", busy)) if due)
            return plan or "reset", scopes, dropped

        def apply_reset(self, label: str, scopes, dropped) -> None:
            for tenant, qt in scopes:
                self.windows[(tenant, qt, label)] = True
            for key in dropped:  # the final spend stays readable: a reset never refunds
                self.sealed[key] = self.accounts.pop(key)
                self.sealed[key].sealed_at = clock.moment
            self.sealed_changed = True
            self.touched |= set(dropped)
            self.expected.append(("reset", None))

        @rule(data=st.data(), every_closed_window=st.booleans())
        def reset(self, data, every_closed_window: bool):
            if every_closed_window:
                self.reset_closed()
                return
            label = data.draw(st.sampled_from(self.labels()), label="window")
            plan, scopes, dropped = self.reset_plan(label)
            event(f"reset: {plan}")
            if plan not in ("noop", "reset"):  # either reason may be named when both apply
                match = "has not closed" if plan == "open" else plan
                match = match.replace("grace", "grace period").replace("busy", "open reservations")
                with pytest.raises(LedgerError, match=match.replace(", ", "|")) as raised:
                    self.ledger.reset(label)
                # The grace period is checked first; a closed window that is only busy
                # waits for its reservations.
                assert type(raised.value) is (WindowBusy if plan == "busy" else LedgerError)
                return
            assert self.ledger.reset(label) == len(dropped)
            if plan == "reset":
                self.apply_reset(label, scopes, dropped)

        def reset_closed(self) -> None:
            """Every window past its grace, in label order; one with open reservations
            waits, the others are reset all the same, and then WindowBusy names both."""
            labels = sorted({w for (_, _, w), sealed in self.windows.items() if not sealed})
            expected, waiting = {}, []
            for label in labels:
                plan, scopes, dropped = self.reset_plan(label)
                if plan == "open" or "grace" in plan:
                    continue
                if plan == "busy":
                    waiting.append(label)
                    continue
                expected[label] = len(dropped)
                self.apply_reset(label, scopes, dropped)
            event(f"reset_closed: {min(len(expected), 2)} window(s), {min(len(waiting), 1)} busy")
            if not waiting:
                assert self.ledger.reset_closed() == expected
                return
            with pytest.raises(WindowBusy) as raised:
                self.ledger.reset_closed()
            message = str(raised.value)
            assert all(f"'{label}' has" in message for label in waiting), message
            assert all(f"{label} ({n} accounts)" in message for label, n in expected.items())

        @rule(
            data=st.data(),
            tenant=st.sampled_from((ANY, *TENANTS)),
            query_type=st.sampled_from((ANY, *QUERY_TYPES)),
            cap=st.sampled_from([3.0, 2.0, 4.0]),
            grace_days=st.sampled_from([3, 0, 1, 10]),
            other_calendar=st.booleans(),
        )
        def set_policy(self, data, tenant, query_type, cap, grace_days, other_calendar):
            """New caps and grace periods for any scope; a charged scope keeps its calendar."""
            grace = timedelta(days=grace_days)
            if other_calendar and self.windows:
                tenant, query_type = data.draw(
                    st.sampled_from(sorted({(t, qt) for (t, qt, _) in self.windows})),
                    label="a charged scope",
                )
                policy = Policy(
                    cap, tenant=tenant, query_type=query_type, calendar=WindowCalendar("day")
                )
                with pytest.raises(LedgerError, match="second set of windows"):
                    self.ledger.set_policy(policy)
                return
            # The order ("auto"): the one the charged pairs it will govern are checked at,
            # else the cap's own; a charged pair checked at another one refuses it.
            charged = {(t, qt) for (t, qt, _) in self.windows}
            before = {pair: self.governing(*pair) for pair in charged}
            governed = [
                pair
                for pair in charged
                if (tenant, query_type)
                == next(
                    scope
                    for scope in ((pair[0], pair[1]), (pair[0], ANY), (ANY, pair[1]), (ANY, ANY))
                    if scope in self.policies or scope == (tenant, query_type)
                )
            ]
            was = {self.policies[before[pair]][2] for pair in governed}
            order = next(iter(was)) if len(was) == 1 else self.composer.order_of(cap)
            policy = Policy(cap, tenant=tenant, query_type=query_type, grace=grace)
            if was - {order}:
                with pytest.raises(LedgerError, match="one privacy filter"):
                    self.ledger.set_policy(policy)
                event("set_policy: refused, charged pairs checked at two orders")
                return
            assert self.ledger.set_policy(policy).filter_order == order
            self.policies[(tenant, query_type)] = (cap, grace, order)
            self.expected.append(("policy", None))

        # ------------------------------------------------------------ invariants

        @invariant()
        def agrees_with_the_model(self):
            """After every step: the ledger holds what the model says, and wrote nothing
            else; no granted spend ever passes its cap."""
            self.steps += 1
            self.check_accounts()
            self.check_history()
            self.check_touched_keys()
            if self.open_changed or self.steps % 3 == 0:
                self.check_open_reservations()
            if self.sealed_changed or self.steps % VERIFY_EVERY == 0:
                self.check_sealed_accounts()
            self.check_caps()
            if self.steps % VERIFY_EVERY == 0:
                report = self.ledger.verify()
                assert report.ok, report.problems

        def check_accounts(self) -> None:
            """Every live account, and no other: spend, open count, releases, mark, cap."""
            listed = {status.key: status for status in self.ledger.accounts()}
            assert set(listed) == set(self.accounts), sorted(
                map(str, set(listed) ^ set(self.accounts))
            )
            for key, status in listed.items():
                model = self.accounts[key]
                cap = self.cap_and_grace(key.tenant, key.query_type)[0]
                assert close_to(status.epsilon, self.live(key)), (key, status, model)
                assert status.open_reservations == len(self.open_on(key)), (key, status)
                assert status.releases == model.releases, (key, status, model)
                assert status.rescoped_to == model.rescoped_to, (key, status)
                assert status.cap_epsilon == cap, (key, status)
                # What is left, the fraction and the states count as the cap check does.
                epsilon = self.checked(key, self.live_spend(key))
                assert close_to(status.remaining, max(0.0, cap - epsilon)), (key, status)
                assert close_to(status.fraction, epsilon / cap), (key, status)
                assert close_to(status.held_epsilon, self.held(key)), (key, status)
                held = self.held(key, check=True)
                assert close_to(status.remaining_after_held, max(0.0, cap - held)), (key, status)
                cheapest = self.cheapest_next(key)
                if not close_to(held, cap) and (cheapest is None or not close_to(cheapest, cap)):
                    exhausted = held > cap or (cheapest is not None and cheapest > cap)
                    assert status.exhausted == exhausted, (key, status, cheapest)
                if not close_to(held, WARN_FRACTION * cap):
                    assert status.warned == (held > WARN_FRACTION * cap), (key, status)

        def check_sealed_accounts(self) -> None:
            """Every account of a sealed window, and no other: its final spend, releases
            and mark, sealed when the reset ran, state SEALED (RESCOPED if re-scoped)."""
            self.sealed_changed = False
            listed = {
                status.key: status
                for status in self.ledger.accounts(sealed=True)
                if status.sealed_at is not None
            }
            assert set(listed) == set(self.sealed), sorted(map(str, set(listed) ^ set(self.sealed)))
            for key, status in listed.items():
                model = self.sealed[key]
                assert close_to(status.epsilon, self.final(key)), (key, status, model)
                assert status.releases == model.releases, (key, status, model)
                assert status.rescoped_to == model.rescoped_to, (key, status)
                assert status.state == ("RESCOPED" if model.rescoped_to else "SEALED"), status
                assert datetime.fromisoformat(status.sealed_at) == model.sealed_at, status
                assert status.open_reservations == 0, (key, status)

        def held(self, key: LedgerKey, check: bool = False) -> float:
            """eps of committed + every open reservation on ``key``, by the model (with
            ``check``: what the cap check counts of it)."""
            held = [Counter({r.mechanism: r.count}) for r in self.open_on(key)]
            spends = (self.live_spend(key), *held)
            return self.checked(key, *spends) if check else self.composer.epsilon(*spends)

        def cheapest_next(self, key: LedgerKey) -> float | None:
            """The least eps any release ever reserved in ``key``'s scope (any window, any
            outcome) would bring its held spend to; None while the scope reserved none.
            Past the cap, the account is EXHAUSTED."""
            scope = (key.tenant, key.query_type)
            made = {
                (r.mechanism, r.count)
                for r in self.reserved.values()
                if any((k.tenant, k.query_type) == scope for k in r.keys)
            }
            after = [self.prospective(key, m, count, check=True) for m, count in made]
            return min(after, default=None)

        def check_history(self) -> None:
            """The entries written since the last step are exactly those the model expects
            (a refused call writes none); every granted reservation has its reserve entry."""
            entries = self.ledger.history(after_seq=self.seq)
            found = [(e["action"], e["reservation_id"]) for e in entries]
            expected, self.expected = self.expected, []
            if all(action == "reap" for action, _ in expected):
                found, expected = sorted(found), sorted(expected)  # reaped in created order
            assert found == expected, (found, expected)
            for entry in entries:
                if entry["action"] == "reserve":
                    attempt = self.reserved[entry["reservation_id"]].attempt
                    assert entry["payload"]["attempt_id"] == attempt
                    self.seen_reserves[entry["reservation_id"]] = attempt
            if entries:
                self.seq = entries[-1]["seq"]
            assert self.seen_reserves == {i: r.attempt for i, r in self.reserved.items()}

        def check_touched_keys(self) -> None:
            """epsilon_of (a reset window's final spend) and the prospective eps of a few
            keys this step touched: at most 4 (accounts() already compared every live
            account)."""
            keys = sorted(self.touched)
            self.touched = set()
            if len(keys) > 4:
                offset = self.steps % len(keys)
                keys = (keys[offset:] + keys[:offset])[:4]
            for key in keys:
                assert close_to(self.ledger.epsilon_of(key), self.final(key)), key
            for key in keys:
                if key in self.accounts and self.open_on(key):
                    probe = MECHANISMS[2]
                    expected = self.prospective(key, probe, 1)
                    assert close_to(self.ledger.prospective_epsilon(key, probe), expected), key
                    break

        def check_open_reservations(self) -> None:
            self.open_changed = False
            listed = {r.id: r for r in self.ledger.open_reservations()}
            assert set(listed) == {i for i, r in self.reserved.items() if r.state == OPEN}
            for rid, listed_reservation in listed.items():
                # It holds the accounts of its subjects' classes: those it was made on, and
                # the parts that later splits carried to it.
                accounts = {self.ledger.account_of(key) for key in self.reserved[rid].keys}
                assert set(listed_reservation.keys) == accounts, rid
                lease = datetime.fromisoformat(listed_reservation.lease_expires_at)
                assert lease == self.reserved[rid].lease_until, (rid, lease)

        def check_caps(self) -> None:
            """Lifetime spend counts what resets dropped; only corrections and rescopes may
            take a key past the cap, and never its reserve-granted part."""
            for key, granted in self.granted.items():
                cap = self.grant_cap[key]
                epsilon = self.composer.checked(self.grant_order[key], granted)
                assert epsilon <= cap or close_to(epsilon, cap), (key, epsilon, cap)
            past = False
            for key, lifetime in self.lifetime.items():
                cap = self.cap_and_grace(key.tenant, key.query_type)[0]
                past = past or self.composer.epsilon(lifetime) > cap
                if key not in self.exempt:
                    assert lifetime == self.granted.get(key, Counter()), key
                if key in self.accounts:  # the live account never holds more than was charged
                    assert not (self.accounts[key].spend - lifetime), key
            if past:
                event("step with a corrected or rescoped key past its cap")

    return LedgerAgainstModel


def test_the_ledger_agrees_with_an_independent_model(ledger_url, monkeypatch):
    AdminLedger(BudgetCap(CAP, DELTA), url=ledger_url).close()  # the template
    clock = Clock()
    monkeypatch.setattr(ledger_clock, "now", clock.now)
    OUTCOMES.clear()
    run_state_machine_as_test(ledger_machine(clock, ledger_url), settings=SETTINGS)
    missing = [m for m in MUST_REACH if not any(m in outcome for outcome in OUTCOMES)]
    assert not missing, (missing, sorted(OUTCOMES.items()))
