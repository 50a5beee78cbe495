"""Benchmark of the secure default noise on a 10**6-cell heatmap against numpy's float sampler.

Why: the default noise is exact discrete noise on a lattice, drawn from os.urandom; this
script shows what that costs relative to numpy's (non-exact, PCG64-driven) float
samplers measured in the same run, on the realistic shape of a 1000 x 1000 heatmap.

Rows (each the best of ``REPEATS``; "x numpy" divides by the numpy sampler of the same
family in this run):

* ``numpy normal`` / ``numpy laplace``: ``counts + rng.normal(0, sigma)`` (the baseline);
* ``lattice release``: ``NoisePlan.noisy_array`` for ``noise="lattice"`` at z = sigma
  (sensitivity 1, derived granularity): the answer rule, snapping, exact discrete noise;
* ``discrete_*_noise``: the integer samplers on the counts at sigma / scale (granularity 1);
* ``... rejection``: the same through the CKS rejection samplers (what large parameters use);
* ``unsafe_float_*``: the float samplers driven by os.urandom.

Table build time (once per parameter and process, cached) is printed separately.

Run ``python bench/noise.py``; other scripts can call ``run_noise_benchmark()``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np

from dp_budget_provider.accounting import GaussianMechanism, LaplaceMechanism
from dp_budget_provider.accounting import noise as samplers
from dp_budget_provider.accounting.answer_rule import AnswerRule
from dp_budget_provider.accounting.cdf_sampler import sampler_for
from dp_budget_provider.accounting.release import NoisePlan, plan_noise

SHAPE = (1000, 1000)
PARAMS = (5, 50)
REPEATS = 3


def _best_of(fn: Callable[[], Any]) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()  # production paths: seed=None, fresh OS entropy
        best = min(best, time.perf_counter() - start)
    return best


def _rejection_only(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    def run(*args: Any) -> np.ndarray:
        real = samplers.sampler_for
        samplers.sampler_for = lambda kind, parameter: None  # type: ignore[assignment]
        try:
            return fn(*args)
        finally:
            samplers.sampler_for = real

    return run


def _lattice_plans(param: float, cells: int) -> tuple[NoisePlan, NoisePlan]:
    """The operator's default plans for the counts (integer cells, sensitivity 1)."""
    rule = AnswerRule(cells=cells, integer=True)
    return (
        plan_noise(GaussianMechanism(param), l2_sensitivity=1.0, rule=rule),
        plan_noise(LaplaceMechanism(1.0 / param), l1_sensitivity=1.0, rule=rule),
    )


def _cases(counts: np.ndarray, param: float) -> list[tuple[str, Callable[[], Any], str]]:
    rng = np.random.default_rng()
    gauss, lap = _lattice_plans(param, counts.size)
    return [
        ("numpy normal", lambda: counts + rng.normal(0.0, param, SHAPE), "numpy normal"),
        ("numpy laplace", lambda: counts + rng.laplace(0.0, param, SHAPE), "numpy laplace"),
        ("lattice release, gaussian", lambda: gauss.noisy_array(counts), "numpy normal"),
        ("lattice release, laplace", lambda: lap.noisy_array(counts), "numpy laplace"),
        (
            "discrete_gaussian_noise",
            lambda: samplers.discrete_gaussian_noise(counts, param),
            "numpy normal",
        ),
        (
            "discrete_laplace_noise",
            lambda: samplers.discrete_laplace_noise(counts, param),
            "numpy laplace",
        ),
        (
            "discrete_gaussian rejection",
            lambda: _rejection_only(samplers.discrete_gaussian_noise)(counts, param),
            "numpy normal",
        ),
        (
            "discrete_laplace rejection",
            lambda: _rejection_only(samplers.discrete_laplace_noise)(counts, param),
            "numpy laplace",
        ),
        (
            "unsafe_float_gaussian_noise",
            lambda: samplers.unsafe_float_gaussian_noise(counts, param),
            "numpy normal",
        ),
        (
            "unsafe_float_laplace_noise",
            lambda: samplers.unsafe_float_laplace_noise(counts, param),
            "numpy laplace",
        ),
    ]


def table_build_seconds(param: float) -> dict[str, float]:
    """Cold build time of the tables the lattice releases at ``param`` use."""
    out = {}
    gauss, lap = _lattice_plans(param, math.prod(SHAPE))
    for name, plan, kind in (("gaussian", gauss, "gaussian"), ("laplace", lap, "laplace")):
        spread = plan.lattice.in_units(plan.spread)  # type: ignore[union-attr]
        parameter = spread * spread if kind == "gaussian" else Fraction(spread)
        sampler_for.cache_clear()
        start = time.perf_counter()
        sampler_for(kind, parameter)  # type: ignore[arg-type]
        out[name] = time.perf_counter() - start
    return out


def run_noise_benchmark() -> list[dict]:
    """Time every case at sigma = scale = 5 and 50; return one dict per row."""
    counts = np.random.default_rng(0).poisson(100, size=SHAPE).astype(np.int64)
    rows: list[dict] = []
    for param in PARAMS:
        cases = _cases(counts, param)
        for _, fn, _ in cases:
            fn()  # warm caches (tables) before timing: their build is reported apart
        seconds = {name: _best_of(fn) for name, fn, _ in cases}
        for name, _, baseline in cases:
            rows.append(
                {
                    "case": name,
                    "param": param,
                    "best_seconds": seconds[name],
                    "ns_per_cell": seconds[name] / counts.size * 1e9,
                    "baseline": baseline,
                    "ratio": seconds[name] / seconds[baseline],
                }
            )
    return rows


def main() -> None:
    print(f"noise benchmark: {SHAPE[0]}x{SHAPE[1]} int64 counts, best of {REPEATS}")
    header = f"{'case':<30} {'sigma/scale':>11} {'best s':>8} {'ns/cell':>8} {'x numpy':>8}"
    print(header)
    print("-" * len(header))
    for r in run_noise_benchmark():
        print(
            f"{r['case']:<30} {r['param']:>11} {r['best_seconds']:>8.4f} "
            f"{r['ns_per_cell']:>8.1f} {r['ratio']:>8.2f}"
        )
    for param in PARAMS:
        builds = table_build_seconds(param)
        print(
            f"table build (cold) at {param}: "
            + ", ".join(f"{k} {v:.3f} s" for k, v in builds.items())
        )


if __name__ == "__main__":
    main()
