"""What a DPAggregateOperator release costs against the same SQL aggregate run without DP.

Run: ``.venv/bin/python bench/aggregate.py`` (PostgreSQL at ``DP_BUDGET_TEST_PG``;
``--rows``, ``--units``, ``--rounds``, ``--profile``).

A visits table of ``--rows`` contribution rows (default 10^6) of ``--units`` persons
(default 10^5, ten rows each over the 16 cells of a 4 x 4 grid) is made with
``generate_series`` in a scratch PostgreSQL database; the ledger is another scratch
PostgreSQL database, as in a deployment. Timed, in alternating rounds:

* **baseline**: the plain ``GROUP BY`` count per cell over the same rows (the same WHERE
  on the data interval), fetched by SQLAlchemy: what the aggregate costs without DP.
* **bounded aggregate in SQL**: the same aggregate with its contribution bounds, computed
  in PostgreSQL without DP (the operator's bounded statement summed per cell in the
  server, 16 rows sent): what an aggregate that bounds each person's contribution costs
  before any privacy accounting, the second baseline.
* **bounded read**: the operator's own read without the ledger: the bounded query (window
  functions for the contribution bounds, rows in unit order) streamed through
  :class:`~dp_budget_provider.aggregation.BoundedRows` in the operator's read-only
  snapshot, every unit iterated and the cells added up.
* **first release**: the whole DPAggregateOperator task under ``dag.test()`` (as
  ``bench/operator.py`` runs its DAGs, on a throw-away Airflow home) on a new ledger
  database: the read, the 10^5 units streamed into the ledger as a new cohort,
  reservation, noise, commit, receipt.
* **repeat release**: the same task again with ``refresh`` (a fresh release, charged),
  over the cohort the ledger now holds.

The ratios are of medians over rounds, against the baseline measured in the same run.
Wall-clock times on a shared machine move with its load; nothing here asserts them.
``--profile`` runs one more first release under cProfile and prints where its time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib.util
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import sqlalchemy as sa

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
from tests.scratch_postgres import ledger_template, scratch_database  # noqa: E402

GOAL_RATIO = 3.0
GRID = [[row, col] for row in range(4) for col in range(4)]
SQL = (
    "SELECT person, cell_row, cell_col FROM visits "
    "WHERE visited_at >= :data_interval_start AND visited_at < :data_interval_end"
)
PLAIN_SQL = (
    "SELECT cell_row, cell_col, count(*) FROM visits "
    "WHERE visited_at >= :data_interval_start AND visited_at < :data_interval_end "
    "GROUP BY cell_row, cell_col"
)
BOUNDS = {"max_groups_per_unit": 4, "max_rows_per_group": 2}
DAG_SOURCE = """
from datetime import datetime, timezone

from airflow.sdk import DAG
from airflow.timetables.interval import CronDataIntervalTimetable

from dp_budget_provider.operators.aggregate import DPAggregateOperator

with DAG(
    "DAG_ID",
    schedule=CronDataIntervalTimetable("0 0 * * 1", timezone="UTC"),
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    params={{"refresh": False}},
) as dag:
    DPAggregateOperator(
        task_id="release_visits_heatmap",
        conn_id="visits_db",
        sql={sql!r},
        privacy_unit="person",
        group_by=["cell_row", "cell_col"],
        domain={grid!r},
        mechanism={{"kind": "gaussian", "noise_multiplier": 1000.0}},
        granularity=1,
        query_type="visits_heatmap",
        window={window!r},
        refresh="{{{{ params.refresh }}}}",
        **{bounds!r},
    )
"""


def sibling(name: str) -> ModuleType:
    """A module of bench/ by file (``bench/operator.py`` would shadow the standard
    library's ``operator`` as a module name)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench_operator = sibling("operator")
bench_ledger = sibling("ledger")


def make_visits(url: str, rows: int, units: int, start: datetime) -> None:
    """``rows`` visits of ``units`` persons (row i is person i mod units), spread over the
    grid's cells and over the week from ``start``, made in SQL (seconds, not minutes)."""
    engine = sa.create_engine(url)
    with engine.begin() as connection:
        connection.execute(
            sa.text(
                "CREATE TABLE visits AS SELECT "
                "'person-' || lpad((i % :units)::text, 7, '0') AS person, "
                "(i / :units) % 4 AS cell_row, (i * 7 + i / :units) % 4 AS cell_col, "
                ":start + (i % 604800) * interval '1 second' AS visited_at "
                "FROM generate_series(0, :rows - 1) AS i"
            ),
            {"rows": rows, "units": units, "start": start},
        )
        connection.execute(sa.text("ANALYZE visits"))
    engine.dispose()


def timed(function: Callable[[], Any]) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def plain_aggregate(engine: sa.Engine, interval: dict[str, datetime]) -> None:
    """Baseline: the count per cell without DP."""
    with engine.connect() as connection:
        cells = connection.execute(sa.text(PLAIN_SQL), interval).all()
    assert sum(count for *_, count in cells) > 0


def bounded_query() -> Any:
    """The operator's bounded query for the DAG's arguments."""
    from dp_budget_provider.aggregation import BoundedQuery, ContributionBounds

    bounds = ContributionBounds(BOUNDS["max_groups_per_unit"], BOUNDS["max_rows_per_group"])
    return BoundedQuery(SQL, "person", ("cell_row", "cell_col"), GRID, bounds)


def bounded_sql(engine: sa.Engine, interval: dict[str, datetime]) -> None:
    """The bounded aggregate computed in the server without DP: the operator's bounded
    statement summed per cell there, 16 rows sent."""
    query = bounded_query()
    with engine.connect() as connection:
        statement = query.statement(connection.dialect).text
        summed = sa.text(f"SELECT cell, sum(kept) FROM ({statement}) dpb_all GROUP BY cell")
        assert len(connection.execute(summed, query.parameters(interval)).all()) == 16


def bounded_read(engine: sa.Engine, interval: dict[str, datetime]) -> None:
    """The operator's read without the ledger: bounded rows streamed, units iterated."""
    from dp_budget_provider.aggregation import BoundedRows
    from dp_budget_provider.operators.aggregate import _snapshot

    query = bounded_query()
    with engine.connect() as connection, _snapshot(connection):
        rows = BoundedRows(connection, query, interval)
        units = sum(1 for _ in rows)
        assert units > 0 and rows.totals


@contextlib.contextmanager
def ledger_database() -> Iterator[str]:
    """A new PostgreSQL ledger, created by its administrator, behind the default
    dp_budget connection (as bench/operator.py's environment names it)."""
    from dp_budget_provider.ledger import AdminKey, PrivacyBudgetLedger

    with scratch_database("dpb_bench_agg_ledger", f"TEMPLATE {ledger_template()}") as (_, url):
        admin = AdminKey.generate()
        PrivacyBudgetLedger(bench_ledger.CAP, url=url, admin=admin).close()
        extra = {"url": url, "admin_public_key": admin.public.text}
        connection = json.dumps({"conn_type": "dpbudget", "extra": extra})
        with _environment("AIRFLOW_CONN_DP_BUDGET_DEFAULT", connection):
            yield url


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def release(dag: Any, logical_date: datetime, refresh: bool) -> float:
    """One whole release under dag.test(), charged (never handed a stored answer); wall
    seconds."""
    from tests.airflow.dag_runner import stored_xcom

    start = time.perf_counter()
    dag_run = bench_operator.quietly(
        lambda: dag.test(logical_date=logical_date, run_conf={"refresh": refresh})
    )
    wall = time.perf_counter() - start
    states = {str(ti.state) for ti in dag_run.get_task_instances()}
    if states != {"success"}:
        sys.exit(f"{dag.dag_id}: the release ended {states}")
    receipt = stored_xcom(dag_run, "release_visits_heatmap", "dp_budget_receipt")
    if receipt["reused"]:
        sys.exit(f"{dag.dag_id}: a timed release was handed a stored answer")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10**6, help="contribution rows")
    parser.add_argument("--units", type=int, default=10**5, help="distinct persons")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--profile", action="store_true", help="cProfile one first release")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="dp-budget-bench-aggregate-"))
    # A week whose windows the ledger still charges: the run reads last week's data, and
    # charges this ISO week (a past one takes no new release once its grace is over).
    now = datetime.now(timezone.utc)
    monday = (now - timedelta(days=now.weekday())).replace(
        hour=0, minute=0, second=0, microsecond=0
    )
    interval = {"data_interval_start": monday - timedelta(days=7), "data_interval_end": monday}
    try:
        with scratch_database("dpb_bench_agg_visits") as (name, source_url):
            print(f"making {args.rows:,} visits of {args.units:,} persons ...", file=sys.stderr)
            start = interval["data_interval_start"]
            made = timed(lambda: make_visits(source_url, args.rows, args.units, start))
            print(f"  made in {made:.1f} s", file=sys.stderr)
            # Airflow's environment, set before it is imported; the ledger connection it
            # names is a placeholder that each round replaces (ledger_database).
            bench_operator.prepare_airflow_home(home, "sqlite://", "")
            source = sa.make_url(source_url)
            visits_db = {
                "conn_type": "postgres",
                "host": source.host,
                "port": source.port,
                "login": source.username,
                "schema": name,
            }
            os.environ["AIRFLOW_CONN_VISITS_DB"] = json.dumps(visits_db)
            from tests.airflow.dag_runner import load_dag  # imports Airflow: after its home

            dag = load_dag(
                DAG_SOURCE.format(sql=SQL, grid=GRID, window=bench_ledger.WINDOW, bounds=BOUNDS),
                name="bench_dp_aggregate",
            )
            engine = sa.create_engine(source_url)
            samples: dict[str, list[float]] = {
                "baseline": [],
                "bounded aggregate in SQL": [],
                "bounded read": [],
                "first release": [],
                "repeat release": [],
            }
            # dag.test()'s first run in a process syncs and serialises the DAG: not timed.
            print("warm-up release ...", file=sys.stderr)
            with ledger_database():
                release(dag, monday, refresh=False)
            for round_ in range(args.rounds):
                samples["baseline"].append(timed(lambda: plain_aggregate(engine, interval)))
                samples["bounded aggregate in SQL"].append(
                    timed(lambda: bounded_sql(engine, interval))
                )
                samples["bounded read"].append(timed(lambda: bounded_read(engine, interval)))
                with ledger_database():
                    samples["first release"].append(release(dag, monday, refresh=False))
                    samples["repeat release"].append(release(dag, monday, refresh=True))
                print(
                    f"  round {round_ + 1}/{args.rounds}: "
                    + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in samples.items())
                    + f" (load average {bench_operator.load_average()})",
                    file=sys.stderr,
                )
            if args.profile:
                with ledger_database():
                    profile(dag, monday)
            engine.dispose()
    finally:
        shutil.rmtree(home, ignore_errors=True)
    report(samples, args)


def profile(dag: Any, logical_date: datetime) -> None:
    """Where a first release's time goes: the functions with the most cumulative time."""
    profiler = cProfile.Profile()
    profiler.enable()
    release(dag, logical_date, refresh=False)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats("dp_budget_provider", 30)  # the package's steps
    stats.sort_stats("tottime").print_stats(15)  # and where the CPU is spent, anywhere
    print(out.getvalue())


def report(samples: dict[str, list[float]], args: argparse.Namespace) -> None:
    base = statistics.median(samples["baseline"])
    print()
    print(
        f"DPAggregateOperator, count per cell of a 4x4 grid: {args.rows:,} contribution rows "
        f"of {args.units:,} units in PostgreSQL, PostgreSQL ledger; medians of {args.rounds} "
        f"rounds, load average {bench_operator.load_average()}"
    )
    print()
    bounded = statistics.median(samples["bounded aggregate in SQL"])
    print("| what | median s | min-max s | ratio to the plain GROUP BY | to the bounded SQL |")
    print("|---|---|---|---|---|")
    for name, values in samples.items():
        middle = statistics.median(values)
        print(
            f"| {name} | {middle:.2f} | {min(values):.2f}-{max(values):.2f} "
            f"| {middle / base:.2f} | {middle / bounded:.2f} |"
        )
    first = statistics.median(samples["first release"])
    print()
    for against, median in (("the plain aggregate", base), ("the bounded aggregate", bounded)):
        ratio = first / median
        verdict = "met" if ratio <= GOAL_RATIO else "NOT met"
        goal = f"whole first release <= {GOAL_RATIO:g}x {against} in SQL"
        print(f"Goal ({goal}): {verdict} ({ratio:.1f}x).")


if __name__ == "__main__":
    main()
