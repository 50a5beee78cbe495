"""example_dp_rescoring: a trajectory release costs more than a snapshot release."""

from __future__ import annotations

from pathlib import Path

import pytest

from dp_budget_provider.accounting import Mechanism
from dp_budget_provider.accounting.release import plan_noise
from tests.airflow.dag_runner import load_dag

EXAMPLE = Path(__file__).resolve().parents[2] / "dags" / "example_dp_rescoring.py"


def charged_rho(task) -> float:
    """The zCDP rho the operator reserves for one release (lattice noise, as it runs)."""
    plan = plan_noise(
        Mechanism.from_spec(task.mechanism), noise=task.noise, l2_sensitivity=task.l2_sensitivity
    )
    return plan.charged.rho


def test_the_trajectory_release_has_the_larger_sensitivity_and_pays_for_it():
    dag = load_dag(EXAMPLE.read_text())
    snapshot, trajectory = dag.get_task("release_snapshot"), dag.get_task("release_trajectory")
    assert trajectory.l2_sensitivity == 2 * snapshot.l2_sensitivity
    sigma = [t.mechanism["noise_multiplier"] * t.l2_sensitivity for t in (snapshot, trajectory)]
    assert sigma[0] == sigma[1]  # the same noise on a query that moves twice as much
    assert charged_rho(trajectory) == pytest.approx(4 * charged_rho(snapshot), rel=1e-3)
