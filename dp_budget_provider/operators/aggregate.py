"""DPAggregateOperator: a count, sum or mean over a SQL source, whose data the release owns.

``DPReleaseOperator`` releases what a callable returns, at the sensitivity its author
declares, over the subjects an upstream task lists. Here the operator reads the data
itself: the author's query (one row per contribution) is wrapped in the contribution
bounds (:mod:`dp_budget_provider.aggregation`), which run in the source's own engine; the
sensitivity is derived from those bounds, never declared; and the subjects charged are
the units of the same bounded rows, registered as a cohort in the same task.

The query runs once: one streamed read of the bounded rows, in unit order, gives both the
units registered and the cells' totals (a query need not give the same rows twice), in a
read-only transaction (PostgreSQL ``REPEATABLE READ READ ONLY``; on SQLite one read
transaction with ``query_only``), so the author's SQL cannot write. Sources that cannot
promise that are refused. The answer is released only if the reservation is granted.

The release itself is the one every gated release goes through
(:class:`~dp_budget_provider.operators.release.ReleasingOperator`): reservation, lease,
noise, commit, receipt, re-run reuse (the identity names the bounded query) and assets.

Every value comes with its error bars (:mod:`dp_budget_provider.accounting.error_bars`,
computed for the noise drawn); the operator only asks for them. ``accuracy`` is resolved
to a Gaussian mechanism when the DAG is parsed: it depends on the bounds, the domain and
the granularity only, all public, so the reservation charges exactly what was planned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np
import sqlalchemy as sa
from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowFailException

from dp_budget_provider.accounting import GaussianMechanism, Mechanism
from dp_budget_provider.accounting.answer_rule import AnswerRule
from dp_budget_provider.accounting.error_bars import (
    ErrorBars,
    check_confidence,
    error_bars,
    least_noise_within,
)
from dp_budget_provider.accounting.release import NoisePlan
from dp_budget_provider.aggregation import Aggregate, BoundedQuery, BoundedRows, ContributionBounds
from dp_budget_provider.ledger import (
    ContributionTable,
    ReleaseGate,
    canonical_subject_ids,
    covered_by,
    unit_digest,
)
from dp_budget_provider.operators.release import (
    ON_EXHAUSTED,
    ReleaseSource,
    ReleasingOperator,
    data_interval,
)

# What a count's answer is clamped to: any count a source can hold, as an integer.
COUNT_RANGE = (0.0, float(2**52))


class DPAggregateOperator(ReleasingOperator):
    """Release a count, sum or mean per cell of a public domain, over a SQL source.

    :param conn_id: an Airflow connection to the source whose hook is a SQL hook
        (PostgreSQL or SQLite): a database apart from the ledger's.
    :param sql: returns one row per contribution; may use ``:data_interval_start`` and
        ``:data_interval_end`` (the run's data interval) and ``parameters``. Templated.
    :param privacy_unit: the column naming whose contribution a row is: the subject
        charged.
    :param group_by: the column (or columns) whose values make a cell.
    :param domain: the public cells, in the order the values are returned (one value
        per ``group_by`` column each); rows outside it are dropped.
    :param aggregate: ``"count"`` (rows per cell), ``"sum"`` (of ``value``) or ``"mean"``
        (of ``value``: a noisy sum and a noisy count per cell, released together under one
        charge, then divided).
    :param value: the summed column; ``bounds``: ``(low, high)`` each value is clamped to.
    :param max_groups_per_unit: the most cells one unit contributes to (the first in the
        domain's order are kept).
    :param max_rows_per_group: the most rows one unit contributes to a cell (the
        smallest values are kept).
    :param mechanism: as for ``DPReleaseOperator``: its L2 (Gaussian) and L1 (Laplace)
        sensitivities are derived from the bounds.
    :param accuracy: ``(error, level)`` instead of ``mechanism``: the Gaussian mechanism
        with the most noise (the least charge) whose interval at ``level`` has half-width
        at most ``error`` in the answer's units, resolved when the DAG is parsed.
    :param confidence: the level of the returned intervals (default 0.95), in (0, 1).
    :param on_exhausted: ``"fail"`` or ``"skip"`` as for ``DPReleaseOperator``, or
        ``"filter"``: the units whose budget cannot afford the release are left out of it
        (charged nothing, their rows never totalled) and the release goes ahead over the
        rest; nothing the task shows says who or how many (docs/accounting.md,
        "Individual filtering").

    The other arguments (``tenant``, ``window``, ``noise``, ``granularity``,
    ``refresh``, ``target_epsilon``, ...) are ``DPReleaseOperator``'s.
    Returns (XCom), in domain order, ``{"values": [...], "stddev": [...], "intervals":
    [[lo, hi], ...]}``: the noisy values, their noise standard deviation and intervals at
    ``confidence`` holding the exact bounded value with at least that probability
    (centred on the noisy value, not clamped). A mean's ``values`` are the noisy sum over
    the noisy count, clamped to ``bounds``, None where the noisy count is not positive;
    its ``stddev`` and ``intervals`` are None (a ratio of noisy numbers has no exact
    interval), and ``sums`` and ``counts`` carry the two released vectors with theirs.
    """

    template_fields: Sequence[str] = (*ReleasingOperator.template_fields, "sql", "parameters")
    on_exhausted_choices = (*ON_EXHAUSTED, "filter")
    template_ext: Sequence[str] = (".sql",)

    def __init__(
        self,
        *,
        conn_id: str,
        sql: str,
        privacy_unit: str,
        group_by: str | Sequence[str],
        domain: Sequence[Any],
        query_type: str,
        mechanism: Mechanism | Mapping[str, Any] | None = None,
        accuracy: tuple[float, float] | None = None,
        confidence: float = 0.95,
        aggregate: Aggregate = "count",
        value: str | None = None,
        bounds: tuple[float, float] | None = None,
        max_groups_per_unit: int = 1,
        max_rows_per_group: int = 1,
        parameters: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        contribution = ContributionBounds(max_groups_per_unit, max_rows_per_group, bounds)
        query = BoundedQuery(
            sql, privacy_unit, group_by, domain, contribution, aggregate, value
        )  # fmt: skip
        if aggregate == "count":
            rule = AnswerRule(0.0, COUNT_RANGE, query.answer_size, integer=True)
        else:  # a mean's answer is its sums, then its counts
            rule = AnswerRule(0.0, None, query.answer_size)
        if (mechanism is None) == (accuracy is None):
            raise ValueError("give exactly one of mechanism and accuracy=(error, level)")
        self.confidence = check_confidence("confidence", confidence)
        super().__init__(
            mechanism=GaussianMechanism(1.0)
            if mechanism is None
            else mechanism,  # accuracy's: resolved below
            query_type=query_type,
            rule=rule,
            **kwargs,
        )
        self.conn_id = conn_id
        self.sql = sql
        self.parameters = dict(parameters or {})
        self.bounded = query
        # At parse time, so that a bad spec or granularity never reaches a run.
        declared = self._declared()
        self.accuracy = accuracy
        if accuracy is not None:
            error, level = _accuracy(accuracy)
            self.mechanism = GaussianMechanism(
                least_noise_within(error, level, lambda z: declared.plan(GaussianMechanism(z)))
            )
            self._declared()

    def _query(self) -> BoundedQuery:
        """The bounded query with its SQL as rendered for this run (checked again)."""
        return dataclasses.replace(self.bounded, sql=self.sql)

    def _sensitivities(self) -> tuple[float | None, float | None]:
        bounds, aggregate = self.bounded.bounds, self.bounded.aggregate
        return bounds.l2_sensitivity(aggregate), bounds.l1_sensitivity(aggregate)

    def _query_name(self) -> str:
        """The source, the rendered query and everything that bounds it: a change of any
        is another release, never handed this one's stored answer."""
        query = self._query()
        return json.dumps(
            {
                "conn_id": self.conn_id,
                "sql": query.sql,
                "parameters": self.parameters,
                "privacy_unit": query.privacy_unit,
                "group_by": query.group_by,
                "domain": query.domain,
                "aggregate": query.aggregate,
                "value": query.value,
                "bounds": [
                    query.bounds.max_groups_per_unit,
                    query.bounds.max_rows_per_group,
                    query.bounds.value_bounds,
                ],
            },
            sort_keys=True,
            default=str,
        )

    @contextlib.contextmanager
    def _source(self, gate: ReleaseGate, context: Mapping[str, Any]) -> Iterator[ReleaseSource]:
        """Within one read-only snapshot of the source: the units of the bounded rows,
        registered as the cohort charged in each window, and the cells' totals."""
        try:
            query = self._query()
            windows = self._windows(gate, context)
            start, end = data_interval(context)
            parameters = {"data_interval_start": start, "data_interval_end": end, **self.parameters}
            query.parameters(parameters)  # the bounds' own names are refused here
        except ValueError as refusal:  # bad SQL, parameters or windows: on every try
            raise AirflowFailException(f"no release: {refusal}") from None
        engine = _engine_of(self.conn_id)
        try:
            with engine.connect() as connection, _snapshot(connection):
                bound = _bindable(parameters, connection.dialect.name)
                rows = BoundedRows(connection, query, bound)
                units = _CanonicalUnits(rows) if self.on_exhausted == "filter" else None
                try:  # one read: the units registered are those of every row counted
                    cohort = gate.cohort(units or rows, tenant=self.tenant)
                    keys = covered_by(cohort, self.query_type, windows, self.tenant)
                except ValueError as refusal:  # no unit at all, a unit that is no id
                    raise AirflowFailException(f"no release: {refusal}") from None
                if cohort.size != rows.units:
                    # Two units the bounds kept apart would be charged as one subject: the
                    # subject's data could move the answer by more than was charged.
                    raise AirflowFailException(
                        f"no release: {rows.units - cohort.size} of the query's units are "
                        "the same subject id to the ledger as another unit (ids differing "
                        "only in case, spacing or Unicode form): make the privacy unit "
                        "column canonical in the query"
                    )
                self.log.info("the bounded query's units are registered as the cohort charged")
                table = _table(query, rows, units)
                yield ReleaseSource(keys, table if units is not None else table.totals)
        finally:
            engine.dispose()

    def _answer_of(self, value: Any, plan: NoisePlan | None) -> Any:
        """The values with their error bars (a mean: its sums and counts with theirs)."""
        assert plan is not None  # released or reused: planned
        bars = error_bars(plan, self.confidence)
        released = np.asarray(value)
        if self.bounded.aggregate != "mean":
            return _with_bars(released, bars)
        cells = len(self.bounded.domain)
        sums, counts = released[:cells], released[cells:]
        assert self.bounded.bounds.value_bounds is not None  # a mean is refused without
        low, high = self.bounded.bounds.value_bounds
        means = [
            float(min(max(total / count, low), high)) if count > 0 else None
            for total, count in zip(sums.tolist(), counts.tolist(), strict=True)
        ]
        return {
            "values": means,
            "stddev": [None] * cells,
            "intervals": [None] * cells,
            "sums": _with_bars(sums, bars),
            "counts": _with_bars(counts, bars),
        }


def _accuracy(accuracy: Any) -> tuple[float, float]:
    """``(error, level)`` as two numbers (ValueError otherwise; each is checked where used)."""
    try:
        error, level = accuracy
    except (TypeError, ValueError):
        raise ValueError(f"accuracy must be (error, level), got {accuracy!r}") from None
    return error, level


def _with_bars(values: np.ndarray, bars: ErrorBars) -> dict[str, list[Any]]:
    """Released values with their standard deviation and interval each."""
    plain = values.tolist()
    return {
        "values": plain,
        "stddev": [bars.stddev] * len(plain),
        "intervals": [bars.interval(value) for value in plain],
    }


class _CanonicalUnits:
    """A filtered release's units on their way to the ledger, passed on as they stream,
    each kept as the ledger's :func:`unit_digest` of its canonical id (never the id): the
    names by which the release's contribution table lets the ledger leave units out."""

    def __init__(self, units: Iterable[str], batch: int = 10_000) -> None:
        self._units = units
        self._batch = batch
        self._digests: list[bytes] = []

    def __iter__(self) -> Iterator[str]:
        batch: list[str] = []
        for unit in self._units:
            batch.append(unit)
            if len(batch) == self._batch:
                yield from self._digested(batch)
                batch = []
        yield from self._digested(batch)

    def _digested(self, batch: list[str]) -> list[str]:
        if batch:
            self._digests.extend(map(unit_digest, canonical_subject_ids(batch)))
        return batch

    def digests(self) -> np.ndarray:
        return np.array(self._digests, dtype="S16")


def _table(
    query: BoundedQuery, rows: BoundedRows, units: _CanonicalUnits | None
) -> ContributionTable:
    """The release's contribution table from the rows read: its units named by digest
    where it is filtered (else nameless: nobody is left out), its answer the domain's
    counts as integers, sums as floats, or a mean's sums then its counts."""
    names = units.digests() if units is not None else np.zeros(rows.units, dtype="S16")
    unit_of, index, amount = rows.entries()
    return ContributionTable(
        names, unit_of, index, amount, query.answer_size, query.aggregate == "count"
    )


def _engine_of(conn_id: str) -> sa.Engine:
    """The source's engine, from its Airflow connection's SQL hook."""
    hook = BaseHook.get_connection(conn_id).get_hook()
    engine_of = getattr(hook, "get_sqlalchemy_engine", None)
    if engine_of is None:
        raise AirflowFailException(
            f"no release: connection {conn_id!r} has no SQL hook (its hook is "
            f"{type(hook).__name__})"
        )
    return engine_of()


def _bindable(parameters: Mapping[str, Any], dialect: str) -> dict[str, Any]:
    """The query's parameters as the source's driver binds them.

    Airflow hands the data interval as pendulum datetimes, which sqlite3 cannot bind (it
    adapts only the plain ``datetime`` type, and Python 3.12 deprecates even that). So an
    aware datetime is passed as a plain one in UTC; and on SQLite, which has no time type,
    as the ISO 8601 text sqlite3 itself writes (``2026-07-06 00:00:00+00:00``), which
    compares in time order with timestamps stored as such UTC text.
    """
    bound = dict(parameters)
    for name, value in parameters.items():
        if not isinstance(value, datetime):
            continue
        if value.tzinfo is not None:
            value = datetime.fromisoformat(value.astimezone(timezone.utc).isoformat())
        bound[name] = value.isoformat(" ") if dialect == "sqlite" else value
    return bound


@contextlib.contextmanager
def _snapshot(connection: sa.Connection) -> Iterator[None]:
    """One read-only transaction on one snapshot of the source, for the query's read."""
    dialect = connection.dialect.name
    if dialect == "postgresql":
        connection.execution_options(isolation_level="REPEATABLE READ")
        with connection.begin():
            connection.exec_driver_sql("SET TRANSACTION READ ONLY")
            yield
    elif dialect == "sqlite":
        with connection.begin():
            connection.exec_driver_sql("BEGIN")  # pysqlite begins only before writes
            connection.exec_driver_sql("PRAGMA query_only = ON")
            try:
                yield
            finally:
                connection.exec_driver_sql("PRAGMA query_only = OFF")
    else:
        raise AirflowFailException(
            f"no release: a {dialect} source is not supported: the query must run in a "
            "read-only snapshot (PostgreSQL and SQLite sources do)"
        )
