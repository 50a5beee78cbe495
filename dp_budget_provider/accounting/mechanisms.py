"""Privacy mechanisms as frozen, validated value objects with their Rényi-DP curves.

A mechanism here is *what happened* (the dp_accounting notion of an event): its
parameters and nothing else. How the losses add up is the accountant's job. Every
mechanism serialises to a small JSON spec because the ledger writes the spec of
each release into its append-only history, and must be able to read it back.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np

from dp_budget_provider.accounting import validation as check
from dp_budget_provider.accounting.laplace import laplace_rdp
from dp_budget_provider.accounting.rounding import SMALLEST_NORMAL, dot_up, not_vanishing
from dp_budget_provider.accounting.subsampled_gaussian import poisson_subsampled_gaussian_rdp

_REGISTRY: dict[str, type[Mechanism]] = {}


class Mechanism(ABC):
    """A differentially private release whose Rényi-DP curve is known."""

    kind: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _REGISTRY[cls.kind] = cls

    @abstractmethod
    def rdp(self, orders: np.ndarray) -> np.ndarray:
        """RDP(alpha) of one invocation at each order (all orders > 1)."""

    @property
    def zcdp_rho(self) -> float | None:
        """rho when the curve is exactly rho * alpha (rho-zCDP), else None.

        Linear curves compose as one number, so an account (or a release over ten
        thousand subjects) holding only them is stored and updated as a scalar.
        """
        return None

    @classmethod
    def composed_rdp(
        cls, mechanisms: Sequence[Mechanism], counts: np.ndarray, orders: np.ndarray
    ) -> np.ndarray:
        """Summed curve of ``counts[i]`` invocations of ``mechanisms[i]`` (all of this class),
        never below the exact sum of their float curves (``rounding.dot_up``)."""
        return dot_up(counts, cls.curves(mechanisms, orders))

    @classmethod
    def curves(cls, mechanisms: Sequence[Mechanism], orders: np.ndarray) -> np.ndarray:
        """The curves of ``mechanisms`` (all of this class) on ``orders``, one per row.

        Subclasses with a vectorisable closed form override this; composing ten
        thousand releases is then a handful of numpy operations, not ten thousand.
        """
        return np.stack([mechanism.rdp(orders) for mechanism in mechanisms])

    def to_spec(self) -> dict[str, Any]:
        """JSON-serialisable description: ``{"kind": ..., <parameters>}``."""
        spec: dict[str, Any] = {"kind": self.kind}
        spec.update({f.name: getattr(self, f.name) for f in fields(self)})  # type: ignore[arg-type]
        return spec

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Mechanism:
        """Rebuild a mechanism from :meth:`to_spec` output, validating every field.

        Called on the base class it dispatches on ``spec["kind"]``; called on a
        subclass it also insists the spec is of that kind.
        """
        if not isinstance(spec, Mapping):
            raise ValueError(f"mechanism spec must be a mapping, got {spec!r}")
        kind = spec.get("kind")
        target = _REGISTRY.get(kind) if isinstance(kind, str) else None
        if target is None:
            known = ", ".join(sorted(_REGISTRY))
            raise ValueError(f"unknown mechanism kind {kind!r} (known: {known})")
        if cls is not Mechanism and target is not cls:
            raise ValueError(f"spec is of kind {kind!r}, expected {cls.kind!r}")
        params = {key: value for key, value in spec.items() if key != "kind"}
        expected = {f.name for f in fields(target)}  # type: ignore[arg-type]
        if set(params) != expected:
            raise ValueError(
                f"{kind} spec needs exactly the fields {sorted(expected)}, got {sorted(params)}"
            )
        return target(**params)


@dataclass(frozen=True)
class GaussianMechanism(Mechanism):
    """Gaussian noise with ``noise_multiplier = sigma / L2-sensitivity``.

    RDP(alpha) = alpha / (2 z^2), i.e. rho-zCDP with rho = 1 / (2 z^2) (Mironov 2017).
    """

    kind: ClassVar[str] = "gaussian"
    noise_multiplier: float

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "noise_multiplier", check.positive("noise_multiplier", self.noise_multiplier)
        )

    @classmethod
    def from_sigma(cls, sigma: float, l2_sensitivity: float) -> GaussianMechanism:
        """The mechanism adding N(0, sigma^2) to a query of the given L2 sensitivity."""
        sigma = check.positive("sigma", sigma)
        l2_sensitivity = check.positive("l2_sensitivity", l2_sensitivity)
        return cls(noise_multiplier=sigma / l2_sensitivity)

    @property
    def zcdp_rho(self) -> float:
        """1 / (2 z^2), never below the exact value: +inf where z^2 underflows (z below
        ~1e-162: no cap grants it), rounded up where it underflows (z above ~1e154: a 0
        would under-count; for larger z the cost is still granted by any cap)."""
        square = _square(self.noise_multiplier)
        if square == 0.0:
            return math.inf
        double = 2.0 * square
        return _not_underflowed(1.0 / double if double < math.inf else 0.5 / square)

    def mu_squared(self, count: int) -> float:
        """count / z^2: this release's part of the composition's Gaussian mu^2 (same rules)."""
        square = _square(self.noise_multiplier)
        return _not_underflowed(count / square) if square else math.inf

    def rdp(self, orders: np.ndarray) -> np.ndarray:
        return np.asarray(orders, dtype=np.float64) * self.zcdp_rho


def _square(value: float) -> float:
    """value**2 (the expression every stored cost was computed with), +inf on overflow."""
    try:
        return value**2
    except OverflowError:
        return math.inf


def _not_underflowed(value: float) -> float:
    """``value`` where it is a normal double; rounded up where it underflowed (to a
    subnormal, which keeps few digits, or to 0), so that it stays an upper bound."""
    return value if value >= SMALLEST_NORMAL else math.nextafter(value, math.inf)


@dataclass(frozen=True)
class LaplaceMechanism(Mechanism):
    """Continuous Laplace noise with ``epsilon0 = L1-sensitivity / scale``; its exact RDP
    curve to 2^-46 relative (``accounting.laplace``).

    Not valid for *discrete* Laplace noise, whose Rényi divergence is larger: account
    that as :class:`PureDPMechanism`.
    """

    kind: ClassVar[str] = "laplace"
    epsilon0: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon0", check.positive("epsilon0", self.epsilon0))

    @classmethod
    def from_scale(cls, scale: float, l1_sensitivity: float) -> LaplaceMechanism:
        """The mechanism adding Laplace(scale) noise to a query of the given L1 sensitivity."""
        scale = check.positive("scale", scale)
        l1_sensitivity = check.positive("l1_sensitivity", l1_sensitivity)
        return cls(epsilon0=l1_sensitivity / scale)

    def rdp(self, orders: np.ndarray) -> np.ndarray:
        return laplace_rdp(np.array([self.epsilon0]), orders)[0]

    @classmethod
    def curves(cls, mechanisms: Sequence[Mechanism], orders: np.ndarray) -> np.ndarray:
        eps0 = np.array([m.epsilon0 for m in mechanisms])  # type: ignore[attr-defined]
        return laplace_rdp(eps0, orders)


def _pure_dp_rdp(epsilon0: float, orders: np.ndarray) -> np.ndarray:
    """Worst-case RDP of an eps0-DP mechanism: that of randomised response, exactly.

    Every eps0-DP pair of output distributions is a post-processing of binary randomised
    response with parameter eps0 (Kairouz-Oh-Viswanath 2015), so by data processing its
    Rényi divergence is at most RR's,
    D_a = log(cosh((a - 1/2) eps0) / cosh(eps0 / 2)) / (a - 1)
        = log1p(2 sinh(a eps0 / 2) sinh((a - 1) eps0 / 2) / cosh(eps0 / 2)) / (a - 1).
    The second form has no cancellation: its log1p argument is evaluated in log space,
    L = (a-1) eps0 + log(-expm1(-a eps0)) + log(-expm1(-(a-1) eps0)) - log1p(e^{-eps0}),
    each part to a few ulps of its magnitude, so D_a is accurate to a few ulps for every
    eps0 and order (the earlier difference of two log1p's lost everything at eps0 ~ 1e-8,
    and a minimum with eps0^2 a / 2 could not repair what it did not see). D_a never
    exceeds a eps0^2 / 2 (Bun-Steinke) nor eps0. Below the normal range (eps0 under
    ~1e-154, where L underflows to -inf below ~1e-163) the value is raised, before and
    after the division, by ``rounding.not_vanishing``: an eps0 > 0 always leaks.
    """
    a = orders
    with np.errstate(divide="ignore"):  # only at eps0 * (a - 1) below the smallest double
        log_argument = (
            (a - 1.0) * epsilon0
            + np.log(-np.expm1(-a * epsilon0))
            + np.log(-np.expm1(-(a - 1.0) * epsilon0))
            - math.log1p(math.exp(-epsilon0))
        )
    return not_vanishing(not_vanishing(np.logaddexp(0.0, log_argument)) / (a - 1.0))


@dataclass(frozen=True)
class PureDPMechanism(Mechanism):
    """Any pure epsilon0-DP release (discrete Laplace, randomised response, ...).

    Its curve is the worst case over all eps0-DP mechanisms (randomised response), so it
    is valid for every one of them; it is never above a eps0^2 / 2 (the eps0^2/2-zCDP
    bound) nor above eps0. For continuous Laplace noise :class:`LaplaceMechanism` is tighter.
    """

    kind: ClassVar[str] = "pure_dp"
    epsilon0: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon0", check.positive("epsilon0", self.epsilon0))

    def rdp(self, orders: np.ndarray) -> np.ndarray:
        return _pure_dp_rdp(self.epsilon0, np.asarray(orders, dtype=np.float64))


@dataclass(frozen=True)
class ZCDPMechanism(Mechanism):
    """A rho-zCDP release (e.g. discrete Gaussian noise, Canonne-Kamath-Steinke 2020).

    RDP(alpha) = rho * alpha.
    """

    kind: ClassVar[str] = "zcdp"
    rho: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "rho", check.positive("rho", self.rho))

    @property
    def zcdp_rho(self) -> float:
        return self.rho

    def rdp(self, orders: np.ndarray) -> np.ndarray:
        return np.asarray(orders, dtype=np.float64) * self.rho


@dataclass(frozen=True)
class PoissonSubsampledGaussianMechanism(Mechanism):
    """Gaussian noise on a Poisson subsample with rate ``sampling_rate`` (DP-SGD steps).

    Curve from Mironov, Talwar and Zhang 2019; equal to dp_accounting's
    ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``.
    """

    kind: ClassVar[str] = "poisson_subsampled_gaussian"
    noise_multiplier: float
    sampling_rate: float

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "noise_multiplier", check.positive("noise_multiplier", self.noise_multiplier)
        )
        object.__setattr__(
            self, "sampling_rate", check.half_open_unit("sampling_rate", self.sampling_rate)
        )

    def rdp(self, orders: np.ndarray) -> np.ndarray:
        return poisson_subsampled_gaussian_rdp(
            self.noise_multiplier, self.sampling_rate, np.asarray(orders, dtype=np.float64)
        )


__all__ = [
    "GaussianMechanism",
    "LaplaceMechanism",
    "Mechanism",
    "PoissonSubsampledGaussianMechanism",
    "PureDPMechanism",
    "ZCDPMechanism",
]
