"""BudgetWindowTrigger: sleep in the triggerer until a budget window opens.

A DateTimeTrigger that also carries the sensor's deadline in its event, so the sensor
resumes knowing when to give up, however the deferral's own kwargs travel (``dag.test()``
replaces them with the event).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

from airflow.providers.standard.triggers.temporal import DateTimeTrigger
from airflow.triggers.base import TriggerEvent


class BudgetWindowTrigger(DateTimeTrigger):
    """Fires at ``moment`` (the next window start) with ``{"window_start", "deadline"}``."""

    def __init__(self, moment: datetime, deadline: datetime) -> None:
        super().__init__(moment=moment)
        if deadline.tzinfo is None:
            raise ValueError("deadline must be timezone-aware")
        self.deadline = deadline

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {"moment": self.moment, "deadline": self.deadline},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        async for _ in super().run():
            break
        yield TriggerEvent(
            {"window_start": self.moment.isoformat(), "deadline": self.deadline.isoformat()}
        )
