"""Example: a weekly release whose outlet Asset carries its privacy guarantee.

The release names an outlet Asset; when it succeeds, Airflow records an asset event whose
extra holds the release's guarantee under ``"dp_guarantee"``: epsilon charged at the
ledger's delta, the mechanism, the noise's standard deviation, the windows, the cohort's
size as a decade and the reservation id (never a subject). ``example_dp_guarantee_consumer``
is scheduled on the Asset and reads it. The ``dp-release://`` scheme is the provider's:
OpenLineage names the Asset ``dp-release://acme`` / ``weekly-visit-counts``.
"""

from __future__ import annotations

from datetime import datetime, timezone

from airflow.sdk import DAG, Asset
from airflow.timetables.interval import CronDataIntervalTimetable

from dp_budget_provider.operators.release import DPReleaseOperator

WEEKLY_VISIT_COUNTS = Asset(name="weekly_visit_counts", uri="dp-release://acme/weekly-visit-counts")
RESIDENTS = [f"resident-{i:03d}" for i in range(50)]


def visit_counts() -> list[int]:
    """Residents with no, one or several visits this week (synthetic, already clipped)."""
    visits = [i % 5 for i in range(len(RESIDENTS))]
    return [visits.count(0), visits.count(1), sum(1 for v in visits if v > 1)]


with DAG(
    dag_id="example_dp_guarantee_producer",
    schedule=CronDataIntervalTimetable("0 0 * * 1", timezone="UTC"),  # each run: last week
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    tags=["dp-budget", "example"],
    doc_md=__doc__,
) as dag:
    DPReleaseOperator(
        task_id="release_visit_counts",
        python_callable=visit_counts,
        mechanism={"kind": "laplace", "epsilon0": 0.5},
        l1_sensitivity=1.0,  # a resident moves one count by one
        granularity=1,
        cells=3,
        integer=True,
        bounds=(0, 100),
        subjects=RESIDENTS,
        query_type="visit_counts",
        tenant="acme",
        outlets=[WEEKLY_VISIT_COUNTS],
    )


if __name__ == "__main__":
    dag.test()
