"""The maintenance DAGs' schedules, and the warning when their jobs are overdue.

The ledger records when reap, reset and verify last ran
(:mod:`dp_budget_provider.ledger.windows.maintenance`); how often they should run is Airflow's
configuration: ``[dp_budget] reap_schedule`` (the ``dp_budget_reap`` DAG) and
``[dp_budget] reset_schedule`` (``dp_budget_window_reset``, which also verifies). The
DAGs and the warnings read the same options, so changing a schedule moves its warning
with it. A job is overdue when it has not run within twice its schedule's longest gap
between two runs (a weekday schedule's weekend gap counts, so weekends raise no alarm).
"""

from __future__ import annotations

import functools
import logging
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow.sdk.configuration import conf
from croniter import croniter

from dp_budget_provider.ledger import (
    MaintenanceState,
    ReleaseGate,
    job_intervals,
    overdue_warning,
)

# The shipped DAGs' schedules unless configured: every 5 minutes, daily.
REAP_SCHEDULE = "*/5 * * * *"
RESET_SCHEDULE = "@daily"
# A schedule's gaps are sampled over this many runs or this long, whichever ends first.
_SAMPLED_RUNS = 200
_SAMPLED_SPAN = timedelta(days=400)
_SAMPLE_FROM = datetime(2026, 1, 1, tzinfo=timezone.utc)


def reap_schedule() -> str:
    """The ``dp_budget_reap`` DAG's cron schedule: ``[dp_budget] reap_schedule``."""
    return conf.get("dp_budget", "reap_schedule", fallback=REAP_SCHEDULE) or REAP_SCHEDULE


def reset_schedule() -> str:
    """The ``dp_budget_window_reset`` DAG's schedule: ``[dp_budget] reset_schedule``."""
    return conf.get("dp_budget", "reset_schedule", fallback=RESET_SCHEDULE) or RESET_SCHEDULE


@functools.lru_cache(maxsize=32)
def longest_gap(schedule: str) -> timedelta:
    """The longest time between two consecutive runs of a cron ``schedule`` (a cron
    expression or preset such as ``@daily``); ValueError for anything else."""
    if not isinstance(schedule, str) or not croniter.is_valid(schedule):
        raise ValueError(f"{schedule!r} is not a cron schedule")
    runs = croniter(schedule, _SAMPLE_FROM)
    first = previous = runs.get_next(datetime)
    gap = timedelta(0)
    for _ in range(_SAMPLED_RUNS):
        following = runs.get_next(datetime)
        gap = max(gap, following - previous)
        previous = following
        if previous - first > _SAMPLED_SPAN:
            break
    return gap


def maintenance_intervals() -> dict[str, timedelta]:
    """Each maintenance job's interval under this deployment's schedules; ValueError
    naming the option whose value is no cron schedule."""
    gaps = {}
    for option, schedule in (
        ("reap_schedule", reap_schedule()),
        ("reset_schedule", reset_schedule()),
    ):
        try:
            gaps[option] = longest_gap(schedule)
        except ValueError as error:
            raise ValueError(f"[dp_budget] {option}: {error}") from None
    return job_intervals(reap=gaps["reap_schedule"], reset=gaps["reset_schedule"])


def overdue_maintenance(gate: ReleaseGate) -> list[MaintenanceState]:
    """The maintenance jobs of ``gate``'s ledger that are overdue under this deployment's
    schedules."""
    return [state for state in gate.maintenance(maintenance_intervals()) if state.overdue]


def warn_overdue_maintenance(
    gate: ReleaseGate, log: logging.Logger | logging.LoggerAdapter[Any]
) -> None:
    """Log one WARNING line if any maintenance job is overdue (which job, since when).

    It names jobs and times only, nothing about any account, so a task may log it. It
    never stops a release: the ledger is as safe to charge with maintenance late (a
    reservation is held until reaped, a window refuses new releases past its grace
    period); what suffers is that crashed attempts stay held and windows unsealed.
    """
    try:
        overdue = overdue_maintenance(gate)
    except ValueError as error:
        log.warning("cannot tell whether the ledger's maintenance is overdue: %s", error)
        return
    if overdue:
        log.warning("%s", overdue_warning(overdue))
