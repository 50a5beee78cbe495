"""``@task.dp_release``: DPReleaseOperator as a TaskFlow decorator.

The decorated function returns the exact, clipped answer; the task returns the noisy
release, charged to the ledger exactly like the operator; declare a vector answer's
shape the same way (``cells=16``, and ``integer=True`` for counts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from airflow.sdk.bases.decorator import DecoratedOperator, TaskDecorator, task_decorator_factory

from dp_budget_provider.operators.release import DPReleaseOperator


class _DPReleaseDecoratedOperator(DecoratedOperator, DPReleaseOperator):
    """Captures the decorated function's arguments and runs it as a DP release."""

    template_fields: Sequence[str] = DPReleaseOperator.template_fields
    custom_operator_name = "@task.dp_release"

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Any = None,
        op_kwargs: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            kwargs_to_upstream={
                "python_callable": python_callable,
                "op_args": op_args,
                "op_kwargs": op_kwargs,
            },
            python_callable=python_callable,
            op_args=op_args,
            op_kwargs=op_kwargs,
            **kwargs,
        )


def dp_release_task(
    python_callable: Callable[..., Any] | None = None, **kwargs: Any
) -> TaskDecorator:
    """Wrap a function returning an exact query answer into a budget-gated DP release."""
    return task_decorator_factory(
        python_callable=python_callable,
        decorated_operator_class=_DPReleaseDecoratedOperator,
        **kwargs,
    )
