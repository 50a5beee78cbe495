"""The real `airflow api-server` with a keyed ledger, as the README deploys it, without a
browser: what the connections API shows of the chain key, and the plugin's pages."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.plugins.airflow_server import CHAIN_KEY, airflow_api_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with airflow_api_server(tmp_path_factory.mktemp("airflow-api")) as running:
        yield running


def test_the_connections_api_and_cli_never_show_the_chain_key(server):
    """Anyone who reads connections could forge the history with the key: the API (GET
    /api/v2/connections/dp_budget_default) and `airflow connections add` show it masked,
    while the UI, keyed with it, serves its pages (it was a 503 on a keyed ledger)."""
    headers = {"Authorization": f"Bearer {server.token()}"}
    shown = httpx.get(f"{server.url}/api/v2/connections/dp_budget_default", headers=headers)
    assert shown.status_code == 200
    assert json.loads(shown.json()["extra"])["chain_key_secret"] == "***"
    assert CHAIN_KEY not in shown.text and CHAIN_KEY not in server.added
    page = httpx.get(f"{server.url}/dp-budget/accounts", headers=headers)
    assert page.status_code == 200 and "user-007" in page.text
    assert "history keyed" in page.text  # the ledger the tasks keyed, opened with its key
    audit = httpx.get(f"{server.url}/dp-budget/api/verification", headers=headers).json()
    assert audit["ok"], audit
