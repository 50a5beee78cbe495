"""Caps at every scope against an independent per-subject model (SQLite and PostgreSQL).

A hypothesis ``RuleBasedStateMachine`` sets caps across query types and across horizons of
two ISO weeks (and changes them), releases over random subject sets in three query types
and the weeks a clock moving forward reaches, keeps reservations open or commits and
releases them, corrects, re-scopes, and resets closed windows. The model knows nothing of
the ledger's totals: it keeps every release (its subjects, query type, week, mechanism,
state, and the caps in force when it was made) and derives each subject's loss at every
scope from that list with an ``RDPAccountant``. After every step:

* every release the ledger granted fits every cap that applied to every subject it covers
  (its query type's in its week, the total across query types in the week, the total
  over the horizon), counting committed and open releases, as the model derives them;
* every refusal is justified by one of them (or by a sealed or closed window);
* the ledger's totals read what the model derives; ``verify`` passes every few steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from datetime import date, datetime, timedelta, timezone

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from dp_budget_provider.accounting import GaussianMechanism, LaplaceMechanism
from dp_budget_provider.ledger import (
    ANY,
    BudgetCap,
    BudgetExhausted,
    LedgerError,
    Policy,
    WindowClosed,
    WindowSealed,
    key_for,
)
from dp_budget_provider.ledger.storage import clock as ledger_clock
from dp_budget_provider.ledger.windows.policy import ACROSS_QUERY_TYPES, ACROSS_WINDOWS
from tests.admin import AdminLedger
from tests.ledger.test_model_stateful import Composer, close_to, fresh_copy, iso_week_label

# Over 20 s in all: scheduled before the light files (tests/conftest.py).
pytestmark = pytest.mark.heavy

UTC = timezone.utc
DELTA = 1e-5
CAP = 3.0  # every query type's cap
GRACE = timedelta(days=3)
HORIZON = 2  # weeks per horizon period
START = datetime(2026, 11, 2, 12, tzinfo=UTC)  # Monday of 2026-w45
TENANTS = ("acme", "globex")
SUBJECTS = ("ann", "ben", "cat")
QUERY_TYPES = ("heatmap", "count", "trajectory")
MECHANISMS = (GaussianMechanism(2.5), GaussianMechanism(4.0), LaplaceMechanism(0.5))
ACROSS = {"query_types": ACROSS_QUERY_TYPES, "windows": ACROSS_WINDOWS}
FIRST_MONDAY = date(1969, 12, 29)  # ISO week 1970-w01: horizon periods count from it
VERIFY_EVERY = 8

SETTINGS = settings(
    max_examples=15,
    # The same examples every run: the outcomes below are reached every time, and CI is
    # repeatable (the ledger's own model, test_model_stateful, explores anew each run).
    derandomize=True,
    stateful_step_count=40,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
OUTCOMES: Counter = Counter()
MUST_REACH = ("granted", "refused by *across query types", "refused by *across windows")


def week_bounds(label: str) -> tuple[datetime, datetime]:
    year, week = label.split("-w")
    monday = datetime.combine(
        date.fromisocalendar(int(year), int(week), 1), datetime.min.time(), UTC
    )
    return monday, monday + timedelta(days=7)


def period_of(label: str) -> str:
    """The horizon period (``HORIZON`` weeks from 1970-w01) a week lies in, by the model."""
    monday = week_bounds(label)[0].date()
    index = (monday - FIRST_MONDAY).days // 7 // HORIZON * HORIZON
    first = FIRST_MONDAY + timedelta(days=7 * index)
    return f"{iso_week_label(datetime.combine(first, datetime.min.time(), UTC))}+{HORIZON}"


def period_end(label: str) -> datetime:
    first = week_bounds(label.split("+")[0])[0]
    return first + timedelta(days=7 * HORIZON)


@dataclasses.dataclass
class Release:
    tenant: str
    subjects: frozenset[str]
    query_type: str
    week: str
    mechanism: object
    count: int
    scopes: tuple[str, ...]  # the wider scopes whose caps applied when it was made
    state: str = "open"  # open, committed, released
    handle: object = None
    corrected: bool = False  # an administrator's correction: charged, never cap-checked


def scopes_machine(template_url: str, clock: dict) -> type[RuleBasedStateMachine]:
    class ScopesAgainstModel(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            clock["now"] = START
            self.database = contextlib.ExitStack()
            url = self.database.enter_context(fresh_copy(template_url))
            self.ledger = AdminLedger(BudgetCap(CAP, DELTA), url=url)
            self.composer = Composer(self.ledger.orders, self.ledger.delta)
            self.caps: dict[tuple[str, str], float] = {}  # (tenant, across) -> cap
            # The Rényi order each cap is checked at (a privacy filter, "auto" by default).
            self.orders: dict[tuple[str, str], float] = {}
            self.releases: list[Release] = []
            self.sealed: set[tuple[str, str, str]] = set()  # (tenant, query type, label)
            self.rescoped: set[tuple[str, str, str, str]] = set()  # old keys' parts
            self.moved: dict[tuple[str, str, str, str], tuple[str, str, str, str]] = {}
            self.steps = 0

        def teardown(self) -> None:
            try:
                report = self.ledger.verify()
                assert report.ok, report.problems
            finally:
                self.ledger.close()
                self.database.close()

        # ------------------------------------------------------------ the model

        def wider(self, tenant: str) -> tuple[str, ...]:
            """The scopes whose caps apply to ``tenant``: its own, else every tenant's."""
            return tuple(
                across
                for across in ("query_types", "windows")
                if (tenant, across) in self.caps or (ANY, across) in self.caps
            )

        def accounts_of(
            self, release: Release, subject: str, *, moved: bool = True
        ) -> list[tuple[str, str, str, str]]:
            """The accounts (tenant, subject, query type, label) a release charges for one
            subject: its own (where re-scopes moved its spend since, with ``moved``), and
            the totals whose caps applied when it was made."""
            own = (release.tenant, subject, release.query_type, release.week)
            while moved and own in self.moved:
                own = self.moved[own]
            accounts = [own]
            for across in release.scopes:
                label = release.week if across == "query_types" else period_of(release.week)
                accounts.append((release.tenant, subject, ACROSS[across], label))
            return accounts

        def spend(self, account: tuple[str, str, str, str], *, held: bool) -> Counter:
            """What the model's releases put on ``account``: committed (and open, ``held``)."""
            total: Counter = Counter()
            states = ("committed", "open") if held else ("committed",)
            for release in self.releases:
                if release.state not in states:
                    continue
                for subject in release.subjects:
                    if account in self.accounts_of(release, subject):
                        total[release.mechanism] += release.count
            return total

        def cap_of(self, account: tuple[str, str, str, str]) -> float:
            tenant, _, query_type, _ = account
            for across, scope in ACROSS.items():
                if query_type == scope:
                    return self.caps.get((tenant, across), self.caps.get((ANY, across), 0.0))
            return CAP

        def order_of(self, account: tuple[str, str, str, str]) -> float:
            tenant, _, query_type, _ = account
            for across, scope in ACROSS.items():
                if query_type == scope:
                    return self.orders.get((tenant, across), self.orders.get((ANY, across), 0.0))
            return self.composer.order_of(CAP)

        def closed(self, account: tuple[str, str, str, str]) -> bool:
            label = account[3]
            end = period_end(label) if "+" in label else week_bounds(label)[1]
            return clock["now"] - GRACE >= end

        def expected(self, release: Release) -> set[str]:
            """What the rules allow for a new release: granted, or each refusal that applies."""
            reasons: set[str] = set()
            accounts = [
                account
                for subject in sorted(release.subjects)
                for account in self.accounts_of(release, subject, moved=False)
            ]
            if any((a[0], a[2], a[3]) in self.sealed or a in self.rescoped for a in accounts):
                reasons.add("WindowSealed")
            if any(self.closed(a) for a in accounts):
                reasons.add("WindowClosed")
            tie = False
            for account in accounts:
                after = self.spend(account, held=True)
                after[release.mechanism] += release.count
                cap = self.cap_of(account)
                epsilon = self.composer.checked(self.order_of(account), after)
                if close_to(epsilon, cap):
                    tie = True
                elif epsilon > cap:
                    reasons.add(f"BudgetExhausted by {account[2]}")
            if tie:
                reasons |= {"granted", "BudgetExhausted by a tie"}
            return reasons or {"granted"}

        # ------------------------------------------------------------ rules

        @initialize(
            types_cap=st.sampled_from([1.5, 2.5]), horizon_cap=st.sampled_from([1.5, 2.5, 5.0])
        )
        def caps_of_acme(self, types_cap, horizon_cap):
            """acme starts with both caps; the rules change them and add others."""
            self.set_cap("acme", "query_types", types_cap)
            self.set_cap("acme", "windows", horizon_cap)

        @rule(
            tenant=st.sampled_from((ANY, *TENANTS)),
            across=st.sampled_from(sorted(ACROSS)),
            cap=st.sampled_from([1.5, 2.5, 5.0]),
        )
        def set_cap(self, tenant, across, cap):
            horizon = {"horizon_windows": HORIZON} if across == "windows" else {}
            policy = Policy(cap, tenant=tenant, across=across, **horizon)
            # Its order ("auto"): the one the charged totals it will govern are checked at,
            # else the cap's own; totals checked at another one refuse it.
            charged = {(r.tenant, a) for r in self.releases for a in r.scopes if a == across}
            governed = [
                pair
                for pair in charged
                if pair[0] == tenant or (tenant == ANY and pair not in self.caps)
            ]
            was = {self.orders.get(pair, self.orders.get((ANY, across))) for pair in governed}
            order = next(iter(was)) if len(was) == 1 else self.composer.order_of(cap)
            if was - {order}:
                with pytest.raises(LedgerError, match="one privacy filter"):
                    self.ledger.set_policy(policy)
                OUTCOMES["policy refused: two orders"] += 1
                return
            assert self.ledger.set_policy(policy).filter_order == order
            self.caps[(tenant, across)] = cap
            self.orders[(tenant, across)] = order

        @rule(
            tenant=st.sampled_from(TENANTS),
            subjects=st.sets(st.sampled_from(SUBJECTS), min_size=1, max_size=3),
            query_type=st.sampled_from(QUERY_TYPES),
            last_week=st.booleans(),
            mechanism=st.sampled_from(MECHANISMS),
            count=st.integers(1, 2),
            then=st.sampled_from(["commit", "commit", "release", "keep open"]),
        )
        def release(self, tenant, subjects, query_type, last_week, mechanism, count, then):
            self.do_release(tenant, subjects, query_type, last_week, mechanism, count, then)

        @rule(
            subjects=st.sets(st.sampled_from(SUBJECTS), min_size=1, max_size=2),
            query_type=st.sampled_from(QUERY_TYPES),
            mechanism=st.sampled_from(MECHANISMS),
        )
        def release_in_acme_this_week(self, subjects, query_type, mechanism):
            """The releases that fill the capped totals: acme's, this week, committed."""
            self.do_release("acme", subjects, query_type, False, mechanism, 1, "commit")

        def do_release(self, tenant, subjects, query_type, last_week, mechanism, count, then):
            moment = clock["now"] - timedelta(days=7 if last_week else 0)
            week = iso_week_label(moment)
            release = Release(
                tenant, frozenset(subjects), query_type, week, mechanism, count, self.wider(tenant)
            )
            allowed = self.expected(release)
            keys = [key_for(s, query_type, week, tenant=tenant) for s in sorted(subjects)]
            try:
                release.handle = self.ledger.reserve(keys, mechanism, count)
            except BudgetExhausted as refused:
                named = refused.key.query_type if hasattr(refused.key, "query_type") else "?"
                assert (
                    f"BudgetExhausted by {named}" in allowed
                    or "BudgetExhausted by a tie" in allowed
                ), (
                    named,
                    allowed,
                )
                OUTCOMES[f"refused by {named}"] += 1
                return
            except (WindowSealed, WindowClosed) as refused:
                assert type(refused).__name__ in allowed, (refused, allowed)
                OUTCOMES[type(refused).__name__] += 1
                return
            assert "granted" in allowed, (allowed, release)
            OUTCOMES["granted"] += 1
            self.releases.append(release)
            if then == "commit":
                self.ledger.commit(release.handle)
                release.state = "committed"
            elif then == "release":
                self.ledger.release(release.handle, reason="never ran")
                release.state = "released"

        @precondition(lambda self: any(r.state == "open" for r in self.releases))
        @rule(data=st.data(), commit=st.booleans())
        def close_one(self, data, commit):
            release = data.draw(st.sampled_from([r for r in self.releases if r.state == "open"]))
            if commit:
                self.ledger.commit(release.handle)
                release.state = "committed"
            else:
                self.ledger.release(release.handle, reason="never ran")
                release.state = "released"

        @rule(
            tenant=st.sampled_from(TENANTS),
            subject=st.sampled_from(SUBJECTS),
            query_type=st.sampled_from(QUERY_TYPES),
            mechanism=st.sampled_from(MECHANISMS),
            rarely=st.integers(0, 3),
        )
        def correct(self, tenant, subject, query_type, mechanism, rarely):
            """A missed release, charged without a cap check (it happened) to the totals too."""
            if rarely:
                return
            week = iso_week_label(clock["now"])
            release = Release(
                tenant, frozenset([subject]), query_type, week, mechanism, 1, self.wider(tenant)
            )
            accounts = self.accounts_of(release, subject, moved=False)
            key = key_for(subject, query_type, week, tenant=tenant)
            if any((a[0], a[2], a[3]) in self.sealed or a in self.rescoped for a in accounts):
                with pytest.raises(WindowSealed):
                    self.ledger.correct(key, mechanism, reason="missed")
                return
            self.ledger.correct(key, mechanism, reason="missed")
            release.state, release.corrected = "committed", True
            self.releases.append(release)
            OUTCOMES["corrected"] += 1

        @rule(
            tenant=st.sampled_from(TENANTS),
            subject=st.sampled_from(SUBJECTS),
            old=st.sampled_from(QUERY_TYPES),
            new=st.sampled_from(QUERY_TYPES),
        )
        def rescope(self, tenant, subject, old, new):
            """A subject's week moves to another query type: its totals stay as they were."""
            week = iso_week_label(clock["now"])
            source, target = (tenant, subject, old, week), (tenant, subject, new, week)
            if old == new or source in self.rescoped or target in self.rescoped:
                return
            busy = any(
                r.state == "open" and source in self.accounts_of(r, subject) for r in self.releases
            )
            if busy or (tenant, old, week) in self.sealed or (tenant, new, week) in self.sealed:
                return
            if not self.spend(source, held=False):
                return
            self.ledger.rescope(
                key_for(subject, old, week, tenant=tenant),
                key_for(subject, new, week, tenant=tenant),
                reason="re-scored",
            )
            self.rescoped.add(source)
            self.moved[source] = target
            OUTCOMES["rescoped"] += 1

        @rule(days=st.sampled_from([0, 1, 1, 2, 4, 7]))
        def advance(self, days):
            clock["now"] += timedelta(days=days)

        @rule()
        def reset_closed(self):
            """Seal every closed window and period; a busy one (open reservations) waits."""
            with contextlib.suppress(LedgerError):  # WindowBusy: the others are reset
                self.ledger.reset_closed()
            with self.ledger.reading() as connection:
                rows = connection.exec_driver_sql(
                    'SELECT tenant, query_type, "window" FROM dp_windows '
                    "WHERE sealed_at IS NOT NULL"
                ).all()
            sealed = {tuple(row) for row in rows}
            assert self.sealed <= sealed  # a seal is for good
            for *_, label in sealed - self.sealed:
                end = period_end(label) if "+" in label else week_bounds(label)[1]
                assert clock["now"] - GRACE >= end, label  # only a closed window is sealed
                OUTCOMES[f"sealed {'period' if '+' in label else 'week'}"] += 1
            self.sealed = sealed

        # ------------------------------------------------------------ invariants

        @invariant()
        def the_totals_read_what_the_model_derives(self):
            """Every account the model's releases reach reads their committed spend (what
            a release was granted against was checked when it was granted: ``expected``)."""
            self.steps += 1
            accounts = {
                account
                for release in self.releases
                if release.state == "committed"
                for subject in release.subjects
                for account in self.accounts_of(release, subject)
            }
            for account in sorted(accounts):
                committed = self.composer.epsilon(self.spend(account, held=False))
                key = key_for(account[1], account[2], account[3], tenant=account[0])
                assert close_to(self.ledger.epsilon_of(key), committed), (account, committed)
            if self.steps % VERIFY_EVERY == 0:
                report = self.ledger.verify()
                assert report.ok, report.problems

    return ScopesAgainstModel


def test_caps_at_every_scope_agree_with_an_independent_model(ledger_url, monkeypatch):
    AdminLedger(BudgetCap(CAP, DELTA), url=ledger_url).close()  # the template
    clock = {"now": START}
    monkeypatch.setattr(ledger_clock, "now", lambda: clock["now"])
    OUTCOMES.clear()
    run_state_machine_as_test(scopes_machine(ledger_url, clock), settings=SETTINGS)
    missing = [m for m in MUST_REACH if not any(m in outcome for outcome in OUTCOMES)]
    assert not missing, (missing, sorted(OUTCOMES.items()))
