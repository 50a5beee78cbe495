"""DPAggregateOperator with ``on_exhausted="filter"`` under dag.test(): units without budget
are left out of the aggregate and charged nothing, and a DAG probing who else charged its
own units learns nothing from what its task shows.

The membership attack, replayed: a DAG knows the 200 ids of its own data and releases a
count over them; another DAG ("victim") has released over some people first. In one
world the victim's data held 60 of the prober's ids, whose budget it used up; in the
other it held 60 people the prober never sees. The prober's task state, receipt, XCom
keys and every line of its log are the same in both worlds (but for the random ids and
times each run has); only the noisy count differs, and it is the aggregate of what the
prober was allowed to read (the exact answer before noise is spied on to show that the
filter did leave those 60 out).
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from datetime import datetime, timezone

import pytest
import sqlalchemy as sa

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import BudgetCap, PrivacyBudgetLedger, ReleaseGate, key_for
from tests.admin import ADMIN
from tests.airflow.dag_runner import (
    aggregate_dag,
    ledger_connection,
    load_dag,
    stored_xcom,
    task_states,
)
from tests.scratch_postgres import ledger_template, scratch_database

pytestmark = pytest.mark.heavy  # long: xdist starts it first (tests/conftest.py)

WINDOW = "2026-w28"
LEDGER_WINDOWS = (WINDOW,)
MONDAY = datetime(2026, 7, 13, tzinfo=timezone.utc)  # this run reads 2026-w28
IN_WEEK = datetime(2026, 7, 8, 12, tzinfo=timezone.utc)
OWN = [f"u{i:03d}" for i in range(200)]  # the prober's own units, one visit each
SQL = (
    "SELECT person, cell FROM visits WHERE day >= :data_interval_start AND day < :data_interval_end"
)
# z = 2 (eps 1.99 at delta 1e-5): one release fits the cap of 3 on an empty account, not
# on an account the victim's release of the same noise has charged.
DAG_SOURCE = aggregate_dag(
    conn_id="visits_db",
    sql=SQL,
    privacy_unit="person",
    group_by="cell",
    domain=["a", "b"],
    mechanism={"kind": "gaussian", "noise_multiplier": 2.0},
    granularity=1,
    query_type="visit_map",
    on_exhausted="filter",
)
# The task's own log: the operator's logger and the task runner's (Airflow's first-run and
# once-per-process messages, the DAG processor's and the hook's, are no run's output).
TASK_LOGGERS = ("operators.aggregate.DPAggregateOperator", "[task]")
# What differs between any two runs whatever the data: ids, times, durations, paths.
RANDOM = re.compile(
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
    r"|\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(\.\d+)?(\+00:00|Z)?"
    r"|\d+\.\d+ ?(s|ms|seconds)\b|run_duration=[\d.]+|datetime\.datetime\([^)]*\)"
    r"|visits_[0-9a-f]{8}|test_dag_[0-9a-f]{10}|/tmp/\S+|0x[0-9a-f]+"
)


@pytest.fixture
def source(monkeypatch):
    """The prober's visits (its 200 units: 150 in cell a, 50 in cell b), a PostgreSQL
    database of its own, as connection ``visits_db``."""
    with scratch_database("dpb_probe") as (name, url):
        engine = sa.create_engine(url)
        with engine.begin() as connection:
            connection.execute(
                sa.text("CREATE TABLE visits (person TEXT, cell TEXT, day TIMESTAMPTZ)")
            )
            connection.execute(
                sa.text("INSERT INTO visits VALUES (:p, :c, :d)"),
                [{"p": p, "c": "a" if i < 150 else "b", "d": IN_WEEK} for i, p in enumerate(OWN)],
            )
        monkeypatch.setenv(
            "AIRFLOW_CONN_VISITS_DB",
            json.dumps(
                {
                    "conn_type": "postgres",
                    "host": "127.0.0.1",
                    "port": 5432,
                    "login": "postgres",
                    "schema": name,
                }
            ),
        )
        yield engine
        engine.dispose()


@pytest.fixture
def second_world(ledger_url, tmp_path, monkeypatch):
    """``second_world()``: a second, empty ledger on the same backend, made the one behind
    the default dp_budget connection."""
    with contextlib.ExitStack() as stack:

        def make() -> PrivacyBudgetLedger:
            if ledger_url.startswith("sqlite"):
                url = f"sqlite:///{tmp_path / 'second.db'}"
            else:
                template = f'TEMPLATE "{ledger_template()}"'
                _, url = stack.enter_context(scratch_database("dpb_test", template))
            ledger = PrivacyBudgetLedger(BudgetCap(3.0, 1e-5), url=url, admin=ADMIN)
            stack.callback(ledger.close)
            ledger_connection(monkeypatch, url)
            return ledger

        yield make


def victim_releases(ledger, people: list[str]) -> None:
    """Another DAG's release over ``people``, which uses up their budget for a second."""
    gate = ReleaseGate(ledger, dag="victim")
    cohort = gate.cohort(people)
    granted = gate.reserve(
        [cohort.in_window("visit_map", WINDOW)],
        GaussianMechanism(2.0),
        attempt=f"victim/t/r/0/1/{uuid.uuid4()}",
    )
    gate.commit(granted)


def probe(capfd) -> tuple[object, ...]:
    """Run the prober's DAG: what its task shows (state, receipt, XCom keys, its log with
    the random parts masked) and the noisy values."""
    capfd.readouterr()
    dag_run = load_dag(DAG_SOURCE, name=f"visits_{uuid.uuid4().hex[:8]}").test(logical_date=MONDAY)
    out, err = capfd.readouterr()
    receipt = dict(stored_xcom(dag_run, "visits", "dp_budget_receipt"))
    receipt.pop("reservation_id")
    value = stored_xcom(dag_run, "visits", "return_value")
    log = sorted(
        RANDOM.sub("*", line)
        for line in (out + err).splitlines()
        if any(source in line for source in TASK_LOGGERS)
    )
    return (task_states(dag_run)["visits"], receipt, sorted(value)), log, value["values"]


def test_a_unit_at_its_cap_is_left_out_and_charged_nothing(ledger, source, exact_answers, capfd):
    victim_releases(ledger, OWN[:60])
    spent = ledger.epsilon_of(key_for("u000", "visit_map", WINDOW))
    shown, _, _ = probe(capfd)
    assert shown[0] == "success"
    assert exact_answers[-1] == [90, 50]  # u000..u059 (cell a) left out
    assert ledger.epsilon_of(key_for("u000", "visit_map", WINDOW)) == spent
    kept = ledger.epsilon_of(key_for("u199", "visit_map", WINDOW))
    assert kept > 0 and ledger.epsilon_of(key_for("u060", "visit_map", WINDOW)) == kept
    assert ledger.verify(quarantine=False).ok


@pytest.mark.parametrize(("used_up", "kept"), [(60, [90, 50]), (200, [0, 0])], ids=["sixty", "all"])
def test_the_membership_attack_learns_nothing_but_the_noisy_count(
    ledger, second_world, source, exact_answers, capfd, used_up, kept
):
    """World 1: the victim's data held ``used_up`` of the prober's ids (all 200: the
    release keeps nobody and charges no account); world 2: as many strangers."""
    victim_releases(ledger, OWN[:used_up])
    shown = [probe(capfd)]
    victim_releases(second_world(), [f"x{i}" for i in range(used_up)])
    shown.append(probe(capfd))
    (told_1, log_1, _), (told_2, log_2, _) = shown
    assert told_1 == told_2
    assert told_1[0] == "success" and told_1[1]["keys"] == 200
    assert log_1 == log_2 and any("reserved" in line for line in log_1)
    assert exact_answers == [kept, [150, 50]]
