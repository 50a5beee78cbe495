"""When the ledger's maintenance last ran, and whether it is overdue.

Three jobs keep a ledger sound as time passes: ``reap`` charges the reservations of dead
workers, ``reset`` seals the windows past their grace period, ``verify`` proves the
tables from the history and checkpoints it. Left undone (a maintenance DAG paused or
failing), crashed attempts hold budget uncharged, windows are never sealed and tampering
goes unnoticed, all silently. So each job records when it last completed (one row of
``dp_maintenance`` per job, stamped by the ledger's clock in a write transaction), and a
job that has not completed within :data:`OVERDUE_AFTER` times its interval is *overdue*:
``dp-budget status``, the UI and the release tasks warn about it. A job that never ran is
overdue once the ledger is that much older than its creation.

The interval of each job is its maintenance DAG's schedule; :data:`DEFAULT_INTERVALS`
are those of the shipped DAGs' default schedules, for readers without Airflow's
configuration. The rows are a health signal, not an audited fact: an insider who edits
them can silence the warning, never pass a cap, unseal a window or hide a failed verify
(the quarantine says that).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, select
from sqlalchemy.dialects import postgresql, sqlite

from dp_budget_provider.ledger.storage import clock
from dp_budget_provider.ledger.storage.schema import LedgerConfig, MaintenanceRun
from dp_budget_provider.ledger.storage.transactions import LedgerDatabase
from dp_budget_provider.ledger.windows.calendar import NEVER

REAP, RESET, VERIFY = "reap", "reset", "verify"
JOBS = (REAP, RESET, VERIFY)
# The DAG that runs each job (what a warning tells an administrator to look at).
DAG_OF = {
    REAP: "dp_budget_reap",
    RESET: "dp_budget_window_reset",
    VERIFY: "dp_budget_window_reset",
}
# The intervals of the shipped DAGs' default schedules (every 5 minutes; daily).
DEFAULT_INTERVALS = {
    REAP: timedelta(minutes=5),
    RESET: timedelta(days=1),
    VERIFY: timedelta(days=1),
}
# A job is overdue when it has not run within this many of its intervals: one missed or
# slow run is no alarm, two in a row are.
OVERDUE_AFTER = 2


@dataclass(frozen=True)
class MaintenanceState:
    """One job: its interval, when it last ran (None: never) and whether it is overdue.

    ``due_by`` is the moment it becomes (or became) overdue: its last run, or the
    ledger's creation when it never ran, plus :data:`OVERDUE_AFTER` intervals.
    """

    job: str
    interval: timedelta
    last_run: str | None
    due_by: str
    overdue: bool

    @property
    def problem(self) -> str:
        """What is late: the job, since when it has not run, and where to look."""
        ran = "has never run" if self.last_run is None else f"has not run since {self.last_run}"
        return (
            f"{self.job} {ran} (expected every {self.interval}, overdue since {self.due_by}): "
            f"is the {DAG_OF[self.job]} DAG paused or failing?"
        )

    def as_record(self) -> dict[str, Any]:
        """Plain JSON values (``status --json``, the UI's API)."""
        return {
            "job": self.job,
            "interval_seconds": self.interval.total_seconds(),
            "last_run": self.last_run,
            "due_by": self.due_by,
            "overdue": self.overdue,
        }


def job_intervals(reap: timedelta, reset: timedelta) -> dict[str, timedelta]:
    """Each job's interval when the reap runs every ``reap`` and the reset DAG (which
    also verifies) every ``reset``."""
    return {REAP: reap, RESET: reset, VERIFY: reset}


def overdue_warning(overdue: Sequence[MaintenanceState]) -> str:
    """One line about every overdue job (the CLI's, the UI's and the tasks' warning)."""
    return "ledger maintenance overdue: " + "; ".join(state.problem for state in overdue)


def check_intervals(intervals: Mapping[str, timedelta] | None) -> dict[str, timedelta]:
    """:data:`DEFAULT_INTERVALS` updated with ``intervals`` (each a positive timedelta of a
    known job)."""
    checked = dict(DEFAULT_INTERVALS)
    for job, interval in (intervals or {}).items():
        if job not in DEFAULT_INTERVALS:
            raise ValueError(f"no maintenance job {job!r}: the jobs are {', '.join(JOBS)}")
        if not isinstance(interval, timedelta) or interval <= timedelta(0):
            raise ValueError(
                f"the interval of {job} must be a positive timedelta, got {interval!r}"
            )
        checked[job] = interval
    return checked


def record(connection: Connection, job: str, at: str, actor: str) -> None:
    """Record in ``connection``'s write transaction that ``job`` completed at ``at``."""
    if job not in DEFAULT_INTERVALS:
        raise ValueError(f"no maintenance job {job!r}")
    dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
    statement = dialect.insert(MaintenanceRun).values(job=job, last_run_at=at, actor=actor)
    connection.execute(
        statement.on_conflict_do_update(
            index_elements=[MaintenanceRun.job],
            set_={"last_run_at": statement.excluded.last_run_at, "actor": actor},
        )
    )


def ran(database: LedgerDatabase, job: str, actor: str) -> str:
    """Record that ``job`` completed now, by the ledger's clock, in a small write
    transaction of its own (the job's work may span many); returns the stamp."""
    with database.write() as connection:
        at = clock.stamp(clock.now())
        record(connection, job, at, actor)
    return at


def states(
    connection: Connection, intervals: Mapping[str, timedelta], now: datetime
) -> list[MaintenanceState]:
    """Every job's state at ``now``, in :data:`JOBS` order."""
    created = connection.execute(select(LedgerConfig.created_at)).scalar_one()
    last = dict(connection.execute(select(MaintenanceRun.job, MaintenanceRun.last_run_at)).all())
    found = []
    for job in JOBS:
        since = last.get(job)
        try:
            due = _parse(since or created) + OVERDUE_AFTER * intervals[job]
        except OverflowError:  # due after the last moment a datetime holds: never
            due = NEVER
        found.append(MaintenanceState(job, intervals[job], since, clock.stamp(due), now >= due))
    return found


def _parse(stamp: str) -> datetime:
    """A stored stamp (``YYYY-MM-DDTHH:MM:SS.ffffffZ``) as an aware datetime."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))
