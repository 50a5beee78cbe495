"""The declared, data-independent rule that turns any exact answer into finite numbers.

Why: once the query has touched the data, every attempt is charged, and what the attempt
shows must be covered by that charge. A release that *fails* on some data (a NaN, an
infinity, a count too large to represent) and succeeds on its neighbour is a one-bit
difference no epsilon covers. So the exact answer is first mapped, by the same rule for
every input, onto finite values, and only then noised:

1. NaN becomes ``nan_value`` (declared; default 0).
2. Every value is clamped to ``bounds`` (declared; by default the largest range the
   release can represent exactly), so +-infinity becomes a bound.

Clamping is 1-Lipschitz in every cell, so it never increases a sensitivity; replacing NaN
does not either when the declared sensitivity already holds for the answer with NaN read
as ``nan_value`` -- the caller declares the rule, and with it that fact.

What still fails is what the code decides, not the data: an answer that is not a number
or a rectangular array of numbers (a string, ``None``, a ragged list), an answer with
more cells than the declared ``cells`` (default 1: a scalar), and, when ``integer=True``
is declared, an answer whose dtype is not an integer (or bool) dtype, are refused with an
error naming its type and shape only (never its values). These are checked after the
callable ran, so the attempt is charged. A callable whose output type or shape depends
on the data must fix them itself (pad or crop to a fixed shape, cast to a fixed dtype).

Why the declarations: the charge is reserved before the callable runs, and snapping a
vector off the lattice inflates its sensitivity by up to a unit per cell, so the charge
needs the number of cells; an integer answer on an integer-containing lattice is not
moved by snapping at all, so ``integer=True`` spares that inflation.

Layering: standard library and numpy only.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from dp_budget_provider.accounting import validation as check

__all__ = ["AnswerRule"]


def _as_float(value: object) -> float:
    """A real number as a float, overflowing to +-inf instead of raising (10**400 -> inf)."""
    if isinstance(value, (bool, np.bool_)):
        return float(value)
    if not isinstance(value, numbers.Real):
        raise TypeError(
            f"the answer must contain only real numbers, found a {type(value).__name__}"
        )
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _rectangular(answer: Any) -> np.ndarray:
    """The answer as an array, or TypeError naming its type (a ragged list is not one)."""
    try:
        return np.asarray(answer)
    except ValueError:
        raise TypeError(
            f"the answer must be a number or a rectangular array of numbers; a "
            f"{type(answer).__name__} with rows of different lengths is not"
        ) from None


def _is_integer(arr: np.ndarray) -> bool:
    """Whether the array's type makes every value an integer (int/bool dtype, or int objects)."""
    if arr.dtype.kind in "biu":
        return True
    return arr.dtype.kind == "O" and all(
        isinstance(v, (numbers.Integral, np.bool_)) for v in arr.reshape(-1)
    )


def _real_array(arr: np.ndarray) -> NDArray[np.float64]:
    """The answer as a float64 array (a copy), or TypeError naming its type and shape."""
    if arr.dtype.kind in "biuf":
        return np.array(arr, dtype=np.float64, copy=True)
    if arr.dtype.kind == "O":
        flat = [_as_float(v) for v in arr.reshape(-1)]
        return np.array(flat, dtype=np.float64).reshape(arr.shape)
    raise TypeError(
        f"the answer must be a number or a rectangular array of numbers, got dtype "
        f"{arr.dtype} with shape {arr.shape}"
    )


@dataclass(frozen=True)
class AnswerRule:
    """The declared form (``cells``, ``integer``), then NaN -> ``nan_value``, clamp to ``bounds``.

    ``cells``: the most cells (values) the answer may have; ``integer``: the answer has an
    integer dtype (counts), and then ``bounds`` must be integers so clamping keeps it so.
    """

    nan_value: float = 0.0
    bounds: tuple[float, float] | None = None
    cells: int = 1
    integer: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "nan_value", check.real("nan_value", self.nan_value))
        object.__setattr__(self, "cells", check.positive_int("cells", self.cells))
        if not isinstance(self.integer, bool):
            raise ValueError(f"integer must be True or False, got {self.integer!r}")
        if self.bounds is not None:
            self._check_bounds()

    def _check_bounds(self) -> None:
        try:
            low, high = self.bounds
        except (TypeError, ValueError):
            raise ValueError(f"bounds must be a pair (low, high), got {self.bounds!r}") from None
        low, high = check.real("bounds[0]", low), check.real("bounds[1]", high)
        if not low < high:
            raise ValueError(f"bounds must have low < high, got {self.bounds!r}")
        if self.integer and not (low.is_integer() and high.is_integer()):
            raise ValueError(
                f"integer=True needs integer bounds (clamping must keep counts integers), "
                f"got {self.bounds!r}"
            )
        object.__setattr__(self, "bounds", (low, high))

    def _check_form(self, arr: np.ndarray) -> None:
        """Refuse an answer whose size or dtype breaks the declaration the charge relies on."""
        if arr.size > self.cells:
            raise ValueError(
                f"the answer has {arr.size} cells (shape {arr.shape}), more than cells="
                f"{self.cells} declared; the charge covers the declared cells only, so "
                f"declare cells={arr.size} (or more)"
            )
        if self.integer and not _is_integer(arr):
            raise TypeError(
                f"integer=True declares an integer answer, got dtype {arr.dtype} with shape "
                f"{arr.shape}; cast it in the query (e.g. astype(int)) or drop integer=True"
            )

    def apply(self, answer: Any, limit: float) -> NDArray[np.float64]:
        """Finite values within ``bounds`` and within ``[-limit, limit]`` (the release's range).

        ``limit`` is a multiple of the granularity, so clamping keeps integers on the lattice.
        """
        arr = _rectangular(answer)
        self._check_form(arr)
        values = _real_array(arr)
        values[np.isnan(values)] = self.nan_value
        low, high = self.bounds or (-limit, limit)
        np.clip(values, max(low, -limit), min(high, limit), out=values)
        return values
