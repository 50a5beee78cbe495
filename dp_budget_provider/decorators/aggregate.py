"""``@task.dp_aggregate``: DPAggregateOperator as a TaskFlow decorator.

The decorated function returns the contribution query (the SQL text, which may use
``:data_interval_start``, ``:data_interval_end`` and ``parameters``, and Jinja); the
operator reads the data itself, bounds it, charges the units it read and returns the
noisy aggregate with its error bars, exactly as ``DPAggregateOperator`` does. The
function runs in the task, so its arguments may be other tasks' outputs (a list of
regions, a table name); what it returns is the query the release's identity names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from airflow.sdk.bases.decorator import (
    DecoratedOperator,
    TaskDecorator,
    determine_kwargs,
    task_decorator_factory,
)
from airflow.sdk.definitions.context import context_merge
from airflow.sdk.exceptions import AirflowFailException

from dp_budget_provider.operators.aggregate import DPAggregateOperator

# What the query is until the function has returned it (a comment: no query runs on it).
_UNSET = "-- the query the decorated function returns, set when the task runs"


class _DPAggregateDecoratedOperator(DecoratedOperator, DPAggregateOperator):
    """Runs the decorated function for the query, then releases its bounded aggregate."""

    template_fields: Sequence[str] = (
        *DecoratedOperator.template_fields,
        *DPAggregateOperator.template_fields,
    )
    custom_operator_name = "@task.dp_aggregate"

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Any = None,
        op_kwargs: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            python_callable=python_callable,
            op_args=op_args,
            op_kwargs=op_kwargs,
            sql=_UNSET,
            **kwargs,
        )

    def execute(self, context: Any) -> Any:
        context_merge(context, self.op_kwargs)
        kwargs = determine_kwargs(self.python_callable, self.op_args, context)
        sql = self.python_callable(*self.op_args, **kwargs)
        if not isinstance(sql, str) or not sql.strip():
            raise AirflowFailException(
                "no release: the @task.dp_aggregate function must return the query's SQL "
                f"text, got {type(sql).__name__}"
            )
        self.sql = self.render_template(sql, context)
        return DPAggregateOperator.execute(self, context)


def dp_aggregate_task(
    python_callable: Callable[..., Any] | None = None, **kwargs: Any
) -> TaskDecorator:
    """Wrap a function returning a contribution query into a budget-gated DP aggregate."""
    return task_decorator_factory(
        python_callable=python_callable,
        decorated_operator_class=_DPAggregateDecoratedOperator,
        **kwargs,
    )
