"""Example: a weekly Gaussian heatmap released over many subjects, gated by the budget ledger.

Each subject contributes at most one (clipped) visit per week, so the heatmap of counts
has L2 sensitivity 1 under add/remove-one-subject adjacency. The counts are integers, so
the release declares granularity 1: exact discrete Gaussian noise, integer outputs. It
declares its shape too: ``cells=16`` (the 4 x 4 grid) and ``integer=True`` (an integer
answer, which snapping to the lattice leaves unchanged, so the charge is that of
sensitivity 1; a float heatmap would pay for snapping each cell). An answer with more
cells, or of a float dtype, would fail before noise, charged. Every subject in the data is
charged: an upstream task reads the week's cohort from the data and registers it in the
ledger, and the release charges each of its subjects through the cohort's handle (one
release over many subjects; the ids never travel through XCom, and the same population
next week costs one row per spend class, whatever its size).
"""

from __future__ import annotations

from datetime import datetime, timezone

import numpy as np
from airflow.sdk import DAG, task
from airflow.timetables.interval import CronDataIntervalTimetable

from dp_budget_provider.hooks.dp_budget import DPBudgetHook
from dp_budget_provider.operators.release import DPReleaseOperator


def weekly_visits() -> tuple[np.ndarray, np.ndarray]:
    """This week's visits, one clipped visit per subject: (subject ids, grid cells).

    Synthetic and fixed (the *data*, not the noise); in production, a query on the
    week's table.
    """
    rng = np.random.default_rng(20260101)
    subjects = np.array([f"user-{i:03d}" for i in range(50)])
    return subjects, rng.integers(0, 16, size=subjects.size)


def weekly_heatmap() -> list[list[int]]:
    """Exact counts of the week's visits on a 4 x 4 grid."""
    _, cells = weekly_visits()
    return np.bincount(cells, minlength=16).reshape(4, 4).tolist()


with DAG(
    dag_id="example_dp_heatmap",
    schedule=CronDataIntervalTimetable("0 0 * * 1", timezone="UTC"),  # each run: last week
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    # window: empty charges the windows of the run's data interval (last week); a label
    # charges that one window of the tenant's calendar (the demo's 60-second windows).
    # refresh: a re-run is handed the heatmap already released for its week, charging
    # nothing; trigger with {"refresh": true} to release it again, charged in full.
    params={"tenant": "acme", "window": "", "refresh": False},
    tags=["dp-budget", "example"],
    doc_md=__doc__,
) as dag:

    @task
    def register_cohort(params: dict | None = None) -> dict:
        """Who is in this week's data (read when the run starts, never written into the
        DAG file), registered once: the release gets a handle naming them by content."""
        subjects, _ = weekly_visits()
        ledger = DPBudgetHook().get_ledger()
        return ledger.cohort(subjects, tenant=(params or {})["tenant"]).as_dict()

    DPReleaseOperator(
        task_id="release_heatmap",
        python_callable=weekly_heatmap,
        mechanism={"kind": "gaussian", "noise_multiplier": 4.0},
        l2_sensitivity=1.0,
        granularity=1,
        cells=16,
        integer=True,
        subjects=register_cohort(),
        query_type="heatmap",
        tenant="{{ params.tenant }}",
        window="{{ params.window }}",
        refresh="{{ params.refresh }}",
    )


if __name__ == "__main__":
    dag.test()
