"""dp_budget_window_reset: the ledger's maintenance DAG.

Reaps reservations abandoned by dead workers (charging them: they may have touched the
data; ``dp_budget_reap`` does so every few minutes, this run makes sure none is left
before the reset), seals budget windows past their grace period and drops their accounts
(never an open one, never the history), then verifies the ledger against its last
checkpoint and, if it passes, checkpoints its chain heads outside the ledger database
(the Airflow Variable ``dp_budget_checkpoint.<conn id>``, or ``[dp_budget]
checkpoint_path``). A failed verify quarantines the ledger: no release runs until an
operator clears it with ``dp-budget quarantine clear --reason ...``. The verify runs even
when the reap or the reset failed: a row edited so that they fail must not also stop the
check that finds the edit (the run still fails). Running it twice in a row changes nothing
but the checkpoint's time.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from airflow.sdk import TriggerRule, dag, task
from airflow.sdk.exceptions import AirflowFailException

from dp_budget_provider.hooks.dp_budget import DPBudgetHook
from dp_budget_provider.hooks.maintenance import reset_schedule

CONN_ID = DPBudgetHook.default_conn_name


@dag(
    dag_id="dp_budget_window_reset",
    schedule=reset_schedule(),
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,
    # Left paused (Airflow's default for new DAGs), crashed attempts would never be charged
    # and windows never sealed: maintenance starts as soon as the DAG is deployed.
    is_paused_upon_creation=False,
    tags=["dp-budget", "maintenance"],
    doc_md=__doc__,
)
def dp_budget_window_reset() -> None:
    @task
    def reap_abandoned_reservations() -> int:
        return DPBudgetHook(CONN_ID).reap()

    @task
    def reset_closed_windows() -> list[str]:
        return DPBudgetHook(CONN_ID).get_ledger().reset_closed()

    @task(trigger_rule=TriggerRule.ALL_DONE)
    def verify_and_checkpoint() -> dict[str, Any]:
        report = DPBudgetHook(CONN_ID).verify()
        if not report.ok:
            # The problems name accounts of every DAG: they are the administrator's
            # (`dp-budget quarantine show`, the history), not this task log's.
            raise AirflowFailException(
                f"ledger failed verification ({len(report.problems)} problem(s)) and is "
                "quarantined; an administrator reads them with `dp-budget quarantine show`"
            )
        return {"entries": report.entries, "accounts": report.accounts, "keyed": report.keyed}

    @task
    def log_summary(reaped: int, resets: list[str], verified: dict[str, Any]) -> str:
        summary = (
            f"reaped {reaped} abandoned reservation(s); reset {len(resets)} closed window(s); "
            "ledger verified and checkpointed: "
            f"{verified['entries']} entries, {verified['accounts']} live account(s), "
            f"history {'keyed' if verified['keyed'] else 'NOT keyed'}"
        )
        print(summary)
        return summary

    reaped = reap_abandoned_reservations()
    resets = reset_closed_windows()
    verified = verify_and_checkpoint()
    reaped >> resets >> verified
    log_summary(reaped, resets, verified)


window_reset_dag = dp_budget_window_reset()
