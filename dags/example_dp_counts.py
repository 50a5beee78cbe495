"""Example: daily visit counts per district with exact discrete Laplace noise.

Counts are integers, so the release declares granularity 1: the noise is exact discrete
Laplace noise on the integers (no floating point, so no low bits to attack), the outputs
stay integers and the release is charged as pure eps0-DP. It declares ``cells=6`` (the
districts) and ``integer=True``: counts are on the lattice, so snapping moves nothing and
nothing is charged for it. Each subject is
counted at most once per district (L1 sensitivity = number of districts a subject may
appear in, here 1 after clipping).
"""

from __future__ import annotations

from datetime import datetime, timezone

from airflow.sdk import DAG

from dp_budget_provider.operators.release import DPReleaseOperator


def district_counts() -> list[int]:
    """Exact, clipped counts (synthetic)."""
    return [120, 87, 45, 3, 0, 61]


with DAG(
    dag_id="example_dp_counts",
    schedule="@daily",
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    tags=["dp-budget", "example"],
    doc_md=__doc__,
) as dag:
    DPReleaseOperator(
        task_id="release_district_counts",
        python_callable=district_counts,
        mechanism={"kind": "laplace", "epsilon0": 0.5},
        l1_sensitivity=1.0,
        granularity=1,
        cells=6,
        integer=True,
        bounds=(0, 10_000),
        subject="city:metropolis",
        query_type="district-counts",
        tenant="acme",
    )


if __name__ == "__main__":
    dag.test()
