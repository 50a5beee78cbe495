"""The lattice a release's noise lives on: ``granularity * Z``, with ``granularity = 2**k``.

Why a lattice: floating-point noise has a set of attainable outputs that depends on the
input, so its low bits identify the input (Mironov 2012). A release that is an integer
number of lattice units plus exact integer noise has no such bits: every output is a
multiple of the granularity whatever the data, and its distribution is exactly the
discrete mechanism's.

Why a power of two: the answer is scaled by ``1 / granularity`` and multiples of the
granularity are converted back to floats; with a power of two both are exact in binary
floating point (for lattice indices below 2**53), so no rounding error can depend on the
data.

Snapping: an answer value ``x`` goes to the nearest lattice index ``floor(x/g + 1/2)``
(ties upwards, computed exactly). For one number this moves two inputs at distance ``d``
at most ``ceil(d / g)`` units apart, which is why the charge uses the sensitivity rounded
UP to lattice units. Values already on the lattice (integer counts at granularity 1) do
not move at all. A vector answer *off* the lattice can move one unit more in every cell
that differs between neighbours; such a release must declare the sensitivity of the
snapped answer (e.g. ``l2 + granularity * sqrt(cells)``) or snap in the query itself.

Derived granularity: when the release does not declare one, it is the largest power of
two at most ``spread / 2**10`` and at most the sensitivity, so the noise spans more than
a thousand lattice units (outputs are as fine as the noise makes useful) and rounding the
sensitivity up costs a relative ``granularity / sensitivity`` at most (none when the
sensitivity is a multiple of the granularity, e.g. a power of two).

Layering: standard library and numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from numpy.typing import NDArray

from dp_budget_provider.accounting import validation as check

__all__ = ["MAX_UNITS", "Lattice"]

#: Largest |lattice index| of a snapped answer; indices plus noise stay below 2**53.
MAX_UNITS: int = 2**52

_SUBDIVISION_BITS = 10


def _floor_log2(value: float) -> int:
    """Exact floor(log2(value)) of a positive finite float."""
    return math.frexp(value)[1] - 1  # value = m * 2**e with m in [0.5, 1)


@dataclass(frozen=True)
class Lattice:
    """``granularity * Z`` for a power-of-two granularity."""

    granularity: Fraction

    @classmethod
    def declared(cls, granularity: object) -> Lattice:
        """The lattice a release declares, refusing anything but a positive power of two."""
        value = check.positive("granularity", granularity)
        if math.frexp(value)[0] != 0.5:
            raise ValueError(
                f"granularity must be a power of two (1, 0.5, 2**-10, ...), got {granularity!r}"
            )
        return cls(Fraction(value))

    @classmethod
    def derived(cls, spread: float, sensitivity: float) -> Lattice:
        """The default lattice for a noise spread and a sensitivity (see module docstring)."""
        exponent = min(_floor_log2(spread) - _SUBDIVISION_BITS, _floor_log2(sensitivity))
        return cls(Fraction(2) ** exponent)

    @property
    def limit(self) -> float:
        """The largest |value| a snapped answer may have: MAX_UNITS lattice units."""
        return float(MAX_UNITS * self.granularity)

    def units(self, sensitivity: float) -> int:
        """The sensitivity in lattice units, rounded UP (exactly, in rationals)."""
        ratio = Fraction(sensitivity) / self.granularity
        return -((-ratio.numerator) // ratio.denominator)

    def in_units(self, spread: float) -> Fraction:
        """A noise spread in lattice units, exactly."""
        return Fraction(spread) / self.granularity

    def index(self, values: NDArray[np.float64]) -> NDArray[np.int64]:
        """The nearest lattice index of each finite value in ``[-limit, limit]``, ties up.

        ``u - floor(u)`` is exact for every float (Sterbenz), so the comparison with 1/2
        is the exact rounding rule, and it is monotone in ``u``.
        """
        scaled = values / float(self.granularity)  # exact: a power of two
        low = np.floor(scaled)
        return (low + (scaled - low >= 0.5)).astype(np.int64)

    def values(self, index: NDArray[np.int64]) -> np.ndarray:
        """Lattice indices as values: integers for an integer granularity, else floats."""
        if self.granularity.denominator == 1:
            step = int(self.granularity)
            # int64 holds MAX_UNITS * 2**10 with room for the noise; beyond, Python ints.
            out = index * step if step <= 2**10 else index.astype(object) * step
        else:
            out = index.astype(np.float64) * float(self.granularity)  # exact below 2**53
        return out
