"""DPAggregateOperator under dag.test() on a real Airflow metadata database: a source apart
from the ledger (a PostgreSQL database or a SQLite file, each through a real Airflow
connection of its type and that type's hook), with the ledger on SQLite and PostgreSQL.
The released counts and means are the bounded ones (tiny noise under a huge cap, so the
lattice noise is 0) with their error bars, the units of the bounded rows are exactly the
subjects charged, a query that writes is refused by the read-only snapshot and charges
nothing, a re-run is handed the stored answer while a change of bounds is another
release, and ``accuracy`` charges the mechanism it planned."""

from __future__ import annotations

import json
import sqlite3
import uuid
from datetime import datetime, timezone

import pendulum
import pytest
import sqlalchemy as sa
from sqlalchemy.pool import Pool

from dp_budget_provider.ledger import Policy, key_for
from tests.airflow.dag_runner import aggregate_dag, load_dag, stored_xcom, task_states
from tests.scratch_postgres import source_engine

pytestmark = pytest.mark.heavy  # long: xdist starts it first (tests/conftest.py)

WINDOW = "2026-w28"
LEDGER_WINDOWS = (WINDOW,)
MONDAY = datetime(2026, 7, 13, tzinfo=timezone.utc)  # this run reads 2026-w28
IN_WEEK = datetime(2026, 7, 8, 12, tzinfo=timezone.utc)
DOMAIN = [[0, "a"], [0, "b"], [1, "a"]]
# (person, row, col, day, minutes): ann contributes to three cells and thrice to one; bob
# once; cyd only outside the domain; dan only outside the data interval.
VISITS = [
    ("ann", 0, "a", IN_WEEK, 3),
    ("ann", 0, "a", IN_WEEK, 20),
    ("ann", 0, "a", IN_WEEK, 7),
    ("ann", 0, "b", IN_WEEK, 4),
    ("ann", 1, "a", IN_WEEK, 1),
    ("bob", 1, "a", IN_WEEK, 9),
    ("cyd", 9, "z", IN_WEEK, 5),
    ("dan", 0, "a", datetime(2026, 6, 1, tzinfo=timezone.utc), 5),
]
TINY = 'mechanism={"kind": "gaussian", "noise_multiplier": 0.01}, granularity=1'

SQL = (
    'SELECT person, "row", col, minutes FROM visits '
    "WHERE day >= :data_interval_start AND day < :data_interval_end"
)


def plant_on_sqlite(dbapi_connection, _record) -> None:
    """SQLite has no stored functions: the functions a query calls are the connecting
    application's. This one writes as the query reads, as ``plant()`` does on PostgreSQL
    (one row, else a scan of visits would read the rows it adds, without end)."""
    if isinstance(dbapi_connection, sqlite3.Connection):
        planting = (
            "INSERT INTO visits SELECT 'eve', 0, 'a', '2026-07-08 12:00:00+00:00', 0 "
            "WHERE NOT EXISTS (SELECT 1 FROM visits WHERE person = 'eve')"
        )
        dbapi_connection.create_function(
            "plant", 0, lambda: dbapi_connection.execute(planting).rowcount * 0 + 1
        )


def stored(day: datetime, engine: sa.Engine) -> datetime | str:
    """A timestamp as the source keeps it: SQLite as UTC ISO 8601 text (docs/operators.md)."""
    return day.isoformat(" ") if engine.dialect.name == "sqlite" else day


@pytest.fixture(params=["postgresql", "sqlite"])
def source(request, tmp_path, monkeypatch):
    """The visits table in a database of its own (a PostgreSQL database or a SQLite file),
    as connection ``visits_db`` of its type, which the operator reaches through the
    connection's own hook."""
    with source_engine(request.param, tmp_path, "dpb_visits") as engine:
        day_type = "TEXT" if request.param == "sqlite" else "TIMESTAMPTZ"
        with engine.begin() as connection:
            connection.execute(
                sa.text(
                    f'CREATE TABLE visits (person TEXT, "row" INTEGER, col TEXT, day {day_type}, '
                    "minutes INTEGER)"
                )
            )
            if request.param == "postgresql":  # what an author's query could call to write
                connection.execute(
                    sa.text(
                        "CREATE FUNCTION plant() RETURNS integer LANGUAGE sql AS "
                        "$$ INSERT INTO visits VALUES ('eve', 0, 'a', now()); SELECT 1 $$"
                    )
                )
            connection.execute(
                sa.text("INSERT INTO visits VALUES (:p, :r, :c, :d, :m)"),
                [
                    {"p": p, "r": r, "c": c, "d": stored(d, engine), "m": m}
                    for p, r, c, d, m in VISITS
                ],
            )
        url = engine.url
        if request.param == "sqlite":
            # Airflow teaches sqlite3 to bind its pendulum datetimes only when its own
            # metadata database is SQLite (as the tests' is); a deployment's is PostgreSQL.
            adapter = (pendulum.DateTime, sqlite3.PrepareProtocol)
            monkeypatch.delitem(sqlite3.adapters, adapter, raising=False)
            sa.event.listen(Pool, "connect", plant_on_sqlite)
            request.addfinalizer(lambda: sa.event.remove(Pool, "connect", plant_on_sqlite))
            connection_json = {"conn_type": "sqlite", "host": url.database}
        else:
            connection_json = {
                "conn_type": "postgres",
                "host": url.host,
                "port": url.port,
                "login": url.username,
                "schema": url.database,
            }
        monkeypatch.setenv("AIRFLOW_CONN_VISITS_DB", json.dumps(connection_json))
        yield engine


@pytest.fixture
def huge_cap(ledger):
    """Tiny noise needs a huge cap: then every lattice noise draw is 0 (sigma 0.02)."""
    ledger.set_policy(Policy(1e6, query_type="visit_map"))
    return ledger


def run(name: str, *, sql: str = SQL, groups: int = 2, rows: int = 2, release: str = TINY):
    source = aggregate_dag(
        release,
        conn_id="visits_db",
        sql=sql,
        privacy_unit="person",
        group_by=["row", "col"],
        domain=DOMAIN,
        max_groups_per_unit=groups,
        max_rows_per_group=rows,
        query_type="visit_map",
    )
    dag_run = load_dag(source, name=name).test(logical_date=MONDAY)
    return dag_run, task_states(dag_run)["visits"]


def charged(ledger, person: str) -> float:
    return ledger.epsilon_of(key_for(person, "visit_map", WINDOW))


def test_the_release_is_the_bounded_count_over_the_units_it_read(huge_cap, source):
    dag_run, state = run(f"visits_{uuid.uuid4().hex[:8]}")
    assert state == "success"
    # ann: two cells kept (k=2, domain order: (0,a) then (0,b)), two rows of (0,a) (m=2);
    # bob: one row of (1,a). cyd is outside the domain, dan outside the interval.
    # Sigma 0.028 units: the 95% interval is the value itself, its stddev below 1e-100.
    released = stored_xcom(dag_run, "visits", "return_value")
    assert released["values"] == [2, 1, 1]
    assert released["intervals"] == [[2.0, 2.0], [1.0, 1.0], [1.0, 1.0]]
    assert len(set(released["stddev"])) == 1 and 0 < released["stddev"][0] < 1e-100
    assert charged(huge_cap, "ann") > 0 and charged(huge_cap, "bob") == charged(huge_cap, "ann")
    assert charged(huge_cap, "cyd") == 0 and charged(huge_cap, "dan") == 0
    receipt = stored_xcom(dag_run, "visits", "dp_budget_receipt")
    assert receipt["reused"] is False and receipt["keys"] == 2
    assert huge_cap.verify(quarantine=False).ok


def test_a_rerun_is_handed_its_answer_and_other_bounds_are_another_release(huge_cap, source):
    name = f"visits_{uuid.uuid4().hex[:8]}"
    first, _ = run(name)
    once = charged(huge_cap, "ann")
    again, _ = run(name)
    assert stored_xcom(again, "visits", "dp_budget_receipt")["reused"] is True
    assert charged(huge_cap, "ann") == once
    other, _ = run(name, rows=3)
    assert stored_xcom(other, "visits", "return_value")["values"] == [3, 1, 1]
    assert stored_xcom(other, "visits", "dp_budget_receipt")["reused"] is False
    assert charged(huge_cap, "ann") > once


def test_a_query_that_writes_is_refused_and_charges_nothing(huge_cap, source):
    writes = 'SELECT person, "row", col FROM visits WHERE plant() = 1'
    before = huge_cap.history()
    _, state = run(f"visits_{uuid.uuid4().hex[:8]}", sql=writes)
    assert state == "failed"
    with source.connect() as connection:
        people = connection.execute(sa.text("SELECT count(*) FROM visits WHERE person = 'eve'"))
        assert people.scalar_one() == 0
    assert huge_cap.history() == before


def test_a_source_without_a_sql_hook_or_a_bad_query_fails_before_anything_is_charged():
    from dp_budget_provider.operators.aggregate import DPAggregateOperator

    arguments = dict(
        task_id="visits",
        conn_id="visits_db",
        privacy_unit="person",
        group_by="row",
        domain=[0, 1],
        mechanism={"kind": "gaussian", "noise_multiplier": 2.0},
        query_type="visit_map",
    )
    with pytest.raises(ValueError, match="value column"):
        DPAggregateOperator(sql=SQL, aggregate="sum", **arguments)
    with pytest.raises(ValueError, match="value column"):
        DPAggregateOperator(sql=SQL, aggregate="mean", bounds=(0, 1), **arguments)
    with pytest.raises(ValueError, match="exactly one of mechanism and accuracy"):
        DPAggregateOperator(sql=SQL, accuracy=(1.0, 0.9), **arguments)
    without = {k: v for k, v in arguments.items() if k != "mechanism"}
    with pytest.raises(ValueError, match="exactly one of mechanism and accuracy"):
        DPAggregateOperator(sql=SQL, **without)
    for accuracy, message in (
        ((1.0,), "accuracy must be"),
        ((0.0, 0.9), "error"),
        ((1.0, 1.0), "level"),
        ("1, 0.9", "accuracy must be"),
    ):
        with pytest.raises(ValueError, match=message):
            DPAggregateOperator(sql=SQL, accuracy=accuracy, **without)
    for confidence in (0, 1, 95, float("nan")):
        with pytest.raises(ValueError, match="confidence"):
            DPAggregateOperator(sql=SQL, confidence=confidence, **arguments)
    with pytest.raises(ValueError, match="plain SQL name"):
        DPAggregateOperator(sql=SQL, **{**arguments, "privacy_unit": "person; --"})
    operator = DPAggregateOperator(
        sql=SQL, max_groups_per_unit=2, max_rows_per_group=3, **arguments
    )
    l2, l1 = operator._sensitivities()
    assert l1 == 6.0 and 3.0 * 2**0.5 <= l2 < 3.0 * 2**0.5 * (1 + 1e-12)


def test_units_that_are_one_subject_id_to_the_ledger_are_refused(huge_cap, source):
    """'ANN' and 'ann' are two units to the SQL bounds (each kept to k cells of m rows) but
    one subject to the ledger: charged once, the subject's data could move the answer by
    twice what was charged. Refused before anything is reserved."""
    with source.begin() as connection:
        connection.execute(
            sa.text("INSERT INTO visits VALUES ('ANN', 0, 'a', :d, 10)"),
            {"d": stored(IN_WEEK, source)},
        )
    before = huge_cap.history()
    _, state = run(f"visits_{uuid.uuid4().hex[:8]}")
    assert state == "failed"
    assert huge_cap.history() == before
    assert charged(huge_cap, "ann") == 0


def test_a_mean_is_its_noisy_sum_over_its_noisy_count_released_together(huge_cap, source):
    """One release of the sums and counts (one charge per unit); the mean is their ratio
    (ann's two smallest minutes in (0,a), 3 and 7; 4 in (0,b); bob's 9 in (1,a)), with no
    interval of its own, the sums and counts with theirs (sigma 0.057 units: exact)."""
    mean = (
        'aggregate="mean", value="minutes", bounds=(0, 10), '
        'mechanism={"kind": "gaussian", "noise_multiplier": 0.002}, granularity=1'
    )
    dag_run, state = run(f"visits_{uuid.uuid4().hex[:8]}", release=mean)
    assert state == "success"
    released = stored_xcom(dag_run, "visits", "return_value")
    assert released["values"] == [5.0, 4.0, 9.0]
    assert released["stddev"] == released["intervals"] == [None] * 3
    assert released["sums"]["values"] == [10.0, 4.0, 9.0]
    assert released["counts"]["values"] == [2.0, 1.0, 1.0]
    assert released["counts"]["intervals"] == [[2.0, 2.0], [1.0, 1.0], [1.0, 1.0]]
    assert released["sums"]["stddev"] == released["counts"]["stddev"]
    assert charged(huge_cap, "ann") > 0 and charged(huge_cap, "bob") == charged(huge_cap, "ann")
    assert stored_xcom(dag_run, "visits", "dp_budget_receipt")["keys"] == 2


def test_accuracy_charges_the_least_noise_it_planned(huge_cap, source):
    """accuracy=(3, 0.95) at granularity 1: the task's intervals are at most 3 wide each
    side, a noise multiplier 1e-9 larger would make them wider, and the ledger charged
    the mechanism planned when the DAG was parsed."""
    from dp_budget_provider.accounting.error_bars import half_width
    from dp_budget_provider.operators.aggregate import DPAggregateOperator

    accuracy = "accuracy=(3.0, 0.95), granularity=1"
    dag_run, state = run(f"visits_{uuid.uuid4().hex[:8]}", release=accuracy)
    assert state == "success"
    planned = DPAggregateOperator(
        task_id="visits",
        conn_id="visits_db",
        sql=SQL,
        privacy_unit="person",
        group_by=["row", "col"],
        domain=DOMAIN,
        max_groups_per_unit=2,
        max_rows_per_group=2,
        query_type="visit_map",
        accuracy=(3.0, 0.95),
        granularity=1,
    )
    declared = planned._declared()
    plan = declared.plan(planned.mechanism)
    wider = declared.plan(type(planned.mechanism)(planned.mechanism.noise_multiplier * (1 + 1e-9)))
    assert half_width(plan, 0.95) <= 3.0 < half_width(wider, 0.95)
    released = stored_xcom(dag_run, "visits", "return_value")
    assert [hi - lo for lo, hi in released["intervals"]] == [2 * half_width(plan, 0.95)] * 3
    assert released["stddev"] == [plan.noise_std] * 3
    receipt = stored_xcom(dag_run, "visits", "dp_budget_receipt")
    assert receipt["mechanism"] == plan.charged.to_spec()
    assert charged(huge_cap, "ann") == charged(huge_cap, "bob") > 0
