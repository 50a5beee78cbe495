"""DPReleaseOperator inside the ledger's independent model (SQLite and PostgreSQL).

The ledger's state machine (``tests/ledger/test_model_stateful.py``) gains one rule: a
task try runs ``DPReleaseOperator.execute`` through the real hook (the default
connection points at the example's ledger). Tries are new runs, retries (the next try
number), re-created runs (a deleted run triggered again: same run id and try number, a
new task-instance uuid) and the very same try again; the data interval is random, or the
release names a canonical window, or a label that is not one; the callable returns or
raises after it started. The model predicts every outcome from the documented rules:
which keys the interval charges, that a refusal never runs the callable and writes
nothing, that the callable runs on an open reservation leased for the configured lease
from the ledger's clock, that a started callable is charged whatever it does, that a try
releases at most once, and the same cap invariants as for the ledger API.

The task try is the part of Airflow's runtime context the operator reads (its ids and
``xcom_push``); real ``dag.test()`` runs of the same paths are in ``test_release.py``.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import Counter
from datetime import datetime, timedelta
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule, run_state_machine_as_test

from dp_budget_provider.accounting import GaussianMechanism, RDPAccountant
from dp_budget_provider.accounting.release import plan_noise
from dp_budget_provider.ledger import (
    AttemptReused,
    BudgetCap,
    PrivacyBudgetLedger,
    Reservation,
    key_for,
)
from dp_budget_provider.ledger import errors as ledger_errors
from dp_budget_provider.ledger.gate import UNIFORM_REFUSAL
from dp_budget_provider.ledger.storage import clock as ledger_clock
from dp_budget_provider.operators.release import (
    RECEIPT_XCOM_KEY,
    DPBudgetExhaustedError,
    DPReleaseOperator,
)
from tests.admin import ADMIN
from tests.airflow.dag_runner import ledger_connection
from tests.ledger.test_model_stateful import (
    BACK,
    CAP,
    COMMITTED,
    DELTA,
    LEASE,
    MECHANISMS,
    OPEN,
    OUTCOMES,
    QUERY_TYPES,
    SETTINGS,
    SUBJECTS,
    TENANTS,
    Clock,
    close_to,
    event,
    iso_week_label,
    iso_weeks_overlapping,
    ledger_machine,
)

# Over 20 s in all: scheduled before the light files (tests/conftest.py).
pytestmark = pytest.mark.heavy

# A run's data interval: two in three end in the last two days, in weeks a new release may
# still charge (within their grace period), as a run on schedule's does; the others are
# drawn as the ledger's model draws them, mostly backfills into weeks past their grace
# period (refused: closed, and may be sealed). Without the recent ones nearly every run
# would be refused, and the outcomes below would not be reached.
RECENT = st.integers(0, 2 * 24)
# The arguments of an operator release, drawn for every kind of task try.
RELEASE = {
    "tenant": st.sampled_from(TENANTS),
    "query_type": st.sampled_from(QUERY_TYPES),
    "subjects": st.sets(st.sampled_from(SUBJECTS), min_size=1),
    "back_hours": st.one_of(RECENT, RECENT, BACK),
    "length_hours": st.one_of(RECENT, st.integers(0, 10 * 24)),
    "window": st.sampled_from(["interval", "interval", "interval", "canonical", "not canonical"]),
    "mechanism": st.sampled_from(MECHANISMS),
    "count": st.integers(1, 2),
    "raises": st.booleans(),
    "on_exhausted": st.sampled_from(["fail", "skip"]),
}
# The very same try runs again soon after, over a recent interval: its windows still take
# new releases, so what refuses it is that it released before (or the cap), not the clock.
AGAIN = {**RELEASE, "back_hours": RECENT, "length_hours": RECENT}
# Outcomes every run of this test reaches: operator releases granted, refused by the
# cap, refused as a try that already released, and charged although the callable raised.
MUST_REACH = (
    "operator: released",
    "operator: BudgetExhausted",
    "operator: AttemptReused",
    "operator: callable raised, charged",
)


@dataclasses.dataclass
class TaskTry:
    """One task-instance try: the ids the operator builds its attempt from, and its XComs."""

    run_id: str
    try_number: int
    id: str = dataclasses.field(default_factory=lambda: str(uuid.uuid4()))
    dag_id: str = "model_dag"
    task_id: str = "release"
    map_index: int = -1
    xcoms: dict[str, Any] = dataclasses.field(default_factory=dict)

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcoms[key] = value

    def attempt(self) -> str:
        """The attempt id the operator derives (its documented form)."""
        ids = (self.dag_id, self.task_id, self.run_id, self.map_index, self.try_number, self.id)
        return "/".join(map(str, ids))


class QueryFailed(RuntimeError):
    """The callable failed after it had started reading the data."""


def operator_machine(clock: Clock, template_url: str) -> type:
    """The ledger's model with operator runs among its rules."""

    class OperatorAgainstModel(ledger_machine(clock, template_url)):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.tries: list[TaskTry] = []
            self.runs = 0

        def new_try(self, run_id: str | None = None, try_number: int = 1) -> TaskTry:
            if run_id is None:
                self.runs += 1
                run_id = f"scheduled__{self.runs}"
            try_ = TaskTry(run_id, try_number)
            self.tries.append(try_)
            return try_

        @rule(**RELEASE)
        def a_new_run(self, **release: Any):
            self.run_operator(self.new_try(), **release)

        @precondition(lambda self: bool(self.tries))
        @rule(data=st.data(), **RELEASE)
        def a_retry(self, data, **release: Any):
            """The next try of a run: a new try number, a new attempt."""
            run_id = data.draw(st.sampled_from(self.tries), label="earlier try").run_id
            later = max(t.try_number for t in self.tries if t.run_id == run_id)
            self.run_operator(self.new_try(run_id, later + 1), **release)

        @precondition(lambda self: bool(self.tries))
        @rule(data=st.data(), **RELEASE)
        def a_recreated_run(self, data, **release: Any):
            """A run deleted and triggered again: same run id and try number, a new uuid."""
            earlier = data.draw(st.sampled_from(self.tries), label="earlier try")
            self.run_operator(self.new_try(earlier.run_id, earlier.try_number), **release)

        @precondition(lambda self: bool(self.tries))
        @rule(data=st.data(), **AGAIN)
        def the_same_try_again(self, data, **release: Any):
            """A try that reserved before may never release again (one that was refused
            wrote nothing, so it still may)."""
            granted = [t for t in self.tries if t.attempt() in self.granted_attempts]
            try_ = data.draw(st.sampled_from(granted or self.tries), label="earlier try")
            self.run_operator(try_, **release)

        def run_operator(
            self,
            try_: TaskTry,
            *,
            tenant,
            query_type,
            subjects,
            back_hours,
            length_hours,
            window,
            mechanism,
            count,
            raises,
            on_exhausted,
        ):
            """A task try runs the operator over its data interval [start, end)."""
            end = clock.moment - timedelta(hours=back_hours)
            start = end - timedelta(hours=length_hours)
            label = {
                "interval": None,
                "canonical": iso_week_label(start),
                "not canonical": f"{start.year:04d}-{start.month:02d}",  # a month, not a week
            }[window]
            weeks = [label] if label else iso_weeks_overlapping(start, end)
            keys = [
                key_for(s, query_type, w, tenant=tenant) for w in weeks for s in sorted(subjects)
            ]
            sensitivity = (
                {"l2_sensitivity": 1.0}
                if isinstance(mechanism, GaussianMechanism)
                else {"l1_sensitivity": 1.0}
            )
            calls: list[int] = []

            def query() -> float:
                calls.append(1)
                (held,) = [r for r in self.ledger.open_reservations() if r.attempt_id == attempt]
                assert datetime.fromisoformat(held.lease_expires_at) == clock.moment + LEASE
                if raises:
                    raise QueryFailed("the query failed on the data")
                return 42.0

            operator = DPReleaseOperator(
                task_id=try_.task_id,
                python_callable=query,
                mechanism=mechanism,
                query_type=query_type,
                subjects=sorted(subjects),
                tenant=tenant,
                window=label,
                count=count,
                on_exhausted=on_exhausted,
                **sensitivity,
            )
            charged = plan_noise(mechanism, noise=operator.noise, **sensitivity).charged
            attempt = try_.attempt()
            context = {
                "ti": try_,
                "run_id": try_.run_id,
                "data_interval_start": start,
                "data_interval_end": end,
                "logical_date": start,
            }
            try_.xcoms.clear()
            if window == "not canonical":
                with pytest.raises(AirflowFailException, match="no release") as raised:
                    operator.execute(context)
                assert "is not a window of" in str(raised.value), raised.value
                assert raised.value.__cause__ is None  # one line in the log, not a chain
                assert not calls and not try_.xcoms
                event("operator: not a canonical window")
                return
            allowed = self.expected_reserve(keys, charged, count, attempt)
            try:
                release = operator.execute(context)
            except (AirflowFailException, AirflowSkipException) as refusal:
                self.operator_refused(refusal, on_exhausted, allowed, keys, attempt, calls)
                return
            except QueryFailed:
                assert raises, "only the callable raises QueryFailed"
                event("operator: callable raised, charged")
            else:
                assert not raises and isinstance(release, float), release
                event("operator: released")
            assert calls == [1] and "granted" in allowed, (allowed, attempt)
            self.operator_charged(try_, keys, charged, count, attempt)

        def operator_refused(self, refusal, on_exhausted, allowed, keys, attempt, calls) -> None:
            """No release: the callable never ran, nothing was written. A refusal by the
            ledger says nothing but a reference, which the administrator opens to check it
            against the model; a bad argument (ValueError) is the caller's own."""
            assert not calls, "a refused release ran its callable"
            assert refusal.__cause__ is None, "the ledger's error must not reach the task"
            reference = str(refusal).rsplit(" ", 1)[-1]
            if reference.startswith("dpb-ref-1."):
                cause = getattr(ledger_errors, ADMIN.open(reference)["refusal"])
                expected = (
                    AirflowSkipException if on_exhausted == "skip" else DPBudgetExhaustedError
                )
                assert type(refusal) is expected, (refusal, on_exhausted)
                assert str(refusal).startswith("no release: " + UNIFORM_REFUSAL), refusal
            else:
                cause = ValueError
                assert type(refusal) is AirflowFailException, refusal
            self.refused("operator", cause.__new__(cause), allowed, keys, attempt)
            if cause is AttemptReused:
                assert attempt in self.granted_attempts

        def operator_charged(self, try_: TaskTry, keys, charged, count, attempt) -> None:
            """The try's reservation is committed and its receipt is in the try's XCom."""
            receipt = try_.xcoms[RECEIPT_XCOM_KEY]
            handle = Reservation(
                receipt["reservation_id"],
                attempt,
                tuple(sorted(keys)),
                charged,
                count,
                OPEN,
                0.0,
                "",
            )
            model = self.granted_reservation(handle, keys, charged, count, attempt)
            self.close(model, COMMITTED)
            alone = RDPAccountant()
            alone.compose(charged, count)
            assert receipt["keys"] == len(set(keys)), receipt
            assert close_to(receipt["epsilon"], alone.get_epsilon(DELTA)[0]), receipt
            assert "key" not in receipt and "account" not in receipt
            assert receipt["mechanism"] == charged.to_spec(), receipt

        @precondition(lambda self: bool(self.tries))
        @rule()
        def every_try_released_at_most_once(self):
            """Across retries, re-created runs and repeats: one reserve entry per attempt."""
            attempts = Counter(r.attempt for r in self.reserved.values())
            assert all(n == 1 for n in attempts.values()), attempts

    return OperatorAgainstModel


def test_the_operator_agrees_with_the_ledger_model(airflow_db, ledger_url, monkeypatch):
    # The template every example copies, with its administrator (the refusals' references).
    PrivacyBudgetLedger(BudgetCap(CAP, DELTA), url=ledger_url, admin=ADMIN).close()
    clock = Clock()
    monkeypatch.setattr(ledger_clock, "now", clock.now)
    urls: list[str] = []

    class Machine(operator_machine(clock, ledger_url)):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            urls.append(self.ledger.url)
            ledger_connection(monkeypatch, self.ledger.url)  # the operator's hook opens it

    OUTCOMES.clear()
    # Random runs reach every outcome most of the time; a run that missed one runs again
    # (at most three runs), so the check is on the model's reach, not on one draw's luck.
    for _ in range(3):
        run_state_machine_as_test(Machine, settings=SETTINGS)
        missing = [m for m in MUST_REACH if not any(m in outcome for outcome in OUTCOMES)]
        if not missing:
            break
    assert not missing, (missing, sorted(OUTCOMES.items()))
    assert len(set(urls)) == len(urls) > 1, "every example opened a fresh ledger"


def test_the_task_try_builds_the_operators_attempt_id():
    """The model's attempt ids are the operator's own (else its predictions prove little)."""
    from dp_budget_provider.operators.release import attempt_id

    try_ = TaskTry("manual__2026-12-01", 3)
    assert attempt_id({"ti": try_, "run_id": try_.run_id}) == try_.attempt()
