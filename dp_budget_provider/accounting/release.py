"""From a declared mechanism to the noise that is actually added, and what it is charged as.

The product adds noise itself, so the mechanism the ledger charges is, by construction,
the one that ran:

* ``noise="lattice"`` (the default): the answer is snapped to a lattice of power-of-two
  granularity (declared, or derived from the sensitivity and the noise spread) and exact
  integer noise is added in lattice units, from the OS's CSPRNG. A Gaussian release is a
  discrete Gaussian, charged as ``ZCDPMechanism(rho = units**2 / (2 sigma_units**2))``
  (Canonne, Kamath, Steinke 2020); a Laplace release is a discrete Laplace, charged as
  ``PureDPMechanism(units / scale_units)`` (its Rényi divergence is larger than the
  continuous Laplace curve). ``units`` is the sensitivity of the *snapped* answer in
  lattice units: the declared sensitivity rounded UP, plus what snapping a vector off the
  lattice may add (up to a unit per declared cell; ``Lattice.l1_units`` and
  ``Lattice.l2_units_squared`` prove the bounds). An answer declared ``integer=True`` on a
  lattice holding the integers is not moved by snapping and pays no such inflation.
* ``noise="unsafe_float"``: floating-point Gaussian or Laplace noise, charged as the
  continuous mechanism. Unsafe: the low bits of a float release depend on the input
  (Mironov 2012, "On significance of the least significant bits for differential
  privacy"), so the charge is not a guarantee for the code as it runs.

Before any noise the answer goes through its ``AnswerRule`` (NaN -> declared value,
clamp to declared bounds), so every attempt that touched the data ends in a noisy release.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

import numpy as np

from dp_budget_provider.accounting import noise as samplers
from dp_budget_provider.accounting import spread as spreads
from dp_budget_provider.accounting import validation as check
from dp_budget_provider.accounting.answer_rule import AnswerRule
from dp_budget_provider.accounting.lattice import Lattice, inflation_units
from dp_budget_provider.accounting.mechanisms import (
    GaussianMechanism,
    LaplaceMechanism,
    Mechanism,
    PureDPMechanism,
    ZCDPMechanism,
)
from dp_budget_provider.accounting.noise import MAX_DISCRETE_PARAMETER
from dp_budget_provider.accounting.rounding import float_at_least

NoiseKind = Literal["lattice", "unsafe_float"]
NOISE_KINDS: tuple[NoiseKind, ...] = ("lattice", "unsafe_float")

_RETIRED = {
    "float": "float noise leaks its input through its low bits (Mironov 2012)",
    "discrete": "integer noise is the lattice noise at granularity=1",
}

#: Largest |value| an unsafe_float release clamps to when no bounds are declared: far
#: below the float64 maximum, so adding noise cannot overflow to infinity.
_FLOAT_LIMIT = 2.0**1000


def check_noise(noise: object) -> NoiseKind:
    """The noise kind, or a ValueError that names the options (and why an old name went)."""
    if noise in NOISE_KINDS:
        return noise  # type: ignore[return-value]
    reason = f" ({_RETIRED[noise]})" if isinstance(noise, str) and noise in _RETIRED else ""
    raise ValueError(
        f"noise must be 'lattice' (exact discrete noise on a lattice; the default) or "
        f"'unsafe_float' (float noise, unsafe against floating-point attacks), got "
        f"{noise!r}{reason}"
    )


@dataclass(frozen=True)
class NoisePlan:
    """The noise a release adds and the mechanism the ledger charges for it.

    ``spread`` is sigma (Gaussian) or the scale (Laplace) in the answer's units;
    ``lattice`` is None for unsafe float noise.
    """

    charged: Mechanism
    family: Literal["gaussian", "laplace"]
    spread: float
    lattice: Lattice | None
    rule: AnswerRule

    @property
    def granularity(self) -> float | None:
        """The spacing of every value the release can output (None: float noise)."""
        return None if self.lattice is None else float(self.lattice.granularity)

    @property
    def noise_std(self) -> float:
        """The standard deviation of the noise added to each value, in the answer's units:
        of the distribution drawn (discrete on the lattice, continuous for unsafe float
        noise), which is what a reader of the release needs to judge its accuracy."""
        if self.lattice is None:
            std = spreads.gaussian_std if self.family == "gaussian" else spreads.laplace_std
            return std(self.spread)
        units = self.lattice.in_units(self.spread)
        if self.family == "gaussian":
            in_units = spreads.discrete_gaussian_std(units)
        else:
            in_units = spreads.discrete_laplace_std(units)
        return in_units * float(self.lattice.granularity)

    def add_noise(self, answer: Any, *, seed: int | None = None) -> Any:
        """The noisy release as plain JSON-serialisable Python (number or nested lists).

        ``seed`` is for tests only: fixed noise is not private.
        """
        noisy = self.noisy_array(answer, seed=seed)
        return noisy.item() if noisy.ndim == 0 else noisy.tolist()

    def noisy_array(self, answer: Any, *, seed: int | None = None) -> np.ndarray:
        """The noisy release as an array: the answer rule, then the noise."""
        if self.lattice is None:
            sampler = (
                samplers.unsafe_float_gaussian_noise
                if self.family == "gaussian"
                else samplers.unsafe_float_laplace_noise
            )
            return sampler(self.rule.apply(answer, _FLOAT_LIMIT), self.spread, seed=seed)
        index = self.lattice.index(self.rule.apply(answer, self.lattice.limit))
        draw = (
            samplers.sample_discrete_gaussian
            if self.family == "gaussian"
            else samplers.sample_discrete_laplace
        )
        noise = draw(self.lattice.in_units(self.spread), index.shape, seed=seed)
        return self.lattice.values(index + noise)


def plan_noise(
    mechanism: Mechanism,
    *,
    noise: NoiseKind = "lattice",
    l2_sensitivity: float | None = None,
    l1_sensitivity: float | None = None,
    granularity: float | None = None,
    rule: AnswerRule | None = None,
) -> NoisePlan:
    """The noise for ``mechanism`` at the declared sensitivity, or ValueError.

    Only Gaussian (L2) and Laplace (L1) mechanisms describe noise the operator can add;
    other mechanisms are accounting-only and refused here.
    """
    noise = check_noise(noise)
    rule = rule or AnswerRule()
    if isinstance(mechanism, GaussianMechanism):
        if l2_sensitivity is None:
            raise ValueError("a Gaussian release needs l2_sensitivity")
        sensitivity = check.positive("l2_sensitivity", l2_sensitivity)
        sigma = mechanism.noise_multiplier * sensitivity
        if noise == "unsafe_float":
            return NoisePlan(mechanism, "gaussian", sigma, None, rule)
        lattice = _lattice(granularity, sigma, sensitivity, "l2", rule)
        units_squared = lattice.l2_units_squared(sensitivity, _moved(lattice, rule))
        rho = Fraction(units_squared) / (2 * lattice.in_units(sigma) ** 2)
        charged = ZCDPMechanism(rho=float_at_least(rho))
        return NoisePlan(charged, "gaussian", sigma, lattice, rule)
    if isinstance(mechanism, LaplaceMechanism):
        if l1_sensitivity is None:
            raise ValueError("a Laplace release needs l1_sensitivity")
        sensitivity = check.positive("l1_sensitivity", l1_sensitivity)
        scale = sensitivity / mechanism.epsilon0
        if noise == "unsafe_float":
            return NoisePlan(mechanism, "laplace", scale, None, rule)
        lattice = _lattice(granularity, scale, sensitivity, "l1", rule)
        units = lattice.l1_units(sensitivity, _moved(lattice, rule))
        charged = PureDPMechanism(float_at_least(Fraction(units) / lattice.in_units(scale)))
        return NoisePlan(charged, "laplace", scale, lattice, rule)
    raise ValueError(
        f"the operator adds Gaussian or Laplace noise; {mechanism.kind!r} describes no noise to add"
    )


def _moved(lattice: Lattice, rule: AnswerRule) -> int:
    """How many cells snapping may move: none for integers on a lattice holding them, else all.

    An integer answer clamped to integer bounds (``AnswerRule`` insists) is on such a
    lattice, where snapping is the identity; any other answer may move in every cell.
    """
    return 0 if rule.integer and lattice.holds_integers else rule.cells


def _lattice(
    granularity: float | None, spread: float, sensitivity: float, norm: str, rule: AnswerRule
) -> Lattice:
    """The declared lattice (refused if the noise would not fit the samplers), else derived."""
    if granularity is None:
        inflation = 0.0 if rule.integer else inflation_units(norm, rule.cells)
        return Lattice.derived(spread, sensitivity, inflation, integers=rule.integer)
    lattice = Lattice.declared(granularity)
    if lattice.in_units(spread) > MAX_DISCRETE_PARAMETER:
        raise ValueError(
            f"granularity={granularity!r} puts the noise at {float(lattice.in_units(spread)):.3g} "
            f"lattice units, beyond the samplers' 2**40; declare a coarser granularity"
        )
    return lattice
