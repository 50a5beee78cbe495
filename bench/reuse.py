"""Benchmark: what a re-run of a release costs when it is handed the stored answer, against
making the release (and keeping its answer), on both backends.

Run: ``.venv/bin/python bench/reuse.py [--subjects N] [--cells C] [--rounds R]``. A cohort of
N subjects is registered once; each round makes a new release over it (a new identity: the
map index moves), through the release service as the operator calls it, with an answer of
C cells, then re-runs that release. Prints the median seconds of each and the ratio
re-run / release, per backend. PostgreSQL must answer on the local server (the tests'
admin DSN, ``DP_BUDGET_TEST_PG``).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dp_budget_provider.accounting.answer_rule import AnswerRule
from dp_budget_provider.ledger import (
    BudgetCap,
    DeclaredRelease,
    PrivacyBudgetLedger,
    ReleaseGate,
    ReleaseResult,
    ReleaseSlot,
    make_release,
)
from dp_budget_provider.ledger.storage import clock
from tests.scratch_postgres import scratch_database  # noqa: E402

LOG = logging.getLogger("bench.reuse")
LOG.addHandler(logging.NullHandler())
LOG.propagate = False
START, END = datetime(2026, 7, 6, tzinfo=timezone.utc), datetime(2026, 7, 13, tzinfo=timezone.utc)


def timed(action: Callable[[], object]) -> tuple[float, object]:
    began = time.perf_counter()
    result = action()
    return time.perf_counter() - began, result


def measure(url: str, subjects: int, cells: int, rounds: int) -> tuple[float, float]:
    """Median seconds of a release and of its re-run on the ledger at ``url``."""
    ledger = PrivacyBudgetLedger(BudgetCap(1e6, 1e-5), url=url)
    try:
        gate = ReleaseGate(ledger, dag="bench")
        cohort = ledger.cohort([f"user-{i:07d}" for i in range(subjects)])
        keys = cohort.in_window("heatmap", "2026-w28")
        declared = DeclaredRelease(
            {"kind": "gaussian", "noise_multiplier": 50.0},
            "default",
            "heatmap",
            l2_sensitivity=1.0,
            granularity=1,
            rule=AnswerRule(cells=cells, integer=True, bounds=(0, 10**6)),
        )
        answer = list(range(cells))
        made, reused = [], []
        for round_ in range(rounds):
            slot = ReleaseSlot.over_interval("bench", "heatmap", round_, START, END, "q")
            for attempt, result, times in (
                ("a", ReleaseResult.released, made),
                ("b", ReleaseResult.reused, reused),
            ):
                seconds, outcome = timed(
                    lambda attempt=attempt, slot=slot, round_=round_: make_release(
                        gate,
                        declared,
                        keys,
                        lambda: answer,
                        attempt=f"bench/heatmap/r/{round_}/1/{attempt}",
                        log=LOG,
                        slot=slot,
                    )
                )
                assert outcome.result is result, outcome  # type: ignore[attr-defined]
                times.append(seconds)
        return statistics.median(made), statistics.median(reused)
    finally:
        ledger.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subjects", type=int, default=100_000)
    parser.add_argument("--cells", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    clock.now = lambda: datetime(2026, 7, 8, 12, tzinfo=timezone.utc)  # inside 2026-w28
    print(f"{args.subjects} subjects, answers of {args.cells} cells, {args.rounds} rounds")
    print(f"{'backend':<12}{'release s':>12}{'re-run s':>12}{'re-run/release':>16}")
    with tempfile.TemporaryDirectory() as folder:
        sqlite = measure(f"sqlite:///{folder}/ledger.db", args.subjects, args.cells, args.rounds)
    with scratch_database("dpb_bench_reuse") as (_, url):
        postgresql = measure(url, args.subjects, args.cells, args.rounds)
    for name, (made, reused) in (("sqlite", sqlite), ("postgresql", postgresql)):
        print(f"{name:<12}{made:>12.4f}{reused:>12.4f}{reused / made:>16.3f}")


if __name__ == "__main__":
    main()
