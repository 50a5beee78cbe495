"""dp_budget_window_reset: the ledger's maintenance DAG.

Reaps reservations abandoned by dead workers (charging them: they may have touched the
data), drops the accounts of budget windows that have closed (never an open one, never
the history), and verifies the history's hash chain. Idempotent: running it twice in a
row changes nothing the second time.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from airflow.sdk import dag, task
from airflow.sdk.configuration import conf
from airflow.sdk.exceptions import AirflowFailException

from dp_budget_provider.hooks.dp_budget import DPBudgetHook

CONN_ID = DPBudgetHook.default_conn_name


@dag(
    dag_id="dp_budget_window_reset",
    schedule=conf.get("dp_budget", "reset_schedule", fallback="@daily"),
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,
    tags=["dp-budget", "maintenance"],
    doc_md=__doc__,
)
def dp_budget_window_reset() -> None:
    @task
    def reap_abandoned_reservations() -> list[str]:
        reap_after = timedelta(seconds=conf.getint("dp_budget", "reap_after", fallback=86400))
        return DPBudgetHook(CONN_ID).get_ledger().reap(reap_after)

    @task
    def reset_closed_windows() -> dict[str, int]:
        return DPBudgetHook(CONN_ID).get_ledger().reset_closed()

    @task
    def verify_history() -> dict[str, Any]:
        report = DPBudgetHook(CONN_ID).get_ledger().verify()
        if not report.ok:
            raise AirflowFailException(
                "ledger history failed verification: " + "; ".join(report.problems)
            )
        return {"entries": report.entries, "accounts": report.accounts}

    @task
    def log_summary(reaped: list[str], resets: dict[str, int], verified: dict[str, Any]) -> str:
        summary = (
            f"reaped {len(reaped)} abandoned reservation(s); reset {len(resets)} closed window(s) "
            f"({sum(resets.values())} account(s)); history verified: "
            f"{verified['entries']} entries, "
            f"{verified['accounts']} live account(s)"
        )
        print(summary)
        return summary

    reaped = reap_abandoned_reservations()
    resets = reset_closed_windows()
    verified = verify_history()
    reaped >> resets >> verified
    log_summary(reaped, resets, verified)


window_reset_dag = dp_budget_window_reset()
