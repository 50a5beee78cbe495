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
or a rectangular array of numbers (a string, ``None``, a ragged list) is refused with an
error naming its type and shape only (never its values). A callable whose output type or
shape depends on the data must fix them itself (pad or crop to a fixed shape).

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

__all__ = ["AnswerRule", "real_array"]


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


def real_array(answer: Any) -> NDArray[np.float64]:
    """The answer as a float64 array (a copy), or TypeError naming its type and shape."""
    try:
        arr = np.asarray(answer)
    except ValueError:
        raise TypeError(
            f"the answer must be a number or a rectangular array of numbers; a "
            f"{type(answer).__name__} with rows of different lengths is not"
        ) from None
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
    """NaN -> ``nan_value``, then clamp to ``bounds``; the same for every input."""

    nan_value: float = 0.0
    bounds: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "nan_value", check.real("nan_value", self.nan_value))
        if self.bounds is None:
            return
        try:
            low, high = self.bounds
        except (TypeError, ValueError):
            raise ValueError(f"bounds must be a pair (low, high), got {self.bounds!r}") from None
        low, high = check.real("bounds[0]", low), check.real("bounds[1]", high)
        if not low < high:
            raise ValueError(f"bounds must have low < high, got {self.bounds!r}")
        object.__setattr__(self, "bounds", (low, high))

    def apply(self, answer: Any, limit: float) -> NDArray[np.float64]:
        """Finite values within ``bounds`` and within ``[-limit, limit]`` (the release's range)."""
        values = real_array(answer)
        values[np.isnan(values)] = self.nan_value
        low, high = self.bounds or (-limit, limit)
        np.clip(values, max(low, -limit), min(high, limit), out=values)
        return values
