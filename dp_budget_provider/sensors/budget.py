"""BudgetSensor: hold a DAG until its release fits the budget, if need be in the next window.

In deferrable mode the sensor holds no worker slot while it waits: it defers to the
start of the next budget window (the policy's calendar says when), re-checks there,
and defers again if the release still does not fit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.configuration import conf
from airflow.sdk.exceptions import AirflowFailException, AirflowSensorTimeout, AirflowSkipException

from dp_budget_provider.accounting import Mechanism
from dp_budget_provider.hooks.dp_budget import DPBudgetHook
from dp_budget_provider.hooks.maintenance import warn_overdue_maintenance
from dp_budget_provider.ledger import (
    ReleaseGate,
    ReleaseRefused,
    SubjectSource,
    covered_by,
    display_window,
)
from dp_budget_provider.triggers.budget_window import BudgetWindowTrigger


def utcnow() -> datetime:
    """The sensor's clock (a function of its own so tests can move it)."""
    return datetime.now(timezone.utc)


class BudgetSensor(BaseSensorOperator):
    """Succeeds when ``count`` releases of ``mechanism`` fit on every key; returns the window.

    The window is ``window`` if given, else the current window of the policy calendar at
    check time, so a release refused this week passes once next week opens. The window
    label that has room is the sensor's XCom value, for the release task to use.

    ``subjects`` takes what the operator's does (any collection of ids, an upstream
    task's ``.output``, a callable template field), and the whole cohort is checked in
    one grouped read (:meth:`~dp_budget_provider.ledger.PrivacyBudgetLedger.budget_check`).
    A release the ledger would refuse whatever the budget (a sealed window or re-scoped
    subject, a window that has not begun, a quarantined ledger, no subjects) fails the
    sensor at once: waiting cannot make it fit.

    Passing reserves nothing: the budget stays shared, so several sensors can pass on the
    same headroom and only the releases' own reservations decide which of them runs. A
    sensor that reserved would hold budget for releases that may never come.
    """

    template_fields: Sequence[str] = ("subject", "subjects", "tenant", "query_type", "window")

    def __init__(
        self,
        *,
        mechanism: Mechanism | Mapping[str, Any],
        query_type: str,
        subject: str | None = None,
        subjects: SubjectSource | None = None,
        tenant: str = "default",
        window: str | None = None,
        count: int = 1,
        dp_budget_conn_id: str = DPBudgetHook.default_conn_name,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if (subject is None) == (subjects is None):
            raise ValueError("give exactly one of subject or subjects")
        self.mechanism = (
            mechanism if isinstance(mechanism, Mechanism) else Mechanism.from_spec(mechanism)
        )
        self.query_type = query_type
        self.subject = subject
        self.subjects = subjects
        self.tenant = tenant
        self.window = window
        self.count = count
        self.dp_budget_conn_id = dp_budget_conn_id
        self.deferrable = deferrable

    def _ledger(self) -> ReleaseGate:
        return DPBudgetHook(dp_budget_conn_id=self.dp_budget_conn_id).get_ledger()

    def _window(self, ledger: ReleaseGate, now: datetime) -> str:
        if self.window:
            return self.window
        return ledger.policy_for_scope(self.tenant, self.query_type).calendar.window_of(now)

    def _fits(self, ledger: ReleaseGate, window: str) -> bool:
        """Whether the release would be granted in ``window`` now: the one bit the ledger
        tells a task (nothing about which subject, or how far)."""
        subjects = [self.subject] if self.subject is not None else self.subjects
        try:
            keys = covered_by(subjects, self.query_type, [window], self.tenant)
            alone = ledger.fits_alone(self.tenant, self.query_type, self.mechanism, self.count)
        except ValueError as refusal:
            raise AirflowFailException(f"no release can follow: {refusal}") from None
        if not alone:
            raise AirflowFailException(
                f"{self.count} x {self.mechanism.to_spec()} exceeds the cap even on an empty "
                "account: no window will ever fit it"
            )
        try:
            return ledger.fits(keys, self.mechanism, self.count)
        except ValueError as refusal:
            raise AirflowFailException(f"no release can follow: {refusal}") from None
        except ReleaseRefused as refusal:
            # What the release would refuse whatever the budget: waiting cannot help.
            raise AirflowFailException(f"no release can follow: {refusal}") from None

    def poke(self, context: Any) -> PokeReturnValue:
        ledger = self._ledger()
        window = self._window(ledger, utcnow())
        fits = self._fits(ledger, window)
        self.log.info(
            "window %s %s the release", display_window(window), "fits" if fits else "cannot fit"
        )
        return PokeReturnValue(is_done=fits, xcom_value=window if fits else None)

    # ------------------------------------------------------------------ deferrable mode

    def execute(self, context: Any) -> Any:
        warn_overdue_maintenance(self._ledger(), self.log)
        if not self.deferrable:
            return super().execute(context)
        deadline = utcnow() + timedelta(seconds=self.timeout)
        return self._check_or_defer(deadline)

    def execute_complete(self, context: Any, event: Mapping[str, str]) -> Any:
        """Back from the trigger at a window start: check again, or wait for the next one."""
        return self._check_or_defer(datetime.fromisoformat(event["deadline"]))

    def _check_or_defer(self, deadline: datetime) -> str:
        ledger = self._ledger()
        now = utcnow()
        window = self._window(ledger, now)
        if self._fits(ledger, window):
            self.log.info("window %s fits the release", display_window(window))
            return window
        if self.window:
            wake = now + timedelta(seconds=self.poke_interval)
        else:
            calendar = ledger.policy_for_scope(self.tenant, self.query_type).calendar
            wake = calendar.next_window_start(now)
        if wake > deadline:
            message = (
                f"window {window} cannot fit the release and the next check at {wake.isoformat()} "
                f"is past the sensor timeout ({deadline.isoformat()})"
            )
            if self.soft_fail:
                raise AirflowSkipException(message)
            raise AirflowSensorTimeout(message)
        self.log.info(
            "window %s cannot fit the release: deferring until %s", display_window(window), wake
        )
        self.defer(
            trigger=BudgetWindowTrigger(moment=wake, deadline=deadline),
            method_name="execute_complete",
        )
