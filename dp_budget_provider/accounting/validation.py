"""Argument checks shared by the accounting layer.

Every public entry point validates its numbers here so that a bad parameter fails
loudly with its name and value instead of turning into a NaN curve, a silently
clamped noise level or a zero cost in the ledger.
"""

from __future__ import annotations

import math
import numbers


def real(name: str, value: object) -> float:
    """Return ``value`` as a finite float, rejecting bools, strings, NaN and inf."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    as_float = float(value)
    if not math.isfinite(as_float):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return as_float


def positive(name: str, value: object) -> float:
    """A finite real strictly above zero."""
    as_float = real(name, value)
    if as_float <= 0.0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return as_float


def non_negative(name: str, value: object) -> float:
    """A finite real at or above zero."""
    as_float = real(name, value)
    if as_float < 0.0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return as_float


def open_unit(name: str, value: object) -> float:
    """A probability strictly between 0 and 1, such as delta."""
    as_float = real(name, value)
    if not 0.0 < as_float < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return as_float


def half_open_unit(name: str, value: object) -> float:
    """A rate in (0, 1], such as a Poisson sampling rate."""
    as_float = real(name, value)
    if not 0.0 < as_float <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return as_float


def positive_int(name: str, value: object) -> int:
    """A strictly positive integer (bools and integral floats are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    as_int = int(value)
    if as_int <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return as_int


def count(name: str, value: object) -> int:
    """A count of invocations: a positive integer up to 2^53.

    Every integer up to 2^53 is exact as a double, so a cost ``count * rho`` is one
    rounding; larger counts (10^400 overflowed) are refused rather than rounded.
    """
    as_int = positive_int(name, value)
    if as_int > MAX_COUNT:
        raise ValueError(f"{name} must be at most 2**53, got {value!r}")
    return as_int


MAX_COUNT = 2**53
