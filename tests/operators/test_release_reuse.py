"""Re-runs under dag.test() on a real Airflow metadata database (ledger on SQLite and
PostgreSQL): a run of the same logical date is handed the stored release and charged
nothing, the history records the reuse, ``refresh=True`` charges, and another mechanism,
cohort or interval is a new release."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

import pytest

from dp_budget_provider.ledger import key_for
from tests.airflow.dag_runner import WEEKLY_DAG, load_dag, stored_xcom, task_states

pytestmark = pytest.mark.heavy  # long: xdist starts it first (tests/conftest.py)

WINDOW = "2026-w28"
LEDGER_WINDOWS = (WINDOW, "2026-w29")
SUBJECTS = [f"rider-{i:03d}" for i in range(30)]
# A weekly run's data interval ends at its logical date: this run reads 2026-w28.
MONDAY = datetime(2026, 7, 13, tzinfo=timezone.utc)

RELEASE_DAG = (
    WEEKLY_DAG.replace("{", "{{").replace("}", "}}")
    + """
import pathlib
from dp_budget_provider.operators.release import DPReleaseOperator

def counts():
    reads = pathlib.Path({reads!r})
    reads.write_text(reads.read_text() + "x" if reads.exists() else "x")
    return [12, 30, 8]

with weekly() as dag:
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
        query_type="ride_counts",
        refresh={refresh!r},
    )
"""
)


class Releases:
    """One DAG (its source fixed but for the mechanism, cohort and refresh), run with
    dag.test() at chosen logical dates; counts how often its callable read the data."""

    def __init__(self, tmp_path) -> None:
        self.reads = tmp_path / "reads"
        self.dag_id = f"reruns_{uuid.uuid4().hex[:10]}"

    def run(self, *, at=MONDAY, mechanism=None, subjects=SUBJECTS, refresh=False):
        source = RELEASE_DAG.format(
            reads=str(self.reads),
            mechanism=mechanism or {"kind": "laplace", "epsilon0": 0.25},
            subjects=subjects,
            refresh=refresh,
        )
        dag = load_dag(source, name=self.dag_id)  # one DAG, its file rewritten
        dag_run = dag.test(logical_date=at)
        assert task_states(dag_run)["release"] == "success"
        return (
            dag_run,
            stored_xcom(dag_run, "release", "return_value"),
            stored_xcom(dag_run, "release", "dp_budget_receipt"),
        )

    @property
    def read_count(self) -> int:
        return len(self.reads.read_text()) if self.reads.exists() else 0


def spent(ledger) -> float:
    return ledger.epsilon_of(key_for(SUBJECTS[1], "ride_counts", WINDOW))  # in every cohort


def test_a_rerun_of_the_same_date_is_handed_the_stored_release(ledger, tmp_path):
    releases = Releases(tmp_path)
    _, value, receipt = releases.run()
    once = spent(ledger)
    assert once > 0 and receipt["reused"] is False and receipt["stored"] is True
    assert receipt["windows"] == [WINDOW]
    second_run, again, reused = releases.run()
    assert again == value
    assert reused["reused"] is True
    assert reused["reservation_id"] == receipt["reservation_id"]
    assert releases.read_count == 1  # the data was read once
    assert spent(ledger) == once
    reuses = [e for e in ledger.history() if e["action"] == "reuse"]
    assert len(reuses) == 1
    assert reuses[0]["payload"]["reservation"] == receipt["reservation_id"]
    assert reuses[0]["payload"]["attempt_id"].startswith(f"{second_run.dag_id}/release/")
    assert ledger.verify(quarantine=False).ok


def test_refresh_makes_a_new_release_charged_in_full(ledger, tmp_path):
    releases = Releases(tmp_path)
    _, _, first = releases.run()
    once = spent(ledger)
    _, _, fresh = releases.run(refresh=True)
    assert fresh["reused"] is False and fresh["reservation_id"] != first["reservation_id"]
    assert releases.read_count == 2
    assert spent(ledger) > once
    _, _, served = releases.run()
    assert served["reused"] is True and served["reservation_id"] == fresh["reservation_id"]


@pytest.mark.parametrize(
    "change",
    [
        {"mechanism": {"kind": "laplace", "epsilon0": 0.2}},
        {"subjects": SUBJECTS[1:]},
        {"at": datetime(2026, 7, 20, tzinfo=timezone.utc)},
    ],
    ids=["mechanism", "cohort", "interval"],
)
def test_a_changed_mechanism_cohort_or_interval_is_charged(ledger, tmp_path, change):
    releases = Releases(tmp_path)
    releases.run()
    once = spent(ledger)
    _, _, receipt = releases.run(**change)
    assert receipt["reused"] is False and releases.read_count == 2
    if "at" in change:  # the next week's data: its own window
        assert ledger.epsilon_of(key_for(SUBJECTS[1], "ride_counts", "2026-w29")) > 0
    else:
        assert spent(ledger) > once
