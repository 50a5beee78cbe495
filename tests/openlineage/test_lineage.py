"""A release's lineage: the OpenLineage events the OpenLineage provider emits for a real
release task (dag.test() in a process of its own, events written by the file transport),
and the release working, asset event included, where the provider is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import jsonschema
import pytest
from airflow.providers.openlineage.utils.utils import translate_airflow_asset
from airflow.sdk import Asset
from openlineage.client.serde import Serde

from dp_budget_provider.ledger import (
    BudgetCap,
    CohortSizeBucket,
    PrivacyBudgetLedger,
    ReleaseGuarantee,
    key_for,
)
from dp_budget_provider.openlineage.facets import (
    FACET_KEY,
    PRODUCER,
    SCHEMA_ID,
    SCHEMA_URL,
    DpBudgetReleaseGuaranteeRunFacet,
    facet_schema,
)
from tests.admin import ADMIN
from tests.airflow.dag_runner import metadata_copy
from tests.ledger_time import this_week
from tests.openlineage.absent import without_openlineage

pytestmark = pytest.mark.heavy  # long: xdist starts it first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
OUTLET_URI = "dp-release://acme/visit-counts"
SOURCE_URI = "postgres://warehouse:5432/clinic/public/visits"
SUBJECTS = [f"resident-{i:03d}" for i in range(20)]

RELEASE_DAG = """
from datetime import datetime, timezone
from airflow.sdk import DAG, Asset
from dp_budget_provider.operators.release import DPReleaseOperator

def counts():
    {body}

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
    DPReleaseOperator(
        task_id="release",
        python_callable=counts,
        mechanism={{"kind": "laplace", "epsilon0": 0.5}},
        l1_sensitivity=1.0,
        granularity=1,
        cells=3,
        integer=True,
        bounds=(0, 100),
        subjects={subjects!r},
        query_type="visit_counts",
        window={window!r},
        inlets=[Asset(name="visits", uri={source!r})],
        outlets=[Asset(name="visit_counts_{dag_id}", uri={outlet!r} + "-{dag_id}")],
    )
"""

# Runs the DAGs in a fresh process (its listeners, OpenLineage's included, are loaded
# there under this test's configuration), and prints what each run left behind.
RUNNER = """
import json, sys
{prelude}
sys.path.insert(0, {root!r})
from tests.airflow.dag_runner import asset_events, load_dag, stored_xcom, task_states
report = {{}}
for dag_id, source in {sources!r}.items():
    dag = load_dag(source)
    run = dag.test()
    report[dag_id] = {{
        "states": task_states(run),
        "receipt": stored_xcom(run, "release", "dp_budget_receipt"),
        "events": asset_events({outlet!r} + "-" + dag_id),
    }}
report["modules"] = sorted(
    m for m in sys.modules
    if m.split(".")[0] == "openlineage" or m.startswith("airflow.providers.openlineage")
)
{epilogue}
print("REPORT " + json.dumps(report))
"""

# Where OpenLineage is absent, the operator's lineage method is where it would be needed.
CALL_LINEAGE = """
try:
    dag.get_task("release").get_openlineage_facets_on_complete(None)
    report["lineage"] = "returned"
except ModuleNotFoundError as error:
    report["lineage"] = error.name
"""


def release_source(dag_id: str, body: str) -> str:
    return textwrap.dedent(
        RELEASE_DAG.format(
            dag_id=dag_id,
            body=body,
            subjects=SUBJECTS,
            window=this_week(),  # the process charges on the real clock
            source=SOURCE_URI,
            outlet=OUTLET_URI,
        )
    )


def run_in_process(tmp_path, airflow_db, sources, *, env=None, prelude="", epilogue=""):
    """Run ``sources`` (dag id -> DAG source) with dag.test() in a new process on a copy
    of the session's metadata database and a fresh SQLite ledger; its report."""
    home = metadata_copy(airflow_db, tmp_path / "airflow-home")
    (home / "dags").mkdir()
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    PrivacyBudgetLedger(BudgetCap(3.0, 1e-5), url=url, admin=ADMIN).close()  # its admin's
    ledger = {"url": url, "admin_public_key": ADMIN.public.text}
    connection = json.dumps({"conn_type": "dpbudget", "extra": ledger})
    script = RUNNER.format(
        prelude=prelude, root=str(ROOT), sources=sources, outlet=OUTLET_URI, epilogue=epilogue
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={
            **os.environ,
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
            "AIRFLOW_CONN_DP_BUDGET_DEFAULT": connection,
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    (tmp_path / "process.log").write_text(result.stdout + result.stderr)
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, f"the process reported nothing:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return json.loads(lines[-1].removeprefix("REPORT ")), url


def guarantee() -> ReleaseGuarantee:
    return ReleaseGuarantee(
        reservation_id="r-1",
        mechanism={"kind": "pure_dp", "epsilon0": 0.5},
        noise="lattice",
        noise_std=2.8,
        epsilon=0.5,
        delta=1e-5,
        epsilon_after=None,
        cap_epsilon=3.0,
        windows=("2026-w28",),
        cohort_size=CohortSizeBucket(10, 100),
    )


def test_the_facet_has_the_guarantees_fields_and_its_shipped_schema():
    facet = DpBudgetReleaseGuaranteeRunFacet.of(guarantee())
    fields = {f.name for f in attrs.fields(DpBudgetReleaseGuaranteeRunFacet)}
    assert fields - {"_producer", "_schemaURL"} == set(guarantee().as_dict())
    document = json.loads(Serde.to_json(facet))
    assert document["_schemaURL"] == SCHEMA_URL and document["_producer"] == PRODUCER
    schema = facet_schema()
    assert schema["$id"] == SCHEMA_ID  # the schema file moves with the package's version
    guarantee_schema = {**schema["$defs"]["ReleaseGuarantee"], "$defs": schema["$defs"]}
    jsonschema.validate(document, guarantee_schema)
    # Every field, epsilon_after aside: OpenLineage leaves out a null (a gate not exposed).
    properties = schema["$defs"]["ReleaseGuarantee"]["properties"]
    assert set(properties) == set(guarantee().as_dict())
    assert set(schema["$defs"]["ReleaseGuarantee"]["required"]) == set(properties) - {
        "epsilon_after"
    }
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**document, "cohort_size": 42}, guarantee_schema)


def test_a_dp_release_asset_is_an_openlineage_dataset():
    dataset = translate_airflow_asset(Asset(name="v", uri=OUTLET_URI), None)
    assert (dataset.namespace, dataset.name) == ("dp-release://acme", "visit-counts")


def json_objects(text: str) -> list[dict]:
    """The JSON objects written one after another to a file. The file transport writes an
    event and its newline separately, and its threads (``execute_in_thread``) append at
    once, so two events may share a line: each object is whole, a newline may be late."""
    decoder, objects, at = json.JSONDecoder(), [], 0
    while (at := len(text) - len(text[at:].lstrip())) < len(text):
        found, at = decoder.raw_decode(text, at)
        objects.append(found)
    return objects


def test_the_openlineage_provider_emits_the_guarantee_of_a_release(tmp_path, airflow_db):
    events_file = tmp_path / "openlineage.jsonl"
    transport = {"type": "file", "log_file_path": str(events_file), "append": True}
    sources = {
        "lineage_released": release_source("lineage_released", "return [12, 30, 8]"),
        "lineage_failed": release_source("lineage_failed", "raise RuntimeError('after reading')"),
    }
    report, _ledger = run_in_process(
        tmp_path,
        airflow_db,
        sources,
        env={
            "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(transport),
            "AIRFLOW__OPENLINEAGE__EXECUTE_IN_THREAD": "True",  # no fork of the test process
            "AIRFLOW__OPENLINEAGE__NAMESPACE": "dp-tests",
        },
    )
    assert report["lineage_released"]["states"] == {"release": "success"}
    assert report["lineage_failed"]["states"] == {"release": "failed"}
    events = json_objects(events_file.read_text())
    by_job = {
        (event["job"]["name"], event["eventType"]): event
        for event in events
        if event["job"]["name"].endswith(".release")
    }

    assert ("lineage_released.release", "COMPLETE") in by_job, sorted(by_job)
    complete = by_job["lineage_released.release", "COMPLETE"]
    (asset_event,) = report["lineage_released"]["events"]
    facet = complete["run"]["facets"][FACET_KEY]
    # The facet states the guarantee the asset event carries, field for field (OpenLineage
    # leaves out the null epsilon_after of a gate that exposes no budget state).
    published = asset_event["extra"]["dp_guarantee"]
    assert published["epsilon_after"] is None
    assert {k: v for k, v in facet.items() if not k.startswith("_")} == {
        k: v for k, v in published.items() if v is not None
    }
    assert facet["reservation_id"] == report["lineage_released"]["receipt"]["reservation_id"]
    assert facet["_schemaURL"] == SCHEMA_URL
    assert [(d["namespace"], d["name"]) for d in complete["inputs"]] == [
        ("postgres://warehouse:5432", "clinic.public.visits")
    ]
    assert [(d["namespace"], d["name"]) for d in complete["outputs"]] == [
        ("dp-release://acme", "visit-counts-lineage_released")
    ]
    assert not any(subject in json.dumps(complete) for subject in SUBJECTS)

    # A failure after the data was read is charged: its FAIL event states that charge.
    failed = by_job["lineage_failed.release", "FAIL"]
    receipt = report["lineage_failed"]["receipt"]
    assert failed["run"]["facets"][FACET_KEY]["epsilon"] == receipt["epsilon"] > 0
    assert report["lineage_failed"]["events"] == []  # and no asset event was emitted


def test_a_release_works_and_emits_its_asset_event_without_openlineage(tmp_path, airflow_db):
    sources = {"no_lineage": release_source("no_lineage", "return [12, 30, 8]")}
    absent = without_openlineage(tmp_path / "site-packages")
    report, ledger_url = run_in_process(
        tmp_path, airflow_db, sources, prelude=absent, epilogue=CALL_LINEAGE
    )
    assert report["modules"] == []  # nothing of OpenLineage was (or could be) imported
    assert report["lineage"] == "airflow.providers.openlineage"  # needed there only
    assert report["no_lineage"]["states"] == {"release": "success"}
    (event,) = report["no_lineage"]["events"]
    assert (
        event["extra"]["dp_guarantee"]["reservation_id"]
        == (report["no_lineage"]["receipt"]["reservation_id"])
    )
    ledger = PrivacyBudgetLedger(url=ledger_url)
    try:
        charged = ledger.epsilon_of(key_for(SUBJECTS[0], "visit_counts", this_week()))
    finally:
        ledger.close()
    assert charged == pytest.approx(report["no_lineage"]["receipt"]["epsilon"])
