"""DPAggregateOperator: a count or sum over a SQL source, whose data the release owns.

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
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from functools import partial
from typing import Any

import numpy as np
import sqlalchemy as sa
from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowFailException

from dp_budget_provider.accounting import Mechanism
from dp_budget_provider.accounting.answer_rule import AnswerRule
from dp_budget_provider.aggregation import Aggregate, BoundedQuery, BoundedRows, ContributionBounds
from dp_budget_provider.ledger import CohortKeys, LedgerKey, ReleaseGate, covered_by
from dp_budget_provider.operators.release import ReleasingOperator, data_interval

# What a count's answer is clamped to: any count a source can hold, as an integer.
COUNT_RANGE = (0.0, float(2**52))


class DPAggregateOperator(ReleasingOperator):
    """Release a count or sum per cell of a public domain, over a SQL source.

    :param conn_id: an Airflow connection to the source whose hook is a SQL hook
        (PostgreSQL or SQLite): a database apart from the ledger's.
    :param sql: returns one row per contribution; may use ``:data_interval_start`` and
        ``:data_interval_end`` (the run's data interval) and ``parameters``. Templated.
    :param privacy_unit: the column naming whose contribution a row is: the subject
        charged.
    :param group_by: the column (or columns) whose values make a cell.
    :param domain: the public cells, in the order the values are returned (one value
        per ``group_by`` column each); rows outside it are dropped.
    :param aggregate: ``"count"`` (rows per cell) or ``"sum"`` (of ``value``).
    :param value: the summed column; ``bounds``: ``(low, high)`` each value is clamped to.
    :param max_groups_per_unit: the most cells one unit contributes to (the first in the
        domain's order are kept).
    :param max_rows_per_group: the most rows one unit contributes to a cell (the
        smallest values are kept).
    :param mechanism: as for ``DPReleaseOperator``: its L2 (Gaussian) and L1 (Laplace)
        sensitivities are derived from the bounds.

    The other arguments (``tenant``, ``window``, ``noise``, ``granularity``,
    ``on_exhausted``, ``refresh``, ``target_epsilon``, ...) are ``DPReleaseOperator``'s.
    Returns (XCom) ``{"values": [...]}``, the noisy value of each cell in domain order.
    """

    template_fields: Sequence[str] = (*ReleasingOperator.template_fields, "sql", "parameters")
    template_ext: Sequence[str] = (".sql",)

    def __init__(
        self,
        *,
        conn_id: str,
        sql: str,
        privacy_unit: str,
        group_by: str | Sequence[str],
        domain: Sequence[Any],
        mechanism: Mechanism | Mapping[str, Any],
        query_type: str,
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
        rule = (
            AnswerRule(0.0, COUNT_RANGE, len(query.domain), integer=True)
            if aggregate == "count"
            else AnswerRule(0.0, None, len(query.domain))
        )
        super().__init__(mechanism=mechanism, query_type=query_type, rule=rule, **kwargs)
        self.conn_id = conn_id
        self.sql = sql
        self.parameters = dict(parameters or {})
        self.bounded = query
        # At parse time, so that a bad spec or granularity never reaches a run.
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
    def _source(
        self, gate: ReleaseGate, context: Mapping[str, Any]
    ) -> Iterator[tuple[list[LedgerKey] | list[CohortKeys], Callable[[], Any]]]:
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
                try:  # one read: the units registered are those of every row counted
                    cohort = gate.cohort(rows, tenant=self.tenant)
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
                yield keys, partial(_exact_answer, query, rows)
        finally:
            engine.dispose()

    def _answer_of(self, value: Any) -> Any:
        return {"values": np.asarray(value).tolist()}


def _exact_answer(query: BoundedQuery, rows: BoundedRows) -> np.ndarray:
    """The cells' bounded totals, in domain order: counts as integers, sums as floats."""
    totals = rows.totals
    if query.aggregate == "count":
        return np.array([cell.rows for cell in totals], dtype=np.int64)
    return np.array([cell.total for cell in totals], dtype=np.float64)


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
