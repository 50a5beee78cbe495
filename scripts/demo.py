"""The README's main job: example DAGs gated by the embedded SQLite ledger, run with dag.test().

1. ``example_dp_heatmap`` runs repeatedly: each run debits every subject's account, the
   third passes the warning fraction, the fourth leaves no room for another (the accounts
   read EXHAUSTED), and the fifth is refused (no release, nothing written).
2. ``example_dp_budget_gated`` then finds this window exhausted: its BudgetSensor defers
   to the start of the next window (the demo tenant uses 60-second windows so you can
   watch it), re-checks, and the release happens in the new window.
3. ``dp-budget status`` shows the ledger.

Everything lives under ``.demo/`` in the repository (Airflow home, metadata DB, ledger).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOME = ROOT / ".demo" / "airflow"
WINDOW_SECONDS = 60
TENANT = "demo"
# What the demo says after a release, by the account's state (the ledger's rule, README).
_STATE_NOTES = {
    "WARNING": "  <-- WARNING: past 80% of the cap",
    "EXHAUSTED": "  <-- EXHAUSTED: the next heatmap release no longer fits",
}


def prepare_airflow_home() -> None:
    """A fresh Airflow home whose dags folder holds the example DAGs, metadata DB migrated."""
    shutil.rmtree(HOME.parent, ignore_errors=True)
    (HOME / "dags").mkdir(parents=True)
    for name in ("example_dp_heatmap.py", "example_dp_budget_gated.py"):
        shutil.copy(ROOT / "dags" / name, HOME / "dags" / name)
    os.environ.update(
        AIRFLOW_HOME=str(HOME),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__DAGS_FOLDER=str(HOME / "dags"),
        AIRFLOW__LOGGING__LOGGING_LEVEL="WARNING",
    )
    os.environ.pop("AIRFLOW_CONN_DP_BUDGET_DEFAULT", None)  # the embedded default, on purpose
    say(f"Airflow home {HOME}: migrating the metadata database")
    airflow = Path(sys.executable).with_name("airflow")
    subprocess.run([str(airflow), "db", "migrate"], check=True, capture_output=True)


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def main() -> None:
    prepare_airflow_home()
    # Imported only now: Airflow reads AIRFLOW_HOME at import time.
    from dp_budget_provider.hooks.dp_budget import DPBudgetHook
    from dp_budget_provider.ledger import Policy, WindowCalendar

    logging.getLogger("airflow").setLevel(logging.WARNING)
    ledger = DPBudgetHook().get_ledger()
    say(f"ledger: {ledger.url} (embedded SQLite default, delta={ledger.delta})")
    calendar = WindowCalendar("fixed", WINDOW_SECONDS)
    ledger.set_policy(
        Policy(
            2.0,
            tenant=TENANT,
            calendar=calendar,
            min_window=timedelta(seconds=WINDOW_SECONDS),
            compliance_clause="demo only: eps <= 2 per subject per 60-second window",
        )
    )
    say(f"policy for tenant {TENANT!r}: cap eps=2.0, warn at 80%, {WINDOW_SECONDS}-second windows")

    now = datetime.now(timezone.utc)
    left = (calendar.next_window_start(now) - now).total_seconds()
    if left < 40:
        say(f"waiting {left:.0f}s for a fresh window so the runs below share one")
        time.sleep(left + 0.5)

    heatmap = load("example_dp_heatmap")
    for number in range(1, 6):
        state = str(heatmap.test(run_conf={"tenant": TENANT}).state)
        account = max(ledger.accounts(tenant=TENANT), key=lambda a: a.epsilon)
        if state == "success":
            flag = _STATE_NOTES.get(account.state, "")
            say(
                f"heatmap run {number}: released over 50 subjects; each now at eps "
                f"{account.epsilon:.4f} of {account.cap_epsilon} in window "
                f"{account.key.window}{flag}"
            )
        else:
            say(
                f"heatmap run {number}: REFUSED (task failed with DPBudgetExhaustedError): no "
                f"release, ledger untouched at eps {account.epsilon:.4f} ({account.state})"
            )

    gated = load("example_dp_budget_gated")
    wake = calendar.next_window_start(datetime.now(timezone.utc))
    say(
        "gated run: this window is exhausted, so BudgetSensor defers (no worker slot) until "
        f"the next window opens at {wake:%H:%M:%S} UTC"
    )
    started = time.monotonic()
    state = str(gated.test(run_conf={"tenant": TENANT}).state)
    latest = sorted(ledger.accounts(tenant=TENANT), key=lambda a: a.key.window)[-1]
    say(
        f"gated run: {state} after {time.monotonic() - started:.0f}s; released in window "
        f"{latest.key.window} at eps {latest.epsilon:.4f}"
    )
    print(flush=True)
    dp_budget = str(Path(sys.executable).with_name("dp-budget"))
    subprocess.run([dp_budget, "--url", ledger.url, "status", "--limit", "6"], check=True)


def load(dag_id: str):  # noqa: ANN201 - returns an Airflow DAG
    """Import an example DAG from the demo dags folder."""
    import importlib.util

    path = HOME / "dags" / f"{dag_id}.py"
    spec = importlib.util.spec_from_file_location(dag_id, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.dag


if __name__ == "__main__":
    main()
