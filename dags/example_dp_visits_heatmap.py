"""Example: a weekly heatmap of visits, read by the release itself from a visits table.

``DPAggregateOperator`` runs the query below on connection ``visits_db``, a PostgreSQL
database apart from the ledger's, and releases the number of visits in each cell of a
4 x 4 grid for the run's data interval (last week). The contribution bounds run in that
database's SQL: a person counts in at most 4 cells, with at most 2 visits in each, so the
sensitivity is derived (L2 = 2 * sqrt(4) = 4), never declared. The people charged are the
persons of the bounded rows, registered as the release's cohort in the same task: nobody
counted goes uncharged, and no separate list can disagree with the data.

Set up the source (any PostgreSQL database other than the ledger's)::

    createdb visits
    psql visits -c "CREATE TABLE visits (person TEXT NOT NULL, cell_row INTEGER NOT NULL,
                    cell_col INTEGER NOT NULL, visited_at TIMESTAMPTZ NOT NULL)"
    export AIRFLOW_CONN_VISITS_DB='{"conn_type": "postgres", "host": "db.internal",
        "login": "reader", "password": "...", "schema": "visits"}'

(the read runs in a ``REPEATABLE READ READ ONLY`` transaction: a role that may only read
the table is enough). The ledger is the ``dp_budget_default`` connection as for every
release (docs/deploying.md). The embedded demo (``scripts/demo.sh``) points ``visits_db``
at a SQLite file instead: the same DAG, another Airflow connection type.
"""

from __future__ import annotations

from datetime import datetime, timezone

from airflow.sdk import DAG
from airflow.timetables.interval import CronDataIntervalTimetable

from dp_budget_provider.operators.aggregate import DPAggregateOperator

# The public domain: every cell of the grid, in the order the values are released.
GRID = [[row, col] for row in range(4) for col in range(4)]
VISITS_SQL = """
SELECT person, cell_row, cell_col FROM visits
WHERE visited_at >= :data_interval_start AND visited_at < :data_interval_end
"""

with DAG(
    dag_id="example_dp_visits_heatmap",
    schedule=CronDataIntervalTimetable("0 0 * * 1", timezone="UTC"),  # each run: last week
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    # As example_dp_heatmap: window empty charges the windows of the run's data interval;
    # refresh releases a week already released again (charged) instead of reusing it.
    params={"tenant": "acme", "window": "", "refresh": False},
    tags=["dp-budget", "example"],
    doc_md=__doc__,
) as dag:
    DPAggregateOperator(
        task_id="release_visits_heatmap",
        conn_id="visits_db",
        sql=VISITS_SQL,
        privacy_unit="person",
        group_by=["cell_row", "cell_col"],
        domain=GRID,
        aggregate="count",
        max_groups_per_unit=4,
        max_rows_per_group=2,
        mechanism={"kind": "gaussian", "noise_multiplier": 3.0},
        granularity=1,  # counts are integers: exact discrete Gaussian noise on them
        query_type="visits_heatmap",
        tenant="{{ params.tenant }}",
        window="{{ params.window }}",
        refresh="{{ params.refresh }}",
    )


if __name__ == "__main__":
    dag.test()
