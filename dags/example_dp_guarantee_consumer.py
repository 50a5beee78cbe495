"""Example: a DAG scheduled on a DP release's Asset reads the release's guarantee.

Each new ``weekly_visit_counts`` event (``example_dp_guarantee_producer``) starts a run.
The task declares the Asset as an inlet and reads the latest event's guarantee from
``inlet_events``: here it checks the release against a publication rule (exact lattice
noise, at most eps 1 per release) and writes the data card a catalogue would show. It
learns what the release cost and how noisy it is, not who is in it.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from airflow.sdk import DAG, Asset, task
from airflow.sdk.exceptions import AirflowFailException

WEEKLY_VISIT_COUNTS = Asset(name="weekly_visit_counts", uri="dp-release://acme/weekly-visit-counts")
MAX_EPSILON_PER_RELEASE = 1.0

with DAG(
    dag_id="example_dp_guarantee_consumer",
    schedule=[WEEKLY_VISIT_COUNTS],
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    tags=["dp-budget", "example"],
    doc_md=__doc__,
) as dag:

    @task(inlets=[WEEKLY_VISIT_COUNTS])
    def data_card(inlet_events: Any = None) -> dict[str, Any]:
        """The latest release's guarantee as a data card, if it meets the rule."""
        guarantee = inlet_events[WEEKLY_VISIT_COUNTS][-1].extra["dp_guarantee"]
        if guarantee["noise"] != "lattice" or guarantee["epsilon"] > MAX_EPSILON_PER_RELEASE:
            raise AirflowFailException(f"release {guarantee['reservation_id']} breaks the rule")
        size = guarantee["cohort_size"]
        return {
            "release": guarantee["reservation_id"],
            "windows": guarantee["windows"],
            "guarantee": f"({guarantee['epsilon']:.3g}, {guarantee['delta']:g})-DP",
            "noise_std": guarantee["noise_std"],
            "population": f"{size['at_least']} to {size['below'] - 1} people",
        }

    data_card()


if __name__ == "__main__":
    dag.test()
