"""DPReleaseOperator: a differentially private release gated by the budget ledger.

Flow: reserve (prospective check) -> run the callable -> add the noise -> commit ->
return the noisy release. A refusal means no release at all: the callable never runs
and nothing is written. Once the callable has started, the attempt is charged whatever
happens next; a retry is a new attempt and is charged again. While the callable and the
noise run, a daemon thread renews the reservation's lease; if the worker dies, the
renewals stop and the maintenance reap charges the reservation once its lease has run
out. A renewal that fails is a warning in the task log: the task goes on, and if it
outlives its lease the reap charges the reservation (its commit then charges nothing
more), so a lost lease never lets a release go uncharged. Because an error that
depends on the data would itself be an observable output, the exact answer goes through
the release's declared rule (NaN -> ``nan_value``, clamp to ``bounds``) before the noise,
so every answer of the declared type and shape ends in a noisy release. An answer of
another shape or type (more than ``cells`` values, a float under ``integer=True``) fails
before any noise is added, but after the callable ran: that attempt stays charged. Shape
and dtype are the code's, not the data's, so such a failure says nothing about the data.

The sequence itself is the ledger's release service (``make_release``,
``dp_budget_provider/ledger/releases/service.py``, no Airflow): the operator finds the
keys and the attempt in the task's context and turns the service's named outcome into
XCom, metrics and Airflow exceptions.

A release made before (same DAG, task, map index, data interval or window, mechanism and
parameters, and cohort: its identity, ``dp_budget_provider/ledger/releases/identity.py``)
is not made again: a cleared task, a re-run of a successful run or a backfill over an
interval already released is handed the stored noisy answer and its receipt, marked
``reused``, charging nothing (reusing a published answer is post-processing; a fresh
answer would cost again, and averaging fresh answers peels the noise off).
``refresh=True`` makes a new release of the same identity, charged in full, whose answer
the next re-run is handed.

A released value's guarantee (cost, noise, windows, the cohort's size bucket: see
``ReleaseGuarantee``) goes into the asset event of each outlet Asset (``outlets.py``)
and into the task's OpenLineage run facet (``dp_budget_provider/openlineage``, imported
only when the OpenLineage provider asks for it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from typing import Any

from airflow.sdk import BaseNotifier, BaseOperator
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException
from airflow.sdk.observability.stats import Stats

from dp_budget_provider.accounting import Mechanism
from dp_budget_provider.accounting.answer_rule import AnswerRule
from dp_budget_provider.accounting.release import NoisePlan, check_noise
from dp_budget_provider.hooks.dp_budget import DPBudgetHook
from dp_budget_provider.hooks.maintenance import warn_overdue_maintenance
from dp_budget_provider.ledger import (
    CohortKeys,
    ContributionTable,
    DeclaredRelease,
    LedgerKey,
    ReleaseGate,
    ReleaseGuarantee,
    ReleaseResult,
    ReleaseSlot,
    SubjectSource,
    covered_by,
    make_release,
    query_digest,
)
from dp_budget_provider.operators.outlets import publish_guarantee, release_outlets
from dp_budget_provider.plugins.links import DPBudgetAccountLink

RECEIPT_XCOM_KEY = "dp_budget_receipt"
ON_EXHAUSTED = ("fail", "skip")


class DPBudgetExhaustedError(AirflowFailException):
    """The ledger refused the release (for any reason: the cap, a sealed window, a
    quarantine; one message for all, with a reference only an administrator opens); no
    release happened. Not retried: budget does not refill."""


def attempt_id(context: Mapping[str, Any]) -> str:
    """(dag_id, task_id, run_id, map_index, try_number, ti.id): one task-instance try.

    The task instance's UUID (new for every try, and for a deleted and re-created run
    with the same run id) makes the id unique to this try: the ledger lets an attempt
    reserve once, ever, so a re-created run can never reuse an earlier run's attempt.
    """
    ti = context["ti"]
    unique = getattr(ti, "id", None)
    if not unique:
        raise AirflowFailException(
            "the task instance has no id (uuid): without it a re-created run could reuse an "
            "earlier attempt, so no release is made"
        )
    return f"{ti.dag_id}/{ti.task_id}/{context['run_id']}/{ti.map_index}/{ti.try_number}/{unique}"


def data_interval(context: Mapping[str, Any]) -> tuple[datetime, datetime]:
    """The data a run reads: its data interval, else its logical date, else now (a moment)."""
    start, end = context.get("data_interval_start"), context.get("data_interval_end")
    if start is not None and end is not None:
        return start, end
    moment = context.get("logical_date") or datetime.now(timezone.utc)
    return moment, moment


def _name_of(function: Callable[..., Any]) -> str:
    """Where a callable is defined, by name (``module.qualname``)."""
    module = getattr(function, "__module__", None) or ""
    return f"{module}.{getattr(function, '__qualname__', type(function).__qualname__)}"


def refreshing(refresh: bool | str) -> bool:
    """``refresh`` as rendered: a bool, or a template's text ``True``/``False`` (any case);
    anything else is a ValueError (a release is never refreshed, or not, by accident)."""
    if isinstance(refresh, bool):
        return refresh
    flag = {"true": True, "false": False}.get(str(refresh).strip().lower())
    if flag is None:
        raise ValueError(f"refresh must render to True or False, got {refresh!r}")
    return flag


@dataclass(frozen=True)
class ReleaseSource:
    """Where a release's exact answer comes from: the keys it charges, and the function
    computing the answer (run once reserved), or for a filtered release the table of
    what each unit contributes, which the release service totals without the units its
    reservation leaves out (see ``make_release``)."""

    keys: list[LedgerKey] | list[CohortKeys]
    answer: Callable[[], Any] | ContributionTable


class ReleasingOperator(BaseOperator):
    """What every release gated by the ledger shares: its declaration (mechanism, scope,
    noise, answer rule), where it is made (its slot and identity), the release service's
    run of it, and what the task is told (XCom, exceptions, metrics, lineage, assets).

    A subclass says where the exact answer comes from: :meth:`_source` yields the keys the
    release charges and the function computing the answer (run only once reserved), and
    :meth:`_sensitivities` and :meth:`_query_name` what the declaration and the identity
    take from it.
    """

    template_fields: Sequence[str] = ("tenant", "query_type", "window", "refresh")
    # What a refusal for want of budget may do (a subclass that reads its own data may
    # also leave out the subjects without budget: "filter").
    on_exhausted_choices: tuple[str, ...] = ON_EXHAUSTED
    ui_color = "#e8f0fe"
    operator_extra_links = (DPBudgetAccountLink(),)

    def __init__(
        self,
        *,
        mechanism: Mechanism | Mapping[str, Any],
        query_type: str,
        rule: AnswerRule,
        tenant: str = "default",
        window: str | None = None,
        count: int = 1,
        noise: str = "lattice",
        granularity: float | None = None,
        on_exhausted: str = "fail",
        target_epsilon: float | None = None,
        on_budget_warning: BaseNotifier | None = None,
        refresh: bool | str = False,
        dp_budget_conn_id: str = DPBudgetHook.default_conn_name,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.noise = check_noise(noise)
        self.granularity = granularity
        self.rule = rule
        if on_exhausted not in self.on_exhausted_choices:
            raise ValueError(
                f"on_exhausted must be one of {self.on_exhausted_choices}, got {on_exhausted!r}"
            )
        self.mechanism = mechanism if isinstance(mechanism, Mechanism) else dict(mechanism)
        self.tenant = tenant
        self.query_type = query_type
        self.window = window
        self.count = count
        self.on_exhausted = on_exhausted
        self.target_epsilon = target_epsilon
        self.on_budget_warning = on_budget_warning
        if not isinstance(refresh, bool | str):
            raise ValueError(f"refresh must be True, False or a template, got {refresh!r}")
        self.refresh = refresh
        self.dp_budget_conn_id = dp_budget_conn_id
        # This attempt's guarantee once charged, for the lineage methods (run after execute).
        self._guarantee: ReleaseGuarantee | None = None

    # ------------------------------------------------------------------ what subclasses say

    def _sensitivities(self) -> tuple[float | None, float | None]:
        """The answer's (L2, L1) sensitivity."""
        raise NotImplementedError

    def _query_name(self) -> str:
        """What names the query in the release's identity."""
        raise NotImplementedError

    def _source(
        self, gate: ReleaseGate, context: Mapping[str, Any]
    ) -> AbstractContextManager[ReleaseSource]:
        """The keys the release charges and the function computing its exact answer, valid
        while the context is open (AirflowFailException for what fails on every try)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ declaration

    def _declared(self) -> DeclaredRelease:
        """The release as declared, in its scope as rendered for this run (ValueError if
        its mechanism, sensitivity or granularity cannot be released)."""
        l2_sensitivity, l1_sensitivity = self._sensitivities()
        return DeclaredRelease(
            self.mechanism,
            self.tenant,
            self.query_type,
            count=self.count,
            noise=self.noise,
            l2_sensitivity=l2_sensitivity,
            l1_sensitivity=l1_sensitivity,
            granularity=self.granularity,
            rule=self.rule,
            target_epsilon=self.target_epsilon,
        )

    def _windows(self, gate: ReleaseGate, context: Mapping[str, Any]) -> list[str]:
        """The windows the release charges: the one it was told, else every window the
        run's data interval overlaps."""
        if self.window:
            return [self.window]
        start, end = data_interval(context)
        if start == end:
            self.log.warning(
                "the run's data interval is empty (%s): the release is charged to the one "
                "window holding that moment. A release over a period's data needs a data "
                "interval covering it (CronDataIntervalTimetable, or [scheduler] "
                "create_cron_data_intervals = True for cron schedules) or window=",
                start.isoformat(),
            )
        return gate.windows_for(self.tenant, self.query_type, start, end)

    def _slot(self, context: Mapping[str, Any]) -> ReleaseSlot:
        """Where this release is made, from the task's context (never an argument): its
        DAG, task, map index and query, the data it reads (the run's data interval),
        and the window it was told to charge, if it was."""
        ti = context["ti"]
        where = (ti.dag_id, ti.task_id, ti.map_index)
        query = query_digest(self._query_name())
        start, end = data_interval(context)
        if self.window:
            return ReleaseSlot.in_window(*where, self.window, start, end, query)
        return ReleaseSlot.over_interval(*where, start, end, query)

    # ------------------------------------------------------------------ execute

    def execute(self, context: Any) -> Any:
        self._guarantee = None
        gate = DPBudgetHook(dp_budget_conn_id=self.dp_budget_conn_id).get_ledger()
        warn_overdue_maintenance(gate, self.log)
        try:
            outlets = release_outlets(self.outlets)
            refresh = refreshing(self.refresh)
        except ValueError as refusal:  # bad outlets, refresh: on every try
            raise AirflowFailException(f"no release: {refusal}") from None
        with self._source(gate, context) as source:
            keys = source.keys
            outcome = make_release(
                gate,
                self._declared(),
                keys,
                source.answer,
                attempt=attempt_id(context),
                log=self.log,
                slot=self._slot(context),
                refresh=refresh,
            )
        self._guarantee = ReleaseGuarantee.of(outcome, keys, gate.delta)
        summary = outcome.summary
        match outcome.result:
            case ReleaseResult.invalid:  # a release no noise fits, bad keys: on every try
                raise AirflowFailException(f"no release: {outcome.error}")
            case ReleaseResult.refused:
                Stats.incr("dp_budget.refusals", tags={"query_type": self.query_type})
                context["ti"].xcom_push(key=RECEIPT_XCOM_KEY, value=summary)
                self.log.error("no release: %s", outcome.refusal)
                if self.on_exhausted == "skip":
                    raise AirflowSkipException(f"no release: {outcome.refusal}")
                raise DPBudgetExhaustedError(f"no release: {outcome.refusal}")
            case ReleaseResult.withheld:  # quarantined meanwhile: charged when reaped
                self.log.error("release withheld: %s", outcome.refusal)
                raise AirflowFailException(f"release withheld: {outcome.refusal}")
        # released or failed: the data was touched, charged either way, and the receipt says
        # so; or reused: charged before, and the receipt says when
        context["ti"].xcom_push(key=RECEIPT_XCOM_KEY, value=summary)
        if outcome.error is not None:
            raise outcome.error
        if outlets and self._guarantee is not None:  # released or reused: charged once
            publish_guarantee(context["outlet_events"], outlets, self._guarantee)
        if outcome.result is ReleaseResult.released:
            self._report(summary, context)
        return self._answer_of(outcome.value, outcome.plan)

    def _answer_of(self, value: Any, plan: NoisePlan | None) -> Any:
        """What the task returns of the released (or reused) value, noised as ``plan``."""
        return value

    # ------------------------------------------------------------------ lineage

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """OpenLineage of a released value: its guarantee facet, inlets and outlets."""
        return self._lineage()

    def get_openlineage_facets_on_failure(self, task_instance: Any) -> Any:
        """OpenLineage of a failed attempt: the guarantee facet if it was charged."""
        return self._lineage()

    def _lineage(self) -> Any:
        """This attempt's ``OperatorLineage``; OpenLineage is imported here, not with the
        module, so the operator runs without the OpenLineage provider."""
        from dp_budget_provider.openlineage.lineage import release_lineage

        return release_lineage(self._guarantee, self.inlets, self.outlets)

    def _report(self, summary: dict[str, Any], context: Any) -> None:
        """Count the release; in an exposed gate, warn (and notify) past the warning
        fraction. A gate that exposes nothing has no account state to warn about: warnings
        are the administrator's, in the UI."""
        Stats.incr("dp_budget.spends", tags={"query_type": self.query_type})
        if not summary.get("warned"):
            return
        self.log.warning(
            "privacy budget warning: an account is past the warning fraction: %s at eps %.6g "
            "of cap %.6g",
            summary["account"],
            summary["epsilon_after"],
            summary["cap_epsilon"],
        )
        Stats.incr("dp_budget.warnings")
        if self.on_budget_warning is not None:
            self.on_budget_warning({**context, RECEIPT_XCOM_KEY: summary})


class DPReleaseOperator(ReleasingOperator):
    """Release ``python_callable``'s exact, clipped answer with DP noise, within budget.

    :param python_callable: returns the exact, already-clipped query answer (a number or
        an array-like); its sensitivity must be the declared one.
    :param mechanism: a ``GaussianMechanism``/``LaplaceMechanism`` or its spec; a Gaussian
        spec may say ``"noise_multiplier": "auto"`` to use the least noise with which the
        release alone costs at most ``target_epsilon`` (default: its scope's cap). The
        noise never depends on what anyone has spent (it would tell the DAG).
    :param l2_sensitivity: L2 sensitivity of the answer (Gaussian).
    :param l1_sensitivity: L1 sensitivity of the answer (Laplace).
    :param subject: the privacy unit charged; or ``subjects`` for one release over many:
        any collection of ids from the data (a list, a numpy array, an upstream task's
        ``.output``), or a callable that Airflow calls with ``context`` and ``jinja_env``
        when the task runs (as for any templated field) and that returns one; ids that
        are one canonical id are one subject, charged once. ``subjects`` may also be a
        registered cohort (``ledger.cohort(ids)``, or its ``as_dict()`` returned by an
        upstream task): then the ids never travel again, and a release over a cohort its
        window has seen costs one row per class, whatever its size.
    :param tenant: ledger tenant. :param query_type: release family.
    :param window: one budget window, a canonical label of the scope's calendar (e.g. the
        window a :class:`BudgetSensor` found room in); default: every window the run's
        data interval overlaps under the policy calendar, each charged.
    :param count: how many invocations of the mechanism this release is.
    :param noise: ``"lattice"`` (default): exact discrete Gaussian/Laplace noise on the
        lattice ``granularity * Z`` from the OS's CSPRNG, charged as the discrete
        mechanism with the sensitivity rounded up to lattice units; every output is a
        multiple of the granularity. ``"unsafe_float"``: floating-point noise, charged as
        the continuous mechanism but unsafe against floating-point attacks (Mironov 2012).
    :param granularity: the lattice spacing, a power of two (``1`` for integer counts);
        default: derived from the sensitivity, the noise spread and ``cells``.
    :param cells: the most values the answer has (default 1, a scalar; a 4 x 4 heatmap
        is 16). The charge covers what snapping each cell to the lattice adds to the
        sensitivity; an answer with more cells fails before noise (and is charged).
    :param integer: the answer has an integer (or bool) dtype, e.g. counts. On a lattice
        that holds the integers (granularity <= 1) snapping leaves it unchanged, so no
        snapping inflation is charged; a non-integer dtype then fails before noise (and is
        charged). Needs integer ``bounds``.
    :param bounds: ``(low, high)``: every value of the exact answer is clamped to it
        before noise (infinities become bounds); default: the largest range the release
        represents exactly.
    :param nan_value: what a NaN in the exact answer becomes before noise (default 0).
    :param on_exhausted: ``"fail"`` (raise :class:`DPBudgetExhaustedError`) or ``"skip"``.
    :param on_budget_warning: a notifier called when a key passes its warning fraction.
    :param refresh: make a new release even if this release (same identity) was made
        before, charged in full; by default a re-run is handed the stored answer.
        Templated: ``"{{ params.refresh }}"`` lets a manual run ask for it (it must render
        to ``True`` or ``False``).

    Outlets: each outlet Asset's event carries the release's guarantee in its extra, under
    ``"dp_guarantee"`` (see :mod:`dp_budget_provider.operators.outlets`); an
    ``AssetAlias`` outlet is refused.
    """

    template_fields: Sequence[str] = (
        *ReleasingOperator.template_fields,
        "subject",
        "subjects",
        "op_args",
        "op_kwargs",
    )

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        mechanism: Mechanism | Mapping[str, Any],
        query_type: str,
        subject: str | None = None,
        subjects: SubjectSource | None = None,
        l2_sensitivity: float | None = None,
        l1_sensitivity: float | None = None,
        bounds: tuple[float, float] | None = None,
        nan_value: float = 0.0,
        cells: int = 1,
        integer: bool = False,
        op_args: Collection[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        rule = AnswerRule(nan_value, bounds, cells, integer)
        super().__init__(mechanism=mechanism, query_type=query_type, rule=rule, **kwargs)
        if not callable(python_callable):
            raise ValueError("python_callable must be callable")
        if (subject is None) == (subjects is None):
            raise ValueError("give exactly one of subject or subjects")
        self.python_callable = python_callable
        self.l2_sensitivity = l2_sensitivity
        self.l1_sensitivity = l1_sensitivity
        self.subject = subject
        self.subjects = subjects
        self.op_args = list(op_args or [])
        self.op_kwargs = dict(op_kwargs or {})
        # At parse time, so that a bad spec, sensitivity or granularity never reaches a run.
        self._declared()

    def _sensitivities(self) -> tuple[float | None, float | None]:
        return self.l2_sensitivity, self.l1_sensitivity

    def _query_name(self) -> str:
        return _name_of(self.python_callable)

    @contextlib.contextmanager
    def _source(self, gate: ReleaseGate, context: Mapping[str, Any]) -> Iterator[ReleaseSource]:
        """Every (subject, window) the release charges: the data it reads, per subject (or
        a registered cohort's subjects in each window); and the callable with its arguments."""
        try:
            windows = self._windows(gate, context)
            subjects = [self.subject] if self.subject is not None else self.subjects
            keys = covered_by(subjects, self.query_type, windows, self.tenant)
        except ValueError as refusal:  # bad subjects or windows: on every try
            raise AirflowFailException(f"no release: {refusal}") from None
        yield ReleaseSource(keys, partial(self.python_callable, *self.op_args, **self.op_kwargs))
