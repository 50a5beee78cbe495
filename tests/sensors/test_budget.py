"""BudgetSensor: deferral to the next window (time-travelled clock and a real dag.test run)."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
from airflow.sdk.exceptions import AirflowSensorTimeout, AirflowSkipException, TaskDeferred

from dp_budget_provider.accounting import GaussianMechanism, RDPAccountant, rdp_to_epsilon
from dp_budget_provider.ledger import (
    BudgetCap,
    Policy,
    WindowCalendar,
    key_for,
)
from dp_budget_provider.sensors import budget
from dp_budget_provider.sensors.budget import BudgetSensor
from tests.admin import AdminLedger
from tests.airflow.dag_runner import ledger_connection, load_dag, task_states
from tests.ledger_time import ledger_time_at, ledger_time_in

# Over 20 s in all: scheduled before the light files (tests/conftest.py).
pytestmark = pytest.mark.heavy

UTC = timezone.utc
BIG = GaussianMechanism(1.5)  # eps 2.75: one per window under a cap of 3
# The ledger's clock (this process; dag.test() runs its tasks here too) starts inside the
# week the tests charge; at() moves it with the sensor's.
LEDGER_WINDOWS = ("2026-w29",)


@pytest.fixture
def ledger(airflow_db, sqlite_url, monkeypatch):
    ledger = AdminLedger(BudgetCap(3.0, 1e-5), url=sqlite_url)
    ledger_connection(monkeypatch, sqlite_url)
    yield ledger
    ledger.close()


def sensor(**overrides):
    arguments = dict(
        task_id="wait",
        mechanism=BIG,
        subject="alice",
        query_type="heatmap",
        deferrable=True,
        timeout=timedelta(days=30),
    )
    return BudgetSensor(**{**arguments, **overrides})


def at(monkeypatch, moment):
    """The sensor's clock reads ``moment``, and the ledger's clock too (it then runs)."""
    monkeypatch.setattr(budget, "utcnow", lambda: moment)
    ledger_time_at(monkeypatch, moment)


def test_defers_to_the_next_iso_week_and_completes_there(ledger, monkeypatch):
    ledger.spend(key_for("alice", "heatmap", "2026-w29"), BIG)
    at(monkeypatch, datetime(2026, 7, 14, 12, 0, tzinfo=UTC))  # inside 2026-w29
    with pytest.raises(TaskDeferred) as deferred:
        sensor().execute({})
    trigger = deferred.value.trigger
    assert trigger.moment == datetime(2026, 7, 20, tzinfo=UTC)
    assert trigger.deadline == datetime(2026, 8, 13, 12, 0, tzinfo=UTC)  # start + 30 days
    assert deferred.value.method_name == "execute_complete"
    # The trigger's event carries the deadline back (dag.test() drops defer kwargs).
    event = asyncio.run(anext(trigger.__class__(datetime.now(UTC), trigger.deadline).run()))
    at(monkeypatch, datetime(2026, 7, 20, 0, 0, 1, tzinfo=UTC))
    assert sensor().execute_complete({}, event=event.payload) == "2026-w30"


def test_defers_again_when_the_next_window_is_full_too(ledger, monkeypatch):
    at(monkeypatch, datetime(2026, 7, 20, 0, 0, 1, tzinfo=UTC))
    for window in ("2026-w29", "2026-w30"):
        ledger.spend(key_for("alice", "heatmap", window), BIG)
    with pytest.raises(TaskDeferred) as deferred:
        sensor().execute_complete({}, event={"deadline": "2026-08-30T00:00:00+00:00"})
    assert deferred.value.trigger.moment == datetime(2026, 7, 27, tzinfo=UTC)


def test_times_out_when_the_next_window_is_past_the_timeout(ledger, monkeypatch):
    ledger.spend(key_for("alice", "heatmap", "2026-w29"), BIG)
    at(monkeypatch, datetime(2026, 7, 14, 12, 0, tzinfo=UTC))
    with pytest.raises(AirflowSensorTimeout, match="timeout"):
        sensor(timeout=timedelta(days=1)).execute({})
    with pytest.raises(AirflowSkipException):
        sensor(timeout=timedelta(days=1), soft_fail=True).execute({})


def test_succeeds_at_once_when_the_release_fits(ledger, monkeypatch):
    at(monkeypatch, datetime(2026, 7, 14, 12, 0, tzinfo=UTC))
    assert sensor().execute({}) == "2026-w29"


def test_a_release_too_big_for_any_window_fails_immediately(ledger, monkeypatch):
    at(monkeypatch, datetime(2026, 7, 14, 12, 0, tzinfo=UTC))
    from airflow.sdk.exceptions import AirflowFailException

    with pytest.raises(AirflowFailException, match="no window will ever fit"):
        sensor(mechanism=GaussianMechanism(0.5)).execute({})


def test_a_release_the_filter_refuses_alone_fails_immediately(ledger, monkeypatch):
    """The cap of 3 checked at its filter order, 7.5: a release whose reported epsilon
    (the exact Gaussian bound) fits the cap alone, but whose curve at that order does not,
    never fits any window."""
    ledger.set_policy(Policy(3.0, filter_order="auto"))
    release = GaussianMechanism(1.45)
    accountant = RDPAccountant()
    accountant.compose(release)
    at_order = np.flatnonzero(accountant.orders == 7.5)
    checked = rdp_to_epsilon(accountant.orders[at_order], accountant.rdp[at_order], 1e-5)[0]
    assert accountant.get_epsilon(1e-5)[0] <= 3.0 < checked
    at(monkeypatch, datetime(2026, 7, 14, 12, 0, tzinfo=UTC))
    from airflow.sdk.exceptions import AirflowFailException

    with pytest.raises(AirflowFailException, match="no window will ever fit"):
        sensor(mechanism=release).execute({})


def test_no_subject_stands_for_the_empty_account(ledger, monkeypatch):
    """Whether a release could ever fit is priced on nothing spent, not on an account:
    a subject of any name (here "-") that has spent its budget only defers the releases
    that cover it."""
    ledger.spend(key_for("-", "heatmap", "2026-w29"), BIG)
    assert ledger.fits_an_empty_account("default", "heatmap", BIG)
    assert not ledger.fits_an_empty_account("default", "heatmap", GaussianMechanism(0.5))
    at(monkeypatch, datetime(2026, 7, 14, 12, 0, tzinfo=UTC))
    assert sensor().execute({}) == "2026-w29"
    with pytest.raises(TaskDeferred):
        sensor(subject="-").execute({})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"window": "2099-w10"}, "has not begun"),
        ({"subject": None, "subjects": []}, "subjects is empty"),
    ],
)
def test_a_release_the_ledger_would_refuse_whatever_the_budget_fails_at_once(
    ledger, monkeypatch, overrides, message
):
    """Not "fits": the release's own reservation would refuse it, and waiting cannot help."""
    from airflow.sdk.exceptions import AirflowFailException

    ledger_time_in(monkeypatch, "2026-w10")
    ledger.spend(key_for("alice", "heatmap", "2026-w10"), BIG)
    at(monkeypatch, datetime(2026, 7, 14, 12, 0, tzinfo=UTC))
    ledger.reset("2026-w10")
    with pytest.raises(AirflowFailException, match=message):
        sensor(**overrides).execute({})


def test_a_sealed_window_waits_like_a_full_one(ledger, monkeypatch):
    """The sensor's one bit: a sealed window (or a quarantine, a re-scoped subject) does not
    fit, like a full cap; told apart, they would say something about other DAGs' data."""
    ledger_time_in(monkeypatch, "2026-w10")
    ledger.spend(key_for("alice", "heatmap", "2026-w10"), BIG)
    at(monkeypatch, datetime(2026, 7, 14, 12, 0, tzinfo=UTC))
    ledger.reset("2026-w10")
    with pytest.raises(TaskDeferred):
        sensor(window="2026-w10").execute({})


def test_one_subject_of_a_large_cohort_past_the_cap_defers_the_whole_release(
    ledger, monkeypatch, capsys
):
    """One grouped check over the cohort (not one read per subject) finds the one
    subject whose window is full; the task's log says only that the window cannot fit."""
    cohort = np.array([f"user-{i}" for i in range(20_000)])
    ledger.spend(key_for("user-123", "heatmap", "2026-w29"), BIG)
    at(monkeypatch, datetime(2026, 7, 14, 12, 0, tzinfo=UTC))
    with pytest.raises(TaskDeferred):
        sensor(subject=None, subjects=cohort).execute({})
    logged = capsys.readouterr()
    logged = logged.out + logged.err
    assert "window 2026-w29 cannot fit the release" in logged
    assert "user-123" not in logged and "state(s)" not in logged
    at(monkeypatch, datetime(2026, 7, 20, 0, 0, 1, tzinfo=UTC))
    assert sensor(subject=None, subjects=cohort).execute({}) == "2026-w30"


SENSOR_DAG = """
import asyncio
import time
from datetime import datetime, timedelta, timezone
from airflow.sdk import DAG
from dp_budget_provider.operators.release import DPReleaseOperator
from dp_budget_provider.sensors.budget import BudgetSensor

SPEC = {{"kind": "gaussian", "noise_multiplier": 1.5}}
with DAG("DAG_ID", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
    wait = BudgetSensor(task_id="wait", mechanism=SPEC, subject="alice", query_type="burst",
                        tenant="demo", {mode}, poke_interval=1,
                        timeout=timedelta(seconds={timeout}), soft_fail={soft_fail})
    release = DPReleaseOperator(task_id="release", python_callable=lambda: 1.0, mechanism=SPEC,
                                l2_sensitivity=1.0, subject="alice", query_type="burst",
                                tenant="demo", window=wait.output)
    wait >> release
"""


def short_windows(ledger, seconds):
    ledger.set_policy(
        Policy(
            3.0,
            tenant="demo",
            calendar=WindowCalendar("fixed", seconds),
            min_window=timedelta(seconds=seconds),
            compliance_clause="demo only: windows of a few seconds",
        )
    )
    return WindowCalendar("fixed", seconds)


def test_dag_defers_until_the_next_window_opens_then_releases_there(ledger, monkeypatch):
    ledger_time_at(monkeypatch, datetime.now(UTC))  # the real clock's windows, as the DAG's
    calendar = short_windows(ledger, 20)
    now = datetime.now(UTC)
    if (calendar.next_window_start(now) - now).total_seconds() < 15:
        time.sleep((calendar.next_window_start(now) - now).total_seconds() + 0.2)
        now = datetime.now(UTC)
    exhausted = calendar.window_of(now)
    ledger.spend(key_for("alice", "burst", exhausted, tenant="demo"), BIG)
    dag_run = load_dag(
        SENSOR_DAG.format(mode="deferrable=True", timeout=60, soft_fail=False)
    ).test()
    assert task_states(dag_run) == {"wait": "success", "release": "success"}
    released = [e for e in ledger.history() if e["action"] == "commit"][-1]
    assert released["key"]["window"] == calendar.window_of(calendar.next_window_start(now))
    assert released["at"] >= calendar.next_window_start(now).strftime("%Y-%m-%dT%H:%M:%S")


@pytest.mark.parametrize("mode", ["poke", "reschedule"])
@pytest.mark.parametrize(("soft_fail", "state"), [(False, "failed"), (True, "skipped")])
def test_poke_and_reschedule_modes_honour_timeout_and_soft_fail(
    ledger, mode, soft_fail, state, monkeypatch
):
    ledger_time_at(monkeypatch, datetime.now(UTC))  # the real clock's windows, as the DAG's
    short_windows(ledger, 3600)
    ledger.spend(
        key_for(
            "alice",
            "burst",
            WindowCalendar("fixed", 3600).window_of(datetime.now(UTC)),
            tenant="demo",
        ),
        BIG,
    )
    source = SENSOR_DAG.format(mode=f"mode={mode!r}", timeout=2, soft_fail=soft_fail)
    dag_run = load_dag(source).test()
    assert task_states(dag_run)["wait"] == state


def test_the_sensor_log_names_overdue_maintenance(ledger, monkeypatch, capsys):
    from dp_budget_provider.ledger.storage import clock

    now = clock.now()  # the ledger's clock, inside LEDGER_WINDOWS
    window = WindowCalendar().window_of(now)
    at(monkeypatch, now)
    assert sensor(window=window).execute({}) == window
    assert "maintenance overdue" not in "".join(capsys.readouterr())
    monkeypatch.setattr(clock, "now", lambda: now + timedelta(minutes=11))
    assert sensor(window=window).execute({}) == window
    logged = [line for line in "".join(capsys.readouterr()).splitlines() if "overdue" in line]
    assert len(logged) == 1 and "reap has never run" in logged[0], logged
    assert "alice" not in logged[0]
