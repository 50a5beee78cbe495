"""dp_budget_reap: charge the reservations of dead workers, every few minutes.

A release task renews its reservation's lease (``[dp_budget] lease_seconds``, default
300) while its query runs. When its worker dies, the renewals stop; this DAG's next run
after the lease has run out charges the reservation (it may have touched the data: it
is charged, never refunded), as it does any reservation open longer than ``[dp_budget]
reap_after``. So a crashed attempt is charged at most ``lease_seconds`` plus one
``reap_schedule`` interval after its last renewal: 10 minutes with the defaults. Until
then its cost stays held (every check counts it). Reaping reads the open reservations
only, so running it often costs little; runs never overlap.
"""

from __future__ import annotations

from datetime import datetime, timezone

from airflow.sdk import dag, task

from dp_budget_provider.hooks.dp_budget import DPBudgetHook
from dp_budget_provider.hooks.maintenance import reap_schedule

CONN_ID = DPBudgetHook.default_conn_name


@dag(
    dag_id="dp_budget_reap",
    schedule=reap_schedule(),
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,
    # Left paused (Airflow's default for new DAGs), crashed attempts would never be charged
    # and windows never sealed: maintenance starts as soon as the DAG is deployed.
    is_paused_upon_creation=False,
    tags=["dp-budget", "maintenance"],
    doc_md=__doc__,
)
def dp_budget_reap() -> None:
    @task
    def reap_abandoned_reservations() -> int:
        reaped = DPBudgetHook(CONN_ID).reap()
        print(f"reaped {reaped} abandoned reservation(s) (charged, never refunded)")
        return reaped

    reap_abandoned_reservations()


reap_dag = dp_budget_reap()
