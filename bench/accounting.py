"""Benchmark: compose 10^4 heterogeneous releases and convert, ours vs dp_accounting.

Run: ``.venv/bin/python bench/accounting.py``. Both accountants get the same events
in the same process; the script prints both times, their ratio and both epsilons,
then times the noise samplers on a 10^6-cell release (bench/noise.py).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as oracle

from dp_budget_provider.accounting import GaussianMechanism, LaplaceMechanism, RDPAccountant
from dp_budget_provider.accounting.conversion import rdp_to_epsilon

RELEASES = 10_000
DELTA = 1e-5


def make_releases(seed: int = 7) -> list:
    rng = np.random.default_rng(seed)
    releases = []
    for i in range(RELEASES):
        if i % 2:
            releases.append(GaussianMechanism(float(rng.uniform(20.0, 400.0))))
        else:
            releases.append(LaplaceMechanism(float(rng.uniform(1e-4, 5e-3))))
    return releases


def to_event(mechanism):
    if isinstance(mechanism, GaussianMechanism):
        return dp_event.GaussianDpEvent(mechanism.noise_multiplier)
    return dp_event.LaplaceDpEvent(1.0 / mechanism.epsilon0)


def best_of(repeats, fn):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def ours_batched(releases):
    accountant = RDPAccountant()
    accountant.compose_many(releases)
    return accountant.get_epsilon(DELTA)[0], accountant


def ours_one_by_one(releases):
    accountant = RDPAccountant()
    for mechanism in releases:
        accountant.compose(mechanism)
    return accountant.get_epsilon(DELTA)[0], accountant


def theirs(events):
    accountant = oracle.RdpAccountant()
    for event in events:
        accountant.compose(event)
    return accountant.get_epsilon(DELTA)


def main() -> None:
    releases = make_releases()
    events = [to_event(m) for m in releases]
    t_theirs, eps_theirs = best_of(1, lambda: theirs(events))
    t_batch, (eps_batch, acc) = best_of(5, lambda: ours_batched(releases))
    t_loop, (eps_loop, _) = best_of(3, lambda: ours_one_by_one(releases))
    rdp_only = rdp_to_epsilon(acc.orders, acc.rdp, DELTA)[0]
    print(
        f"{RELEASES} releases (half Gaussian z~U[20,400], half Laplace eps0~U[1e-4,5e-3]),"
        f" delta={DELTA}"
    )
    print(f"dp_accounting RdpAccountant      : {t_theirs:8.4f} s  eps={eps_theirs!r}")
    print(
        f"ours, compose_many (batched)     : {t_batch:8.4f} s  eps={eps_batch!r}"
        f"  speed-up {t_theirs / t_batch:6.1f}x"
    )
    print(
        f"ours, compose() one at a time    : {t_loop:8.4f} s  eps={eps_loop!r}"
        f"  speed-up {t_theirs / t_loop:6.1f}x"
    )
    print(
        f"relative eps difference (ours vs oracle): {abs(eps_batch - eps_theirs) / eps_theirs:.2e}"
        f" (RDP-only eps {rdp_only!r})"
    )
    sys.path.insert(0, str(Path(__file__).parent))
    import noise  # noqa: PLC0415

    print()
    noise.main()


if __name__ == "__main__":
    main()
