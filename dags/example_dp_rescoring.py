"""Example: re-scoring a snapshot release family as a trajectory, carrying its spend.

When sensitivity scoring re-tiers a subject's data from snapshot to trajectory, the budget
already spent under the snapshot key moves to the trajectory key (never reset: that would
be a free refill an adversary could trigger), and later releases cost more because the
trajectory query has the larger sensitivity: the same noise (sigma = 4) on an L2
sensitivity of 2 is a noise multiplier of 2, four times the zCDP cost of a snapshot release.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from airflow.sdk import DAG, XComArg, task
from airflow.timetables.interval import CronDataIntervalTimetable

from dp_budget_provider.hooks.dp_budget import DPBudgetHook
from dp_budget_provider.ledger import key_for
from dp_budget_provider.operators.release import RECEIPT_XCOM_KEY, DPReleaseOperator

SUBJECT = "subject:c71b"
SIGMA = 4.0  # the noise both releases add
SNAPSHOT_L2 = 1.0
TRAJECTORY_L2 = 2.0

with DAG(
    dag_id="example_dp_rescoring",
    schedule=CronDataIntervalTimetable("0 0 * * 1", timezone="UTC"),  # each run: last week
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    tags=["dp-budget", "example"],
    doc_md=__doc__,
) as dag:
    snapshot = DPReleaseOperator(
        task_id="release_snapshot",
        python_callable=lambda: 42.0,
        mechanism={"kind": "gaussian", "noise_multiplier": SIGMA / SNAPSHOT_L2},
        l2_sensitivity=SNAPSHOT_L2,
        subject=SUBJECT,
        query_type="snapshot",
    )

    @task
    def rescope_to_trajectory(receipt: dict[str, Any]) -> str:
        (window,) = receipt["windows"]
        DPBudgetHook().get_ledger().rescope(
            key_for(SUBJECT, "snapshot", window),
            key_for(SUBJECT, "trajectory", window),
            reason="temporal frequency crossed the snapshot/trajectory boundary",
        )
        return window

    carried = rescope_to_trajectory(XComArg(snapshot, key=RECEIPT_XCOM_KEY))

    trajectory = DPReleaseOperator(
        task_id="release_trajectory",
        python_callable=lambda: 42.0,
        # The snapshot's noise, sigma = 4, on twice its sensitivity: noise multiplier 2.
        mechanism={"kind": "gaussian", "noise_multiplier": SIGMA / TRAJECTORY_L2},
        l2_sensitivity=TRAJECTORY_L2,  # a trajectory statistic moves twice as much per subject
        subject=SUBJECT,
        query_type="trajectory",
    )
    carried >> trajectory


if __name__ == "__main__":
    dag.test()
