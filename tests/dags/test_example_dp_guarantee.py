"""example_dp_guarantee_producer and _consumer: the release's asset event carries its
guarantee, and the DAG scheduled on the Asset reads it from ``inlet_events``; both run
with dag.test() on the real metadata database and a fresh SQLite ledger."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from dp_budget_provider.ledger import PrivacyBudgetLedger
from tests.airflow.dag_runner import (
    asset_events,
    ledger_connection,
    load_dag,
    stored_xcom,
    task_states,
)
from tests.ledger_time import ledger_time_in, this_week

DAGS = Path(__file__).resolve().parents[2] / "dags"
ASSET_NAME, ASSET_URI = "weekly_visit_counts", "dp-release://acme/weekly-visit-counts"


def load_example(name: str, asset: str):
    """The example DAG ``name`` under a fresh id, its Asset renamed to ``asset`` (each test
    its own Asset in the session's metadata database)."""
    source = (DAGS / f"{name}.py").read_text()
    source = source.replace(f'"{name}"', '"DAG_ID"').replace(ASSET_NAME, asset)
    return load_dag(source.replace("weekly-visit-counts", asset))


def test_the_consumer_reads_the_guarantee_the_producers_release_published(
    airflow_db, sqlite_url, monkeypatch
):
    # A weekly run's data interval is last week: the ledger's clock is in this week, as
    # when the scheduler starts that run (see tests/docs/test_readme_dags.py).
    ledger_time_in(monkeypatch, this_week())
    ledger_connection(monkeypatch, sqlite_url, admin_public_key=None)  # the task creates it
    monkeypatch.setenv("AIRFLOW__DP_BUDGET__ALLOW_UNPINNED", "True")
    asset = f"visits-{uuid.uuid4().hex[:8]}"
    producer = load_example("example_dp_guarantee_producer", asset)
    consumer = load_example("example_dp_guarantee_consumer", asset)
    uri = f"dp-release://acme/{asset}"
    # The consumer runs when the Asset gets an event, on nothing else.
    assert [a.uri for a in consumer.timetable.asset_condition.objects] == [uri]

    released = producer.test()
    assert set(task_states(released).values()) == {"success"}
    (event,) = asset_events(uri)
    guarantee = event["extra"]["dp_guarantee"]
    receipt = stored_xcom(released, "release_visit_counts", "dp_budget_receipt")
    assert guarantee["reservation_id"] == receipt["reservation_id"]
    assert guarantee["epsilon"] == receipt["epsilon"] > 0
    assert guarantee["cohort_size"] == {"at_least": 10, "below": 100}  # 50 residents
    ledger = PrivacyBudgetLedger(url=sqlite_url)
    try:
        assert len(ledger.accounts(limit=None)) == 50
    finally:
        ledger.close()

    read = consumer.test()
    assert set(task_states(read).values()) == {"success"}
    assert stored_xcom(read, "data_card", "return_value") == {
        "release": receipt["reservation_id"],
        "windows": receipt["windows"],
        "guarantee": f"({receipt['epsilon']:.3g}, 1e-05)-DP",
        "noise_std": guarantee["noise_std"],
        "population": "10 to 99 people",
    }
    assert "resident" not in json.dumps(stored_xcom(read, "data_card", "return_value"))
