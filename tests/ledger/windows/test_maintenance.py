"""The ledger knows when reap, reset and verify last ran, and which are overdue."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import BudgetCap, PrivacyBudgetLedger, key_for
from dp_budget_provider.ledger.audit.checkpoints import CheckpointFile, verify_and_checkpoint
from dp_budget_provider.ledger.storage import clock
from dp_budget_provider.ledger.windows.maintenance import DEFAULT_INTERVALS, overdue_warning
from tests.ledger_time import ledger_time_at

UTC = timezone.utc
CAP = BudgetCap(3.0, 1e-5)
NOISE = GaussianMechanism(4.0)
# ISO week 45 of 2026 runs from Monday 2 November to Sunday 8 November; the default
# policy's grace period of 3 days after it ends on Thursday 12 November at midnight.
WEEK = "2026-w45"
IN_WEEK = datetime(2026, 11, 6, 12, tzinfo=UTC)
GRACE_ENDS = datetime(2026, 11, 12, tzinfo=UTC)


def frozen_at(monkeypatch, moment: datetime) -> None:
    """The ledger's clock stops at ``moment`` (stamps the test can name exactly)."""
    monkeypatch.setattr(clock, "now", lambda: moment)


def test_the_ledger_knows_when_each_job_last_ran_and_which_is_overdue(
    ledger_url, monkeypatch, tmp_path
):
    created = datetime(2026, 11, 2, 9, tzinfo=UTC)
    frozen_at(monkeypatch, created)
    ledger = PrivacyBudgetLedger(CAP, url=ledger_url, actor="maintenance-test")
    try:
        fresh = ledger.maintenance()
        assert [(s.job, s.last_run, s.overdue) for s in fresh] == [
            ("reap", None, False),
            ("reset", None, False),
            ("verify", None, False),
        ]
        assert fresh[0].interval == DEFAULT_INTERVALS["reap"] == timedelta(minutes=5)

        # Never run: overdue once the ledger is older than twice the interval.
        frozen_at(monkeypatch, created + timedelta(minutes=11))
        assert [s.job for s in ledger.maintenance() if s.overdue] == ["reap"]
        overdue = [s for s in ledger.maintenance() if s.overdue]
        assert overdue[0].due_by == "2026-11-02T09:10:00.000000Z"
        assert overdue_warning(overdue) == (
            "ledger maintenance overdue: reap has never run (expected every 0:05:00, overdue "
            "since 2026-11-02T09:10:00.000000Z): is the dp_budget_reap DAG paused or failing?"
        )

        # Each job records its run by the ledger's clock.
        assert ledger.reap() == []
        assert ledger.reset_closed() == {}
        report = verify_and_checkpoint(ledger, CheckpointFile(tmp_path / "checkpoints.jsonl"))
        assert report.ok
        ran = {s.job: s for s in ledger.maintenance()}
        assert not any(s.overdue for s in ran.values())
        assert {s.last_run for s in ran.values()} == {"2026-11-02T09:11:00.000000Z"}
        engine = sa.create_engine(ledger_url)
        with engine.connect() as connection:
            actors = set(connection.execute(sa.text("SELECT actor FROM dp_maintenance")).scalars())
        engine.dispose()
        assert actors == {"maintenance-test"}

        # A verify alone (the UI's) is not the maintenance job: only a checkpointed one is.
        frozen_at(monkeypatch, created + timedelta(days=2, minutes=12))
        ledger.verify()
        ledger.reap()
        late = [s for s in ledger.maintenance() if s.overdue]
        assert [(s.job, s.due_by) for s in late] == [
            ("reset", "2026-11-04T09:11:00.000000Z"),
            ("verify", "2026-11-04T09:11:00.000000Z"),
        ]
        assert "reset has not run since 2026-11-02T09:11:00.000000Z" in overdue_warning(late)
        assert "dp_budget_window_reset DAG" in overdue_warning(late)

        # The deployment's schedules decide: an hourly reset is overdue sooner, a weekly later.
        hourly = {"reset": timedelta(hours=1), "verify": timedelta(hours=1)}
        assert [s.job for s in ledger.maintenance(hourly) if s.overdue] == ["reset", "verify"]
        weekly = {"reset": timedelta(days=7), "verify": timedelta(days=7)}
        assert [s.job for s in ledger.maintenance(weekly) if s.overdue] == []
        with pytest.raises(ValueError, match="no maintenance job 'vacuum'"):
            ledger.maintenance({"vacuum": timedelta(hours=1)})
        with pytest.raises(ValueError, match="positive timedelta"):
            ledger.maintenance({"reap": timedelta(0)})
    finally:
        ledger.close()


def test_a_reset_held_up_by_open_reservations_is_no_run(ledger_url, monkeypatch):
    ledger_time_at(monkeypatch, IN_WEEK)
    ledger = PrivacyBudgetLedger(CAP, url=ledger_url, lease=timedelta(days=1))
    try:
        ledger.reserve([key_for("alice", "heatmap", WEEK)], NOISE, attempt="still running")
        ledger_time_at(monkeypatch, GRACE_ENDS + timedelta(hours=1))
        with pytest.raises(Exception, match="open reservations"):
            ledger.reset_closed()
        assert {s.job: s.last_run for s in ledger.maintenance()}["reset"] is None
    finally:
        ledger.close()
