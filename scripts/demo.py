"""The README's main job: example DAGs gated by the embedded SQLite ledger, run with dag.test().

1. ``example_dp_heatmap`` runs five times over one window's data: the first release debits
   every subject's account; the second run is a re-run of the same release and is handed
   the heatmap already released, charging nothing; the third and fourth ask for a fresh
   release (``refresh``) and are charged, after which no further release fits (the
   accounts read EXHAUSTED); the fifth is refused (no release, nothing written), shown as
   one line.
2. ``example_dp_budget_gated`` then finds this window exhausted: its BudgetSensor defers
   to the start of the next window (the demo tenant uses 60-second windows so you can
   watch it), the trigger fires at that start, the sensor re-checks, and the release
   happens in the new window. Each run's Airflow log goes to ``.demo/logs/``.
3. ``example_dp_visits_heatmap`` releases a heatmap of visits that the release reads
   itself (``DPAggregateOperator``) from a SQLite table of visits, ``.demo/visits.db``,
   named by the Airflow connection ``visits_db``: the contribution bounds run in SQLite's
   SQL, and the persons of the bounded rows are the subjects charged.
4. ``dp-budget classes`` shows the ledger by spend class (the 50 subjects: one row per
   window; the visits' persons: one more).

Everything lives under ``.demo/`` in the repository (Airflow home, metadata DB, ledger).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported at run time only after AIRFLOW_HOME is set (main)
    from dp_budget_provider.aggregation import BoundedQuery
    from dp_budget_provider.ledger import WindowCalendar

ROOT = Path(__file__).resolve().parents[1]
HOME = ROOT / ".demo" / "airflow"
LOGS = ROOT / ".demo" / "logs"
VISITS_DB = ROOT / ".demo" / "visits.db"
ADMIN_KEY = ROOT / ".demo" / "admin.key"
WINDOW_SECONDS = 60
TENANT = "demo"
# The gated run's log lines the demo shows: the sensor deferring, the trigger firing.
_LIFECYCLE = {
    "cannot fit the release": "sensor",
    "Pausing task as DEFERRED": "task",
    "trigger starting": "trigger",
    "yielding event": "trigger fired",
    "fits the release": "sensor",
}
# What the demo says after a release, by the account's state (the ledger's rule, docs/ledger.md).
_STATE_NOTES = {
    "WARNING": "  <-- WARNING: past 80% of the cap",
    "EXHAUSTED": "  <-- EXHAUSTED: the next heatmap release no longer fits",
}


def prepare_airflow_home() -> None:
    """A fresh Airflow home whose dags folder holds the example DAGs, metadata DB migrated."""
    shutil.rmtree(HOME.parent, ignore_errors=True)
    (HOME / "dags").mkdir(parents=True)
    for name in (
        "example_dp_heatmap.py",
        "example_dp_budget_gated.py",
        "example_dp_visits_heatmap.py",
    ):
        shutil.copy(ROOT / "dags" / name, HOME / "dags" / name)
    os.environ.update(
        AIRFLOW_HOME=str(HOME),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__DAGS_FOLDER=str(HOME / "dags"),
        AIRFLOW__LOGGING__LOGGING_LEVEL="INFO",  # into .demo/logs, not the terminal
    )
    os.environ.pop("AIRFLOW_CONN_DP_BUDGET_DEFAULT", None)  # the embedded default, on purpose
    say(f"Airflow home {HOME}: migrating the metadata database")
    airflow = Path(sys.executable).with_name("airflow")
    subprocess.run([str(airflow), "db", "migrate"], check=True, capture_output=True)


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


@contextlib.contextmanager
def task_log(name: str) -> Iterator[Path]:
    """Everything a DAG run prints (Airflow's task logs, a refused task's traceback) goes
    to ``.demo/logs/<name>.log`` instead of the terminal; the demo says what happened."""
    LOGS.mkdir(parents=True, exist_ok=True)
    path = LOGS / f"{name}.log"
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with path.open("w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield path
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for descriptor in saved:
                os.close(descriptor)


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT))


def main() -> None:
    prepare_airflow_home()
    # Imported only now: Airflow reads AIRFLOW_HOME at import time.
    from dp_budget_provider.hooks.dp_budget import default_cap, embedded_ledger_url
    from dp_budget_provider.ledger import AdminKey, Policy, PrivacyBudgetLedger, WindowCalendar
    from dp_budget_provider.ledger.windows.calendar import display_window

    # The administrator creates the embedded ledger with a key no task holds, which signs
    # the policy; the workers pin its public half ([dp_budget] admin_public_key), so no task
    # can raise the cap (nor open an unpinned ledger).
    admin = AdminKey.generate()
    admin.write(ADMIN_KEY)
    ledger = PrivacyBudgetLedger(
        default_cap(), url=embedded_ledger_url(), admin=admin, actor="demo-admin"
    )
    os.environ["AIRFLOW__DP_BUDGET__ADMIN_PUBLIC_KEY"] = admin.public.text
    say(
        f"ledger: {ledger.url} (embedded SQLite default, delta={ledger.delta}; its history is "
        "not keyed, as a demo's may be: see docs/ledger.md for the chain key); administrator "
        f"key {shown(ADMIN_KEY)}"
    )
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
    # The runs read this 60-second window's data (a weekly schedule's interval would span
    # ten thousand of them).
    window = calendar.window_of(datetime.now(timezone.utc))
    # Run 2 re-runs run 1's release: it is handed the heatmap already released, charging
    # nothing. Runs 3 to 5 ask for a fresh release of the same data (refresh), charged.
    before = 0.0
    for number in range(1, 6):
        conf = {"tenant": TENANT, "window": window, "refresh": number >= 3}
        with task_log(f"heatmap-run-{number}") as log:
            state = str(heatmap.test(run_conf=conf).state)
        account = max(ledger.accounts(tenant=TENANT), key=lambda a: a.epsilon)
        if state == "success" and account.epsilon == before:
            say(
                f"heatmap run {number}: a re-run of the same release: handed the heatmap "
                f"already released, charged nothing (eps stays {account.epsilon:.4f})"
            )
        elif state == "success":
            flag = _STATE_NOTES.get(account.state, "")
            fresh = " (refresh: a new release of the same data)" if conf["refresh"] else ""
            say(
                f"heatmap run {number}: released over 50 subjects{fresh}; each now at eps "
                f"{account.epsilon:.4f} of {account.cap_epsilon} in window "
                f"{display_window(account.key.window)}{flag}"
            )
            before = account.epsilon
        else:
            text = log.read_text()
            refusal = next((line for line in text.splitlines() if "no release:" in line), "")
            # Every reference has the same length; a copy that Airflow's secrets masker
            # shortened with "***" in one log line is complete in another (the traceback).
            why = admin.open(max(re.findall(r"dpb-ref-1\.[A-Za-z0-9_-]+", text), key=len))
            say(
                f"heatmap run {number}: REFUSED, no release and the ledger untouched at eps "
                f"{account.epsilon:.4f} ({account.state}); the task is told only:\n         "
                f"{refusal.split('no release: ', 1)[-1][:110]}...\n         the administrator "
                f"opens the reference (`dp-budget refusal`): {why['refusal']}, the release "
                f"would bring eps to {why['epsilon']:.4f} > cap {why['cap_epsilon']}\n"
                f"         (task log: {shown(log)})"
            )

    gated = load("example_dp_budget_gated")
    wake = calendar.next_window_start(datetime.now(timezone.utc))
    say(
        "gated run: this window is exhausted, so BudgetSensor defers (no worker slot) until "
        f"the next window opens at {wake:%H:%M:%S} UTC"
    )
    started = time.monotonic()
    with task_log("gated-run") as log:
        state = str(gated.test(run_conf={"tenant": TENANT}).state)
    for line in log.read_text().splitlines():
        event = _LIFECYCLE.get(next((m for m in _LIFECYCLE if m in line), ""))
        if event:
            moment = line[11:19]  # the log line's UTC time of day
            say(f"  {moment} {event}: {line.split(']', 1)[-1].split('[', 1)[0].strip()}")
    latest = sorted(ledger.accounts(tenant=TENANT), key=lambda a: a.key.window)[-1]
    say(
        f"gated run: {state} after {time.monotonic() - started:.0f}s; released in window "
        f"{display_window(latest.key.window)} at eps {latest.epsilon:.4f} (task log: {shown(log)})"
    )
    release_visits_heatmap(calendar)
    print(flush=True)
    dp_budget = str(Path(sys.executable).with_name("dp-budget"))
    say(
        "the ledger by spend class (one row per window for the 50 subjects, one for the "
        "visits' persons; `status` lists each subject):"
    )
    subprocess.run([dp_budget, "--url", ledger.url, "classes"], check=True)


def write_visits(start: datetime, end: datetime) -> int:
    """A SQLite table of synthetic visits in ``VISITS_DB``: 50 people, each 4 to 10 visits
    between ``start`` and ``end``, mostly to cells near the grid's centre, some anywhere.
    Timestamps are UTC ISO 8601 text, as the data interval is bound on SQLite
    (docs/operators.md). Returns the number of visits."""
    import random
    import sqlite3

    rng = random.Random(20260101)
    span = (end - start).total_seconds()
    rows = []
    for person in range(50):
        haunts = [(rng.choice([1, 1, 2]), rng.choice([1, 2, 2])) for _ in range(2)]
        for _ in range(rng.randint(4, 10)):
            row, col = rng.choice(haunts) if rng.random() < 0.7 else divmod(rng.randrange(16), 4)
            moment = start + timedelta(seconds=int(rng.random() * span))
            rows.append((f"person-{person:02d}", row, col, moment.isoformat(" ")))
    VISITS_DB.unlink(missing_ok=True)
    with contextlib.closing(sqlite3.connect(VISITS_DB)) as connection, connection:
        connection.execute(
            "CREATE TABLE visits (person TEXT NOT NULL, cell_row INTEGER NOT NULL, "
            "cell_col INTEGER NOT NULL, visited_at TEXT NOT NULL)"
        )
        connection.executemany("INSERT INTO visits VALUES (?, ?, ?, ?)", rows)
    return len(rows)


def bounded_counts(query: BoundedQuery, start: datetime, end: datetime) -> list[int]:
    """The exact counts the release added noise to: the package's own bounded read of the
    SQLite table (never released; the demo shows them for comparison)."""
    import sqlalchemy as sa

    from dp_budget_provider.aggregation import BoundedRows

    engine = sa.create_engine(f"sqlite:///{VISITS_DB}")
    interval = {
        "data_interval_start": start.isoformat(" "),
        "data_interval_end": end.isoformat(" "),
    }
    try:
        with engine.connect() as connection:
            rows = BoundedRows(connection, query, interval)
            for _unit in rows:  # read to the end: the totals are added up as it goes
                pass
            return [cell.rows for cell in rows.totals]
    finally:
        engine.dispose()


def release_visits_heatmap(calendar: WindowCalendar) -> None:
    """Step 3: the visits heatmap, read by the release from a SQLite source."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    from dp_budget_provider.ledger.windows.calendar import display_window

    dag = load("example_dp_visits_heatmap")
    # The data the run reads: its data interval, as dag.test() infers it (last week).
    interval = dag.timetable.infer_manual_data_interval(run_after=datetime.now(timezone.utc))
    visits = write_visits(interval.start, interval.end)
    os.environ["AIRFLOW_CONN_VISITS_DB"] = json.dumps(
        {"conn_type": "sqlite", "host": str(VISITS_DB)}
    )
    say(
        f"visits heatmap: {visits} synthetic visits of 50 people on a 4x4 grid in "
        f"{interval.start:%Y-%m-%d} .. {interval.end:%Y-%m-%d} (the run's data interval), "
        f"in SQLite file {shown(VISITS_DB)}, Airflow connection visits_db; the release reads "
        "them itself, at most 2 visits in each of at most 4 cells per person"
    )
    conf = {"tenant": TENANT, "window": calendar.window_of(datetime.now(timezone.utc))}
    with task_log("visits-heatmap") as log:
        dag_run = dag.test(run_conf=conf)
    task = "release_visits_heatmap"
    if str(dag_run.state) != "success":
        raise SystemExit(f"the visits heatmap run failed: see {shown(log)}")
    with create_session() as session:
        xcom = {
            row.key: XComModel.deserialize_value(row)
            for row in session.execute(
                XComModel.get_many(run_id=dag_run.run_id, dag_ids=dag.dag_id, task_ids=task)
            ).scalars()
        }
    released, receipt = xcom["return_value"]["values"], xcom["dp_budget_receipt"]
    exact = bounded_counts(dag.get_task(task).bounded, interval.start, interval.end)
    say("visits heatmap released (noisy counts)      exact bounded counts (never released)")
    for row in range(4):
        cells = slice(4 * row, 4 * row + 4)
        print(
            "         "
            + "".join(f"{value:6d}" for value in released[cells])
            + "          "
            + "".join(f"{value:6d}" for value in exact[cells]),
            flush=True,
        )
    say(
        f"visits heatmap receipt: {receipt['keys']} persons charged eps "
        f"{receipt['epsilon']:.4f} each (cap {receipt['cap_epsilon']}) in window "
        f"{', '.join(display_window(w) for w in receipt['windows'])}: the noise is sized by the "
        f"bounds, never by the data (task log: {shown(log)})"
    )


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
