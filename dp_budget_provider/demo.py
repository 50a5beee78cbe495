"""The README's demo: a Gaussian release repeated against a cap, with warning and refusal.

Run with ``python -m dp_budget_provider.demo``. It shows the accounting the ledger
enforces: the prospective check on a copy of the account, the warning at 80% of the
cap, and the refusal that leaves the account untouched.
"""

from __future__ import annotations

from dp_budget_provider.accounting import GaussianMechanism, RDPAccountant

CAP_EPSILON = 3.0
DELTA = 1e-5
WARN_FRACTION = 0.8


def main() -> None:
    """Release until the next release would pass the cap, printing every step."""
    account = RDPAccountant()
    release = GaussianMechanism(noise_multiplier=4.0)
    print(f"cap eps={CAP_EPSILON} at delta={DELTA}; each release: {release.to_spec()}")
    number = 0
    while True:
        trial = account.copy()
        trial.compose(release)
        bound = trial.epsilon_bound(DELTA)
        if bound.epsilon > CAP_EPSILON:
            print(
                f"release {number + 1}: REFUSED, would reach eps={bound.epsilon:.4f} "
                f"> cap {CAP_EPSILON}; account stays at eps={account.get_epsilon(DELTA)[0]:.4f}"
            )
            break
        account = trial
        number += 1
        warn = (
            "  <-- WARNING: past 80% of the cap"
            if bound.epsilon >= WARN_FRACTION * CAP_EPSILON
            else ""
        )
        print(f"release {number}: eps={bound.epsilon:.4f} ({bound.method}){warn}")


if __name__ == "__main__":
    main()
