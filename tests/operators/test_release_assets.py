"""A release's outlet Assets under dag.test() on a real Airflow metadata database (ledger
on SQLite and PostgreSQL): the asset event Airflow records carries the release's
guarantee, and only a made release emits one."""

from __future__ import annotations

import json
import uuid

import pytest

from dp_budget_provider.accounting import GaussianMechanism, Mechanism
from dp_budget_provider.accounting.answer_rule import AnswerRule
from dp_budget_provider.accounting.release import plan_noise
from dp_budget_provider.ledger import key_for
from tests.airflow.dag_runner import asset_events, load_dag, stored_xcom, task_states

pytestmark = pytest.mark.heavy  # long: xdist starts it first (tests/conftest.py)

WINDOW = "2026-w28"
LEDGER_WINDOWS = (WINDOW,)
SUBJECTS = [f"resident-{i:03d}" for i in range(50)]
MECHANISM = {"kind": "laplace", "epsilon0": 0.5}

RELEASE_DAG = """
from datetime import datetime, timezone
import pathlib
from airflow.sdk import DAG, Asset, AssetAlias, get_current_context
from dp_budget_provider.operators.release import DPReleaseOperator

OUTLET = {outlet}

def counts():
    pathlib.Path({ran!r}).write_text("ran")
    # The callable cannot forge the guarantee: the release writes its own after it.
    if isinstance(OUTLET, Asset):
        get_current_context()["outlet_events"][OUTLET].extra["dp_guarantee"] = {{"epsilon": 0}}
    return [12, 30, 8]

with DAG("DAG_ID", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
    DPReleaseOperator(
        task_id="release",
        python_callable=counts,
        mechanism={mechanism!r},
        l1_sensitivity=1.0,
        granularity=1,
        cells=3,
        integer=True,
        bounds=(0, 100),
        subjects={subjects!r},
        query_type="visit_counts",
        window={window!r},
        on_exhausted="skip",
        outlets=[OUTLET],
    )
"""


def run_release(tmp_path, outlet: str):
    ran = tmp_path / "ran"
    source = RELEASE_DAG.format(
        outlet=outlet, ran=str(ran), mechanism=MECHANISM, subjects=SUBJECTS, window=WINDOW
    )
    return load_dag(source).test(), ran.exists()


def fresh_asset() -> tuple[str, str]:
    """A new Asset (its source, its URI): name and URI unique to the test, as Airflow
    deactivates an Asset whose name another one's URI already has."""
    name = f"visit-counts-{uuid.uuid4().hex[:8]}"
    uri = f"dp-release://acme/{name}"
    return f'Asset(name="{name}", uri="{uri}")', uri


def test_the_asset_event_carries_the_guarantee_of_the_release(ledger, tmp_path):
    asset, uri = fresh_asset()
    dag_run, ran = run_release(tmp_path, asset)
    assert str(dag_run.state) == "success" and ran
    (event,) = asset_events(uri)
    assert (event["dag_id"], event["task_id"], event["run_id"]) == (
        dag_run.dag_id,
        "release",
        dag_run.run_id,
    )
    receipt = stored_xcom(dag_run, "release", "dp_budget_receipt")
    plan = plan_noise(
        Mechanism.from_spec(MECHANISM),
        l1_sensitivity=1.0,
        granularity=1,
        rule=AnswerRule(0.0, (0, 100), 3, True),
    )
    assert event["extra"] == {
        "dp_guarantee": {
            "reservation_id": receipt["reservation_id"],
            "mechanism": receipt["mechanism"],
            "noise": "lattice",
            "noise_std": pytest.approx(plan.noise_std, rel=1e-12),
            "epsilon": receipt["epsilon"],
            "delta": 1e-5,
            "epsilon_after": None,  # the receipt has no account state either
            "cap_epsilon": 3.0,
            "windows": [WINDOW],
            "cohort_size": {"at_least": 10, "below": 100},  # 50 residents
            "reused": False,
        }
    }
    assert receipt["epsilon"] > 0 and receipt["epsilon"] != 0  # not the callable's forgery
    assert ledger.epsilon_of(key_for(SUBJECTS[0], "visit_counts", WINDOW)) == pytest.approx(
        receipt["epsilon"]
    )
    published = json.dumps(event["extra"])
    assert not any(subject in published for subject in SUBJECTS)


def test_a_refused_release_emits_no_asset_event(ledger, tmp_path):
    ledger.spend(key_for(SUBJECTS[3], "visit_counts", WINDOW), GaussianMechanism(1.5))  # 2.98
    asset, uri = fresh_asset()
    dag_run, ran = run_release(tmp_path, asset)
    assert task_states(dag_run)["release"] == "skipped" and not ran
    assert asset_events(uri) == []


def test_an_asset_alias_outlet_is_refused_before_anything_is_reserved(ledger, tmp_path):
    before = ledger.history()
    dag_run, ran = run_release(tmp_path, 'AssetAlias("dp-releases")')
    assert task_states(dag_run)["release"] == "failed" and not ran
    assert ledger.history() == before


TASKFLOW_DAG = """
from datetime import datetime, timezone
from airflow.sdk import DAG, Asset, task

with DAG("DAG_ID", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
    @task.dp_release(
        mechanism={mechanism!r},
        l1_sensitivity=1.0,
        granularity=1,
        subjects={subjects!r},
        query_type="visit_counts",
        window={window!r},
        outlets=[{outlet}],
    )
    def total() -> int:
        return 50

    total()
"""


def test_the_taskflow_form_publishes_the_same_guarantee(ledger, tmp_path):
    asset, uri = fresh_asset()
    source = TASKFLOW_DAG.format(
        mechanism=MECHANISM, subjects=SUBJECTS, window=WINDOW, outlet=asset
    )
    dag_run = load_dag(source).test()
    assert str(dag_run.state) == "success"
    (event,) = asset_events(uri)
    receipt = stored_xcom(dag_run, "total", "dp_budget_receipt")
    guarantee = event["extra"]["dp_guarantee"]
    assert guarantee["reservation_id"] == receipt["reservation_id"]
    assert guarantee["epsilon"] == receipt["epsilon"] > 0
    assert guarantee["cohort_size"] == {"at_least": 10, "below": 100}
