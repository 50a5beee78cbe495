"""From a declared mechanism to the noise that is actually added, and what it is charged as.

The product adds noise itself, so the mechanism the ledger charges is, by construction,
the one that ran. Continuous Gaussian noise is charged as ``GaussianMechanism`` (exact
analytical bound available); discrete Gaussian noise as ``ZCDPMechanism`` (Canonne,
Kamath, Steinke 2020 prove rho-zCDP, not the continuous curve); continuous Laplace as
``LaplaceMechanism``; discrete Laplace as ``PureDPMechanism`` (its Rényi divergence is
larger than the continuous Laplace curve).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from dp_budget_provider.accounting import noise as samplers
from dp_budget_provider.accounting import validation as check
from dp_budget_provider.accounting.mechanisms import (
    GaussianMechanism,
    LaplaceMechanism,
    Mechanism,
    PureDPMechanism,
    ZCDPMechanism,
)

NoiseKind = Literal["float", "discrete"]
NOISE_KINDS: tuple[NoiseKind, ...] = ("float", "discrete")


@dataclass(frozen=True)
class NoisePlan:
    """The noise a release adds and the mechanism the ledger charges for it."""

    charged: Mechanism
    family: Literal["gaussian", "laplace"]
    scale: float
    discrete: bool

    def add_noise(self, values: Any, *, seed: int | None = None) -> Any:
        """The noisy release as plain JSON-serialisable Python (number or nested lists).

        ``seed`` is for tests only: fixed noise is not private.
        """
        if self.family == "gaussian":
            sampler = samplers.discrete_gaussian_noise if self.discrete else samplers.gaussian_noise
        else:
            sampler = samplers.discrete_laplace_noise if self.discrete else samplers.laplace_noise
        noisy = np.asarray(sampler(values, self.scale, seed=seed))
        return noisy.item() if noisy.ndim == 0 else noisy.tolist()


def charged_gaussian(noise: NoiseKind) -> Callable[[float], Mechanism]:
    """What a Gaussian release with noise multiplier z is charged as, for this noise kind."""
    if noise == "discrete":
        return lambda z: ZCDPMechanism(rho=1.0 / (2.0 * z * z))
    return GaussianMechanism


def plan_noise(
    mechanism: Mechanism,
    *,
    noise: NoiseKind = "float",
    l2_sensitivity: float | None = None,
    l1_sensitivity: float | None = None,
) -> NoisePlan:
    """The noise for ``mechanism`` at the declared sensitivity, or ValueError.

    Only Gaussian (L2) and Laplace (L1) mechanisms describe noise the operator can add;
    other mechanisms are accounting-only and refused here.
    """
    if noise not in NOISE_KINDS:
        raise ValueError(f"noise must be one of {NOISE_KINDS}, got {noise!r}")
    discrete = noise == "discrete"
    if isinstance(mechanism, GaussianMechanism):
        if l2_sensitivity is None:
            raise ValueError("a Gaussian release needs l2_sensitivity")
        sigma = mechanism.noise_multiplier * check.positive("l2_sensitivity", l2_sensitivity)
        charged = charged_gaussian(noise)(mechanism.noise_multiplier)
        return NoisePlan(charged, "gaussian", sigma, discrete)
    if isinstance(mechanism, LaplaceMechanism):
        if l1_sensitivity is None:
            raise ValueError("a Laplace release needs l1_sensitivity")
        scale = check.positive("l1_sensitivity", l1_sensitivity) / mechanism.epsilon0
        charged = PureDPMechanism(mechanism.epsilon0) if discrete else mechanism
        return NoisePlan(charged, "laplace", scale, discrete)
    raise ValueError(
        f"the operator adds Gaussian or Laplace noise; {mechanism.kind!r} describes no noise to add"
    )
