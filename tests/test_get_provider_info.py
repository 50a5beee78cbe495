"""Provider registration: the metadata validates against Airflow's schema and Airflow finds it."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import airflow
import jsonschema
import pytest

from dp_budget_provider.get_provider_info import get_provider_info

pytestmark = pytest.mark.heavy  # long: xdist starts it first (tests/conftest.py)


def test_provider_info_validates_against_airflows_schema():
    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    jsonschema.validate(get_provider_info(), schema)


def test_every_registered_module_and_class_imports():
    info = get_provider_info()
    for section in ("hooks", "operators", "sensors", "triggers"):
        for entry in info[section]:
            for module in entry["python-modules"]:
                importlib.import_module(module)
    for item in info["connection-types"]:
        module, _, name = item["hook-class-name"].rpartition(".")
        assert getattr(importlib.import_module(module), name).conn_type == item["connection-type"]
    for decorator in info["task-decorators"]:
        module, _, name = decorator["class-name"].rpartition(".")
        assert callable(getattr(importlib.import_module(module), name))
    for scheme in info["asset-uris"]:
        for path in (scheme["handler"], scheme["to_openlineage_converter"]):
            module, _, name = path.rpartition(".")
            assert callable(getattr(importlib.import_module(module), name))


def test_entry_point_is_installed():
    found = [
        ep
        for ep in entry_points(group="apache_airflow_provider")
        if ep.value.startswith("dp_budget_provider")
    ]
    assert [ep.load()()["package-name"] for ep in found] == ["dp-budget-provider"]


def _airflow(*args: str) -> str:
    airflow_cli = Path(sys.executable).with_name("airflow")
    result = subprocess.run(
        [str(airflow_cli), *args], capture_output=True, text=True, env=os.environ, check=True
    )
    return result.stdout


def test_airflow_lists_the_provider_and_its_connection_type(airflow_db):
    assert "dp-budget-provider" in _airflow("providers", "list")
    hooks = json.loads(_airflow("providers", "hooks", "--output", "json"))
    names = {h.get("connection_type"): h.get("hook_name") for h in hooks}
    assert names["dpbudget"] == "DP Budget Ledger"
    assert names["dp_budget"].startswith("DP Budget Ledger (old type dp_budget")  # still served
    widgets = json.loads(_airflow("providers", "widgets", "--output", "json"))
    fields = {w["connection_parameter_name"] for w in widgets}
    assert {"extra__dpbudget__url", "extra__dpbudget__chain_key_secret"} <= fields
    configs = _airflow("providers", "configs")
    assert "dp_budget" in configs and "default_cap_epsilon" in configs


def test_the_api_servers_admin_key_file_is_declared_and_unset_by_default():
    option = get_provider_info()["config"]["dp_budget"]["options"]["admin_key_file"]
    assert option["default"] is None and "never on a worker" in option["description"]
