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
UP to lattice units. A vector answer *off* the lattice can move almost one unit more in
every cell that differs between neighbours, so the charge covers that too:
``l1_units`` and ``l2_units_squared`` bound the snapped answer's sensitivity from the
declared one and the number of cells snapping may move (``moved``: the declared cells,
or 0 for an answer already on the lattice, which snapping leaves unchanged).

Derived granularity: when the release does not declare one, it is the largest power of
two at most ``spread / 2**10``, at most the sensitivity and at most ``sensitivity /
(2**10 * inflation)``, where ``inflation`` is the units snapping may add on top of the
rounded-up sensitivity (``moved - 1`` in L1, ``sqrt(moved)`` in L2). So the noise spans
more than a thousand lattice units, rounding the sensitivity up costs a relative
``granularity / sensitivity`` at most, and the snapping inflation at most 1/1024 of the
sensitivity. A finer lattice means more noise in lattice units: past the certified CDF
tables (sigma about 2.8e4 units, Laplace scale about 6e3 units) the exact rejection
samplers run instead, slower but equally exact; declare a coarser ``granularity`` to
trade overhead for speed. The one floor: the noise never exceeds the samplers' 2**40
units (``MAX_DISCRETE_PARAMETER``); near it the granularity is coarsened, and the charge,
which is computed from the granularity actually used, grows accordingly.

Layering: standard library and numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from numpy.typing import NDArray

from dp_budget_provider.accounting import validation as check
from dp_budget_provider.accounting.noise import MAX_DISCRETE_PARAMETER

__all__ = ["MAX_UNITS", "Lattice", "inflation_units"]

#: Largest |lattice index| of a snapped answer; indices plus noise stay below 2**53.
MAX_UNITS: int = 2**52

_SUBDIVISION_BITS = 10
_NOISE_BITS = MAX_DISCRETE_PARAMETER.bit_length() - 1  # noise in units <= 2**40


def _floor_log2(value: float) -> int:
    """Exact floor(log2(value)) of a positive finite float."""
    return math.frexp(value)[1] - 1  # value = m * 2**e with m in [0.5, 1)


def _ceil_log2(value: float) -> int:
    """Exact ceil(log2(value)) of a positive finite float."""
    mantissa, exponent = math.frexp(value)
    return exponent - 1 if mantissa == 0.5 else exponent


def _ceil(ratio: Fraction) -> int:
    return -((-ratio.numerator) // ratio.denominator)


def inflation_units(norm: str, moved: int) -> float:
    """About how many lattice units snapping ``moved`` cells adds to the rounded-up sensitivity.

    Only for choosing a granularity (an estimate is enough there); the charge uses the
    exact bounds ``Lattice.l1_units`` and ``Lattice.l2_units_squared``.
    """
    if moved <= 1:
        return 0.0
    return float(moved - 1) if norm == "l1" else math.sqrt(moved)


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
    def derived(
        cls, spread: float, sensitivity: float, inflation: float = 0.0, integers: bool = False
    ) -> Lattice:
        """The default lattice for a noise spread and a sensitivity (see module docstring).

        ``inflation``: the units snapping may add (``inflation_units``); ``integers``: an
        integer answer, kept on the lattice (granularity at most 1) so snapping is exact.
        """
        exponent = min(_floor_log2(spread) - _SUBDIVISION_BITS, _floor_log2(sensitivity))
        if integers:
            exponent = min(exponent, 0)
        if inflation > 0:
            exponent = min(exponent, _floor_log2(sensitivity / inflation) - _SUBDIVISION_BITS)
        return cls(Fraction(2) ** max(exponent, _ceil_log2(spread) - _NOISE_BITS))

    @property
    def limit(self) -> float:
        """The largest |value| a snapped answer may have: MAX_UNITS lattice units."""
        return float(MAX_UNITS * self.granularity)

    def l1_units(self, sensitivity: float, moved: int) -> int:
        """The L1 sensitivity of the snapped answer in lattice units: ``ceil(D/g) + moved - 1``.

        ``moved`` is 0 when every value is on the lattice, else the number of cells.

        Proof. In lattice units, let two neighbouring answers be ``s`` and ``t`` with
        ``sum |s_i - t_i| <= x = D/g``. Snapping is ``floor(v + 1/2)``; since ``v - 1 <
        floor(v) <= v``, a cell moves by ``k_i = |snap(s_i) - snap(t_i)| < |s_i - t_i| + 1``,
        and by ``k_i = |s_i - t_i|`` if both values are on the lattice (snapping is the
        identity there). With ``m <= moved`` cells off the lattice and differing, the
        integer ``K = sum k_i`` satisfies ``K < x + m`` if ``m >= 1``, so ``K <= ceil(x + m)
        - 1 = ceil(x) + m - 1``; if ``m = 0``, ``K <= x <= ceil(x)``. For one cell this is
        the scalar bound ``ceil(x)``.
        """
        return _ceil(Fraction(sensitivity) / self.granularity) + max(moved - 1, 0)

    def l2_units_squared(self, sensitivity: float, moved: int) -> int:
        """The squared L2 sensitivity of the snapped answer in lattice units, exactly.

        ``ceil(D/g)**2`` when at most one cell moves (``moved`` 0: every value on the
        lattice; 1: a one-cell answer); else the largest integer strictly below
        ``(D/g + sqrt(moved))**2``, computed in integers.

        Proof. In lattice units write ``snap(v) = v + e(v)`` with ``e(v)`` in (-1/2, 1/2],
        and ``e(v) = 0`` on the lattice. For neighbours ``s, t`` with ``||s - t||_2 <= x =
        D/g`` the snapped difference is ``(s - t) + (e(s) - e(t))``; by the triangle
        inequality its norm is at most ``x + ||e(s) - e(t)||_2``, and ``|e(s_i) - e(t_i)| <
        1`` with equality to 0 where the cell does not move or does not differ, so
        ``||e(s) - e(t)||_2 < sqrt(moved)`` (moved >= 1). The squared snapped distance
        ``K`` is an integer below ``(x + sqrt(moved))**2``. With a single cell the snapped
        distance is an integer ``k <= ceil(x)`` (``k < x + 1``), and with none moved it is
        at most ``x``: either way ``K <= ceil(x)**2``.

        Exactness: ``x = p/q`` and ``(x + sqrt(c))**2 = (a + sqrt(N)) / q**2`` with ``a =
        p**2 + c q**2`` and ``N = 4 c p**2 q**2``; ``K q**2 - a < sqrt(N)`` holds for an
        integer iff it is at most ``isqrt(N - 1)``, the largest integer whose square is
        below ``N``. So ``K_max = (a + isqrt(N - 1)) // q**2``, no float involved.
        """
        ratio = Fraction(sensitivity) / self.granularity
        if moved <= 1:
            return _ceil(ratio) ** 2
        p, q = ratio.numerator, ratio.denominator
        a = p * p + moved * q * q
        return (a + math.isqrt(4 * moved * p * p * q * q - 1)) // (q * q)

    @property
    def holds_integers(self) -> bool:
        """Whether every integer is on the lattice (granularity 1, 1/2, 1/4, ...)."""
        return self.granularity <= 1

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
