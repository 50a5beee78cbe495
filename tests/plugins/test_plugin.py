"""Registration of the UI plugin and the task link; the link made by a real DAG run."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from importlib.metadata import entry_points
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from airflow.plugins_manager import AirflowPlugin

from dp_budget_provider.get_provider_info import get_provider_info
from dp_budget_provider.ledger import PrivacyBudgetLedger
from dp_budget_provider.operators.release import RECEIPT_XCOM_KEY, DPReleaseOperator
from dp_budget_provider.plugins import links
from dp_budget_provider.plugins.links import DPBudgetAccountLink
from tests.airflow.dag_runner import ledger_connection, load_dag, stored_xcom, task_states
from tests.ledger_time import ledger_time_in, this_week
from tests.plugins.conftest import CHAIN_KEY

pytestmark = pytest.mark.heavy  # long: xdist starts it first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def _import(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_the_plugin_is_an_entry_point_and_the_link_is_in_provider_info():
    info = get_provider_info()
    assert "plugins" not in info  # see get_provider_info's docstring: it would load twice
    (entry,) = [ep for ep in entry_points(group="airflow.plugins") if ep.name == "dp_budget"]
    plugin_class = entry.load()
    assert issubclass(plugin_class, AirflowPlugin) and plugin_class.name == "dp_budget"
    assert [_import(name) for name in info["extra-links"]] == [DPBudgetAccountLink]
    assert any(
        isinstance(link, DPBudgetAccountLink) for link in DPReleaseOperator.operator_extra_links
    )


def test_plugin_mounts_the_app_and_a_browse_view():
    from dp_budget_provider.plugins.dp_budget import DPBudgetPlugin, app

    (mounted,) = DPBudgetPlugin.fastapi_apps
    assert mounted["app"] is app and mounted["url_prefix"] == "/dp-budget" and mounted["name"]
    (view,) = DPBudgetPlugin.external_views
    assert view["destination"] == "nav" and view["category"] == "browse"
    assert view["url_route"] == "dp-budget" and view["href"] == "/dp-budget/accounts"


@pytest.mark.parametrize("lazy", ["True", "False"])
def test_airflow_loads_the_plugin_once_whatever_the_discovery_mode(airflow_db, lazy):
    env = {**os.environ, "AIRFLOW__CORE__LAZY_DISCOVER_PROVIDERS": lazy}
    result = subprocess.run(
        [str(Path(sys.executable).with_name("airflow")), "plugins", "--output", "json"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=120,
    )
    listed = [p for p in json.loads(result.stdout) if p["name"] == "dp_budget"]
    assert len(listed) == 1
    assert listed[0]["fastapi_apps"][0]["url_prefix"] == "/dp-budget"
    assert listed[0]["external_views"][0]["url_route"] == "dp-budget"
    assert "already registered" not in result.stdout + result.stderr


def test_the_link_opens_the_release_its_receipt_names(monkeypatch):
    assert links.RECEIPT_XCOM_KEY == RECEIPT_XCOM_KEY
    receipt = {"reservation_id": "0b5c/1 x", "keys": 1, "epsilon": 0.1}
    monkeypatch.setattr(links, "_read_receipt", lambda ti_key: receipt)
    link = DPBudgetAccountLink()
    # The Airflow UI's page of the plugin (/plugin/<url_route>), its iframe on the release.
    assert link.get_link(None, ti_key=None) == (
        "/plugin/dp-budget/dp-budget/release?reservation=0b5c%2F1+x"
    )
    # Under a base URL with a path both the UI route and the framed page carry it.
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "https://airflow.example.com/base/")
    assert link.get_link(None, ti_key=None) == (
        "https://airflow.example.com/base/plugin/dp-budget/base/dp-budget/release"
        "?reservation=0b5c%2F1+x"
    )


def test_without_a_receipt_the_link_lists_the_tasks_accounts(monkeypatch):
    monkeypatch.setattr(links, "_read_receipt", lambda ti_key: None)

    class Task:
        tenant, query_type = " ACME", "heatmap"

    assert DPBudgetAccountLink().get_link(Task(), ti_key=None) == (
        "/plugin/dp-budget/dp-budget/accounts?tenant=acme&query_type=heatmap"
    )


def test_the_ledger_queries_import_neither_airflow_nor_fastapi():
    code = (
        "import sys, dp_budget_provider.ledger.views.queries\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('airflow', 'fastapi'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _load_example(name: str):
    """The example DAG, copied into the session's dags folder (dag.test() needs it there)."""
    return load_dag((ROOT / "dags" / f"{name}.py").read_text())


def _link_xcom(dag_run, task_id: str) -> str:
    value = stored_xcom(dag_run, task_id, DPBudgetAccountLink().xcom_key)
    assert value is not None, "the task runner stored no link"
    return value


def test_a_real_dag_run_fills_the_ui_and_links_its_task(
    airflow_db, sqlite_url, monkeypatch, admin_token
):
    """example_dp_heatmap under dag.test(): 50 accounts in the API, the task's link opens one."""
    from fastapi.testclient import TestClient

    from dp_budget_provider.plugins.app import create_app

    # The task creates the ledger: not pinned.
    ledger_connection(monkeypatch, sqlite_url, chain_key_secret=CHAIN_KEY, admin_public_key=None)
    monkeypatch.setenv("AIRFLOW__DP_BUDGET__ALLOW_UNPINNED", "True")  # (a development ledger)
    # dag.test() runs the tasks in this process over the last complete Monday-to-Monday
    # week (the run's data interval): the ledger's clock is pinned inside it, where that
    # week may still be charged whatever the weekday.
    ledger_time_in(monkeypatch, this_week(datetime.now(timezone.utc) - timedelta(days=7)))
    dag = _load_example("example_dp_heatmap")
    # Two releases of the week: the second asks for a fresh one (else it is handed the first).
    runs = [dag.test(run_conf={"tenant": "acme", "refresh": fresh}) for fresh in (False, True)]
    assert [task_states(run) for run in runs] == [
        {"register_cohort": "success", "release_heatmap": "success"}
    ] * 2
    ledger = PrivacyBudgetLedger(url=sqlite_url, chain_key=CHAIN_KEY)
    try:
        with TestClient(create_app(lambda: ledger)) as client:
            client.headers["Authorization"] = f"Bearer {admin_token}"
            accounts = client.get("/api/accounts").json()
            assert accounts["total"] == 50
            assert {a["releases"] for a in accounts["accounts"]} == {2}
            url = _link_xcom(runs[-1], "release_heatmap")
            parts = urlsplit(url)
            # The link opens the release: its mechanism, windows and the accounts it held
            # (the cohort's one spend class), each linking to its page.
            assert parts.path == "/plugin/dp-budget/dp-budget/release"  # the UI's framed page
            release = client.get("/api/release?" + parts.query).json()
            assert release["reservation"]["state"] == "committed"
            assert release["reservation"]["subjects"] == 50
            assert release["reservation"]["attempt_id"].startswith(
                f"example_dp_heatmap/release_heatmap/{runs[-1].run_id}/"
            )
            assert release["total"] == len(release["accounts"]) == 1
            held = release["accounts"][0]
            assert held["tenant"] == "acme" and held["window"] in release["windows"]
            page = client.get("/release?" + parts.query)
            assert page.status_code == 200 and "50 subjects" in page.text
            assert "/account?tenant=acme&amp;subject=" in page.text
            assert client.get("/release?reservation=nope").status_code == 404
            account = accounts["accounts"][0]
            key = {name: account[name] for name in ("tenant", "subject", "query_type", "window")}
            query = "&".join(f"{name}={value}" for name, value in key.items())
            page = client.get("/account?" + query)
            assert page.status_code == 200
            assert "release_heatmap" in page.text and "spend-chart" in page.text
            parts = urlsplit("?" + query)
            detail = client.get("/api/account?" + parts.query).json()
            assert detail["account"]["tenant"] == "acme"
            assert detail["series"]["events"] == 2
            history = client.get("/api/account/history?" + parts.query).json()
            attempts = {e["attempt_id"].rsplit("/", 1)[0] for e in history["entries"]}
            assert {f"example_dp_heatmap/release_heatmap/{r.run_id}/-1/1" for r in runs} == (
                attempts
            )
    finally:
        ledger.close()
