"""Run a DAG written as source text through ``dag.test()`` on the real metadata database."""

from __future__ import annotations

import importlib.util
import json
import os
import sqlite3
import textwrap
import uuid
from pathlib import Path
from typing import Any

from airflow.sdk import DAG

from tests.admin import ADMIN

# DAG source text: `weekly()` makes a DAG scheduled on Mondays, each run reading the week
# before (its data interval); a test appends `with weekly() as dag:` and its tasks.
WEEKLY_DAG = """
from datetime import datetime, timezone
from airflow.sdk import DAG
from airflow.timetables.interval import CronDataIntervalTimetable

def weekly():
    return DAG(
        "DAG_ID",
        schedule=CronDataIntervalTimetable("0 0 * * 1", timezone="UTC"),
        start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
        catchup=False,
    )
"""


def aggregate_dag(raw: str = "", **arguments: Any) -> str:
    """The source of a weekly DAG whose one task, ``visits``, is a ``DPAggregateOperator``
    with ``arguments`` (written as their reprs) and ``raw`` (arguments as source text, a
    mechanism spec say)."""
    written = "".join(f"        {name}={value!r},\n" for name, value in arguments.items())
    extra = f"        {raw},\n" if raw else ""
    return (
        WEEKLY_DAG
        + "\nfrom dp_budget_provider.operators.aggregate import DPAggregateOperator\n\n"
        + "with weekly() as dag:\n"
        + '    DPAggregateOperator(\n        task_id="visits",\n'
        + written
        + extra
        + "    )\n"
    )


def ledger_connection(monkeypatch: Any, url: str, **extra: Any) -> None:
    """Point the default ledger connection at ``url`` (the documented env-var contract),
    pinning the tests' administrator key (``tests.admin``) unless ``extra`` says otherwise
    (``chain_key_secret=...`` keys it, ``admin_public_key=None`` pins nothing)."""
    extra = {"url": url, "admin_public_key": ADMIN.public.text, **extra}
    value = json.dumps({"conn_type": "dpbudget", "extra": {k: v for k, v in extra.items() if v}})
    monkeypatch.setenv("AIRFLOW_CONN_DP_BUDGET_DEFAULT", value)


def load_dag(source: str, name: str | None = None) -> Any:
    """Write ``source`` into the dags folder and import it; returns the DAG it defines,
    whose id is ``name`` (default: new for each call; a name given again rewrites that
    DAG's file, as an author editing one DAG does)."""
    name = name or f"test_dag_{uuid.uuid4().hex[:10]}"
    path = Path(os.environ["AIRFLOW__CORE__DAGS_FOLDER"]) / f"{name}.py"
    path.write_text(textwrap.dedent(source).replace("DAG_ID", name))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    dags = [value for value in vars(module).values() if isinstance(value, DAG)]
    assert len(dags) == 1, f"expected one DAG in the source, found {len(dags)}"
    return dags[0]


def task_states(dag_run: Any) -> dict[str, str]:
    """task_id -> final state of a finished run."""
    return {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}


def stored_xcom(dag_run: Any, task_id: str, key: str) -> Any:
    """An XCom of a finished run as stored in the metadata database (None if absent)."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        value = session.scalar(
            select(XComModel.value).where(
                XComModel.dag_id == dag_run.dag_id,
                XComModel.run_id == dag_run.run_id,
                XComModel.task_id == task_id,
                XComModel.key == key,
            )
        )
    if isinstance(value, str):  # stored as JSON text by some backends, decoded by others
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def asset_events(uri: str) -> list[dict[str, Any]]:
    """The asset events of the Asset ``uri`` as stored in the metadata database, oldest
    first: each one's source (dag, task, run) and extra."""
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.execute(
            select(AssetEvent)
            .join(AssetModel, AssetEvent.asset_id == AssetModel.id)
            .where(AssetModel.uri == uri)
            .order_by(AssetEvent.id)
        ).scalars()
        return [
            {
                "dag_id": event.source_dag_id,
                "task_id": event.source_task_id,
                "run_id": event.source_run_id,
                "extra": event.extra,
            }
            for event in rows
        ]


def metadata_copy(airflow_home: Path, home: Path) -> Path:
    """A private copy of the session's migrated metadata database in a new AIRFLOW_HOME
    ``home`` (SQLite's backup, safe while the session holds it open): a process of its own
    runs DAGs there without migrating one."""
    home.mkdir()
    source = sqlite3.connect(airflow_home / "airflow.db")
    target = sqlite3.connect(home / "airflow.db")
    with target:
        source.backup(target)
    source.close()
    target.close()
    return home
