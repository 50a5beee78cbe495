"""Example: a release gated by BudgetSensor, waiting (deferred) for the next budget window.

When this week's budget cannot fit the release, the sensor defers to the start of the
next window without holding a worker slot, re-checks there, and hands the window label
that has room to the release task. Both take the cohort from an upstream task's output.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from airflow.sdk import DAG, task

from dp_budget_provider.operators.release import DPReleaseOperator
from dp_budget_provider.sensors.budget import BudgetSensor

MECHANISM = {"kind": "gaussian", "noise_multiplier": 4.0}


def mean_dwell_minutes() -> float:
    """Synthetic exact answer: a clipped per-subject mean (sensitivity 1 after clipping)."""
    return 17.0


with DAG(
    dag_id="example_dp_budget_gated",
    schedule="@daily",
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    params={"tenant": "acme"},
    tags=["dp-budget", "example"],
    doc_md=__doc__,
) as dag:

    @task
    def list_cohort() -> list[str]:
        """The subjects in today's data (synthetic; in production a query on the data)."""
        return [f"user-{i:03d}" for i in range(50)]

    cohort = list_cohort()
    wait_for_budget = BudgetSensor(
        task_id="wait_for_budget",
        mechanism=MECHANISM,
        subjects=cohort,
        query_type="heatmap",
        tenant="{{ params.tenant }}",
        deferrable=True,
        timeout=timedelta(days=8),
    )
    release = DPReleaseOperator(
        task_id="release_mean_dwell",
        python_callable=mean_dwell_minutes,
        mechanism=MECHANISM,
        l2_sensitivity=1.0,
        subjects=cohort,
        query_type="heatmap",
        tenant="{{ params.tenant }}",
        window=wait_for_budget.output,
    )
    wait_for_budget >> release


if __name__ == "__main__":
    dag.test()
