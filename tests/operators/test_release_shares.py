"""DPReleaseOperator at a divided cap under dag.test() on a real Airflow metadata DB (ledger
on SQLite and PG): the DAG's principal is the administrator's mapping of its DAG id, its
receipt tells it its own share's state, and a DAG no share names is refused."""

from __future__ import annotations

import json

import pytest

from dp_budget_provider.ledger import Policy, key_for
from dp_budget_provider.ledger.windows.shares import Share, share_query_type
from tests.airflow.dag_runner import load_dag, task_states
from tests.operators.test_release import KEY, WINDOW, release_source

# Over 20 s in all: scheduled before the light files (tests/conftest.py).
pytestmark = pytest.mark.heavy
# dag.test() runs the task in this process: the ledger's clock is pinned inside the window.
LEDGER_WINDOWS = (WINDOW,)


def test_a_release_pays_from_its_dag_s_share(ledger, tmp_path):
    out = tmp_path / "out.json"
    dag = load_dag(release_source(out))
    other = load_dag(release_source(tmp_path / "other.json"))
    ledger.set_policy(
        Policy(
            3.0,
            filter_order="auto",
            shares=[Share("analytics", 0.5, (dag.dag_id,)), Share("growth", 0.5, ("etl_g",))],
        )
    )
    dag_run = dag.test()
    assert str(dag_run.state) == "success"
    receipt = json.loads(out.read_text())["receipt"]
    share = receipt["share"]
    assert share["principal"] == "analytics" and share["scope"] == "heatmap"
    assert share["epsilon_after"] == pytest.approx(receipt["epsilon"])
    assert 0 < share["cap_epsilon"] < 3.0
    analytics = key_for("alice", share_query_type("analytics", "heatmap"), WINDOW)
    assert ledger.epsilon_of(analytics) == pytest.approx(receipt["epsilon"])
    assert ledger.epsilon_of(KEY) == pytest.approx(receipt["epsilon"])

    # A DAG no share names is refused: nothing ran, nothing was written.
    before = len(ledger.history(KEY))
    refused = other.test()
    assert task_states(refused)["release"] == "failed"
    assert not (tmp_path / "other.ran").exists()
    assert len(ledger.history(KEY)) == before
    report = ledger.verify()
    assert report.ok, report.problems


def test_auto_noise_is_planned_on_the_dag_s_share(ledger, tmp_path):
    """noise_multiplier="auto" plans the least noise with which the release alone fits the
    cap its DAG is held to: its share's, where the cap is divided (planned on nothing spent,
    so it says nothing about anyone)."""
    out = tmp_path / "out.json"
    dag = load_dag(release_source(out, mechanism={"kind": "gaussian", "noise_multiplier": "auto"}))
    ledger.set_policy(
        Policy(3.0, filter_order="auto", shares=[Share("analytics", 0.4, (dag.dag_id,))])
    )
    share = ledger.policy_for_release("default", "heatmap", dag.dag_id)
    assert share.cap_epsilon < 3.0
    dag_run = dag.test()
    assert str(dag_run.state) == "success"
    receipt = json.loads(out.read_text())["receipt"]
    assert receipt["share"]["fraction"] == pytest.approx(1.0, abs=1e-3)  # the share, all of it
    assert receipt["share"]["fraction"] <= 1.0
