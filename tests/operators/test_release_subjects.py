"""Subjects from the data: an upstream task lists the cohort, the release charges it.

A DAG file should not hold the population: the operator takes its subjects from an
upstream task's output (XCom), any collection (a numpy array), or a callable that Airflow
calls with the task's context when it runs (as for any templated field).
``noise_multiplier="auto"`` plans on the cohort's distinct held states.
"""

from __future__ import annotations

import pytest

from dp_budget_provider.ledger import keys_for
from tests.airflow.dag_runner import load_dag, stored_xcom, task_states

pytestmark = pytest.mark.heavy  # long: xdist starts it first (tests/conftest.py)

WINDOW = "2026-w28"
# dag.test() runs the tasks in this process: the ledger's clock is pinned inside the window.
LEDGER_WINDOWS = (WINDOW,)
COHORT_DAG = """
from datetime import datetime, timedelta, timezone
import numpy as np
from airflow.sdk import DAG, task
from dp_budget_provider.operators.release import DPReleaseOperator

with DAG("DAG_ID", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
    @task
    def list_cohort():
        return [f"user-{{i}}" for i in range({size})] + ["USER-0"]  # one subject twice

    @task
    def register_cohort():
        from dp_budget_provider.hooks.dp_budget import DPBudgetHook

        ids = [f"user-{{i}}" for i in range({size})]
        return DPBudgetHook().get_ledger().cohort(ids).as_dict()

    DPReleaseOperator(
        task_id="release",
        python_callable=lambda: {size},
        mechanism={mechanism!r},
        l2_sensitivity=1.0,
        granularity=1,
        integer=True,
        bounds=(0, 10**9),
        subjects={subjects},
        query_type="count",
        window="{window}",
        retries={retries},
        retry_delay=timedelta(seconds=0),
    )
"""


def run(size, subjects, mechanism=None, retries=0):
    source = COHORT_DAG.format(
        size=size,
        subjects=subjects,
        mechanism=mechanism or {"kind": "gaussian", "noise_multiplier": 5.0},
        window=WINDOW,
        retries=retries,
    )
    dag_run = load_dag(source).test()
    return dag_run, stored_xcom(dag_run, "release", "dp_budget_receipt")


def charged(ledger, size):
    keys = keys_for([f"user-{i}" for i in range(size)], "count", [WINDOW])
    return {ledger.receipt(key).epsilon for key in keys}


def test_an_upstream_task_lists_the_cohort_and_every_subject_is_charged_once(ledger):
    dag_run, receipt = run(300, "list_cohort()")
    assert task_states(dag_run) == {"list_cohort": "success", "release": "success"}
    assert receipt["keys"] == 300  # "USER-0" is user-0
    expected = ledger.prospective_epsilon(keys_for(["fresh"], "count", [WINDOW])[0], {
        "kind": "zcdp", "rho": 1 / 50})  # fmt: skip
    assert charged(ledger, 300) == {receipt["epsilon"]} == {expected}


@pytest.mark.parametrize(
    "subjects",
    [
        "np.array([f'user-{i}' for i in range(40)])",
        "lambda context, jinja_env: (f'user-{i}' for i in range(40))",  # Airflow calls it
    ],
    ids=["numpy-array", "callable"],
)
def test_subjects_from_an_array_or_a_callable(ledger, subjects):
    dag_run, receipt = run(40, subjects)
    assert task_states(dag_run)["release"] == "success"
    assert receipt["keys"] == 40 and len(charged(ledger, 40)) == 1


def test_a_registered_cohort_travels_as_its_handle_and_repeats_touch_one_row(ledger):
    """The upstream task registers the ids and hands on only the handle: the release
    charges every subject through it, and the same release again writes one
    reservation key (one class), not one per subject."""
    dag_run, receipt = run(250, "register_cohort()")
    assert task_states(dag_run) == {"register_cohort": "success", "release": "success"}
    assert receipt["keys"] == 250 and "key" not in receipt
    assert len(charged(ledger, 250)) == 1
    again, _ = run(250, "register_cohort()")
    assert task_states(again)["release"] == "success"
    reserves = [e for e in ledger.history() if e["action"] == "reserve"]
    assert [e["payload"]["key_count"] for e in reserves] == [1, 1]
    assert reserves[1]["payload"]["cohorts"][0]["refined"] is None  # a known cohort
    assert len(charged(ledger, 250)) == 1 and ledger.verify().ok


def test_a_template_string_is_refused_before_anything_is_reserved(ledger):
    dag_run, _ = run(5, "'{{ ti.xcom_pull(task_ids=\"list_cohort\") }}'", retries=2)
    release = next(ti for ti in dag_run.get_task_instances() if ti.task_id == "release")
    assert str(release.state) == "failed" and release.try_number == 1  # not retried
    assert ledger.history(after_seq=0)[-1]["action"] != "reserve"


def test_auto_noise_plans_on_nothing_spent(ledger):
    """ "auto" never reads the cohort's spend (the noise would tell it): the release alone
    costs the cap, and every subject of the cohort is charged that."""
    dag_run, receipt = run(200, "list_cohort()", {"kind": "gaussian", "noise_multiplier": "auto"})
    assert task_states(dag_run)["release"] == "success"
    (spent,) = charged(ledger, 200)
    assert spent == pytest.approx(receipt["epsilon"])
    assert receipt["epsilon"] == pytest.approx(3.0, rel=1e-6) and receipt["epsilon"] <= 3.0
