"""The windows a scheduled release charges and the attempts it uses, under real dag.test() runs.

The ledger owns windows: a run is charged for every window its data interval overlaps,
a sealed (reset) window is never charged again, and every task-instance try is an
attempt of its own: a deleted and re-created run is a new attempt, handed the release its
first run made (the same release), and charged again when it asks for a fresh one.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from dp_budget_provider.accounting import GaussianMechanism, RDPAccountant, ZCDPMechanism
from dp_budget_provider.ledger import key_for
from dp_budget_provider.ledger.storage import clock as ledger_clock
from dp_budget_provider.ledger.windows.calendar import window_bounds
from dp_budget_provider.ledger.windows.policy import DEFAULT_GRACE
from tests.airflow.dag_runner import load_dag, task_states
from tests.ledger_time import ledger_time_at

pytestmark = pytest.mark.heavy  # long: xdist starts it first (tests/conftest.py)

UTC = timezone.utc
DELTA = 1e-5

WEEKLY_DAG = """
from datetime import datetime, timezone
import pathlib
from airflow.timetables.interval import CronDataIntervalTimetable
from airflow.sdk import DAG
from dp_budget_provider.operators.release import DPReleaseOperator

RAN = pathlib.Path({ran!r})

def answer():
    with RAN.open("a") as ran:
        ran.write("ran\\n")
    return 42.0

with DAG(
    "DAG_ID",
    schedule=CronDataIntervalTimetable("0 0 * * 0", timezone="UTC"),  # Sunday to Sunday
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    params={{"refresh": False}},
) as dag:
    DPReleaseOperator(
        task_id="release",
        python_callable=answer,
        mechanism={{"kind": "gaussian", "noise_multiplier": 4.0}},
        l2_sensitivity=1.0,
        subjects=["alice", "bob"],
        query_type="heatmap",
        refresh="{{{{ params.refresh }}}}",
    )
"""

# The run of logical date Sunday 2026-11-15 reads [Sunday 11-08, Sunday 11-15): Sunday
# 11-08 belongs to ISO week 45, Monday 11-09 to Saturday 11-14 to week 46.
SUNDAY = datetime(2026, 11, 15, tzinfo=UTC)
# dag.test() runs the task in this process: the ledger's clock is pinned inside the weeks
# that run charges.
LEDGER_WINDOWS = ("2026-w45", "2026-w46")


@pytest.fixture
def weekly(tmp_path):
    ran = tmp_path / "ran.txt"
    return load_dag(WEEKLY_DAG.format(ran=str(ran))), ran


def runs_of(ran_file) -> int:
    return len(ran_file.read_text().splitlines()) if ran_file.exists() else 0


# z = 4 at sensitivity 1 on the default lattice: a discrete Gaussian, rho = 1/(2 z**2).
DISCRETE_Z4 = ZCDPMechanism(rho=1 / 32)


def one_release() -> float:
    accountant = RDPAccountant()
    accountant.compose(DISCRETE_Z4)
    return accountant.get_epsilon(DELTA)[0]


def test_a_weekly_run_spanning_two_iso_weeks_charges_both(ledger, weekly):
    dag, ran = weekly
    dag_run = dag.test(logical_date=SUNDAY)
    assert task_states(dag_run)["release"] == "success"
    assert runs_of(ran) == 1
    for subject in ("alice", "bob"):
        for window in ("2026-w45", "2026-w46"):
            key = key_for(subject, "heatmap", window)
            assert ledger.epsilon_of(key) == pytest.approx(one_release(), rel=1e-12), key
    assert ledger.epsilon_of(key_for("alice", "heatmap", "2026-w47")) == 0.0
    (reserve,) = [e for e in ledger.history() if e["action"] == "reserve"]
    # 2 subjects x 2 windows, one reservation: one class of both subjects per window.
    assert reserve["payload"]["key_count"] == 2
    assert [c["size"] for c in reserve["payload"]["cohorts"]] == [2, 2]
    assert ledger.verify().ok


def test_a_re_created_run_is_a_new_attempt_handed_the_same_release(ledger, weekly):
    """dag.test() with the same run_after deletes the earlier run and creates it again
    with the same run id and try number 1: only the task instance's UUID tells the two
    tries apart. The second run is the same release (same task, interval, mechanism and
    subjects): it is handed the first one's answer and charged nothing. Asked for a fresh
    release ({"refresh": true}), the re-created run is a new attempt and is charged again,
    or it would release for free."""
    dag, ran = weekly
    after = datetime(2026, 11, 16, 1, tzinfo=UTC)
    first = dag.test(logical_date=SUNDAY, run_after=after)
    second = dag.test(logical_date=SUNDAY, run_after=after)
    assert first.run_id == second.run_id
    assert runs_of(ran) == 1
    (reuse,) = [e["payload"] for e in ledger.history() if e["action"] == "reuse"]
    third = dag.test(logical_date=SUNDAY, run_after=after, run_conf={"refresh": True})
    assert third.run_id == first.run_id
    assert runs_of(ran) == 2
    attempts = [e["payload"]["attempt_id"] for e in ledger.history() if e["action"] == "commit"]
    attempts.append(reuse["attempt_id"])
    assert len(attempts) == len(set(attempts)) == 3
    assert all(attempt.split("/")[3:5] == ["-1", "1"] for attempt in attempts)
    twice = RDPAccountant()
    twice.compose(DISCRETE_Z4, 2)
    key = key_for("alice", "heatmap", "2026-w46")
    assert ledger.epsilon_of(key) == pytest.approx(twice.get_epsilon(DELTA)[0], rel=1e-12)


def test_reset_then_backfill_of_the_sealed_week_is_refused(ledger, weekly, monkeypatch):
    dag, ran = weekly
    assert task_states(dag.test(logical_date=SUNDAY))["release"] == "success"
    # The maintenance run after the grace period: weeks 45 and 46 are sealed and dropped.
    ledger_time_at(monkeypatch, window_bounds("2026-w46")[1] + DEFAULT_GRACE + timedelta(hours=1))
    assert ledger.reset_closed() == {"2026-w45": 2, "2026-w46": 2}
    # A re-run of the sealed weeks' own release is handed its answer, charging nothing.
    assert task_states(dag.test(logical_date=SUNDAY))["release"] == "success"
    assert runs_of(ran) == 1
    before = ledger.history()
    backfill = dag.test(logical_date=SUNDAY - timedelta(days=7))  # w44 and the sealed w45
    assert task_states(backfill)["release"] == "failed"
    assert runs_of(ran) == 1  # the callable never ran: no data was touched
    assert ledger.history() == before  # nothing reserved in w46 either: all or nothing
    assert ledger.verify().ok
    # A caller-chosen clock cannot close an open window: reset reads the ledger's clock.
    (now_window,) = ledger.windows_for("default", "heatmap", ledger_clock.now())
    current = key_for("alice", "heatmap", now_window)
    ledger.spend(current, GaussianMechanism(8.0))
    assert ledger.reset_closed() == {}
    assert ledger.epsilon_of(current) > 0
    monkeypatch.setattr(ledger_clock, "now", lambda: datetime(2100, 1, 1, tzinfo=UTC))
    assert current.window in ledger.reset_closed()  # only a test moves the ledger's clock
