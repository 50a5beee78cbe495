"""DPReleaseOperator under dag.test() on a real Airflow metadata DB; ledger on SQLite and PG."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from dp_budget_provider.accounting import GaussianMechanism, RDPAccountant, ZCDPMechanism
from dp_budget_provider.accounting.answer_rule import AnswerRule
from dp_budget_provider.accounting.release import plan_noise
from dp_budget_provider.ledger import key_for
from tests.admin import ADMIN
from tests.airflow.dag_runner import load_dag, metadata_copy, stored_xcom, task_states
from tests.ledger.checked import checked_epsilon
from tests.ledger_time import this_week

# Over 20 s in all: scheduled before the light files (tests/conftest.py).
pytestmark = pytest.mark.heavy

DELTA = 1e-5
WINDOW = "2026-w28"
# dag.test() runs the task in this process: the ledger's clock is pinned inside the window.
LEDGER_WINDOWS = (WINDOW,)

RELEASE_DAG = """
from datetime import datetime, timedelta, timezone
import json, pathlib
from airflow.sdk import DAG, task
from dp_budget_provider.operators.release import DPReleaseOperator

OUT = pathlib.Path({out!r})

def answer():
    OUT.with_suffix(".ran").write_text("ran")
    {body}

with DAG("DAG_ID", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
    release = DPReleaseOperator(
        task_id="release",
        python_callable=answer,
        mechanism={mechanism!r},
        l2_sensitivity=1.0,
        l1_sensitivity=1.0,
        subject={subject!r},
        query_type="heatmap",
        window={window!r},
        noise={noise!r},{declare}{extra}
        on_exhausted={on_exhausted!r},
        retries={retries},
        retry_delay=timedelta(seconds=0),
    )

    @task
    def record(value, ti=None):
        receipt = ti.xcom_pull(task_ids="release", key="dp_budget_receipt")
        OUT.write_text(json.dumps({{"value": value, "receipt": receipt}}))

    record(release.output)
"""


def release_source(
    out,
    *,
    body="return [[3, 1], [0, 7]]",
    mechanism=None,
    subject="alice",
    noise="lattice",
    on_exhausted="fail",
    retries=0,
    declare="\n        cells=4,\n        integer=True,",
    extra="",
    window=WINDOW,
):
    """The DAG source of one release whose record task writes ``out``."""
    return RELEASE_DAG.format(
        out=str(out),
        body=body,
        mechanism=mechanism or {"kind": "gaussian", "noise_multiplier": 4.0},
        subject=subject,
        noise=noise,
        on_exhausted=on_exhausted,
        retries=retries,
        declare=declare,
        extra=extra,
        window=window,
    )


def run_release(tmp_path, **arguments):
    out = tmp_path / "out.json"
    source = release_source(out, **arguments)
    dag_run = load_dag(source).test()
    result = json.loads(out.read_text()) if out.exists() else None
    return dag_run, result, out.with_suffix(".ran").exists()


KEY = key_for("alice", "heatmap", WINDOW)
# z = 4 at L2 sensitivity 1 on the derived lattice 2**-8: 256 units of sensitivity, sigma
# 1024 units, so the discrete Gaussian costs rho = 256**2 / (2 * 1024**2) = 1/32 (the
# default answer is 4 integer cells: snapping them moves nothing, nothing more is charged).
DISCRETE_Z4 = ZCDPMechanism(rho=1 / 32)


def expected_eps(*releases):
    accountant = RDPAccountant()
    for mechanism in releases:
        accountant.compose(mechanism)
    return accountant.get_epsilon(DELTA)[0]


def test_success_commits_exactly_once_and_returns_the_noisy_release(ledger, tmp_path):
    dag_run, result, ran = run_release(tmp_path)
    assert str(dag_run.state) == "success"
    assert ran
    noisy = result["value"]
    assert len(noisy) == 2 and len(noisy[0]) == 2
    assert noisy != [[3, 1], [0, 7]]  # noise was added (continuous: equality has probability 0)
    receipt = result["receipt"]
    assert receipt["epsilon"] == pytest.approx(expected_eps(DISCRETE_Z4), rel=1e-12)
    assert receipt["mechanism"] == {"kind": "zcdp", "rho": 1 / 32}
    assert receipt["granularity"] == 2**-8
    assert all(v / 2**-8 == int(v / 2**-8) for row in noisy for v in row)
    assert receipt["keys"] == 1 and receipt["windows"] == [KEY.window]
    # The receipt describes the release alone: no account, no spend after it.
    assert not {"key", "account", "epsilon_after", "remaining", "fraction"} & set(receipt)
    assert ledger.epsilon_of(KEY) == pytest.approx(receipt["epsilon"])
    actions = [e["action"] for e in ledger.history(KEY)]
    assert actions == ["reserve", "commit"]
    attempt = ledger.history(KEY)[-1]["payload"]["attempt_id"]
    (ti,) = [t for t in dag_run.get_task_instances() if t.task_id == "release"]
    assert attempt == f"{dag_run.dag_id}/release/{dag_run.run_id}/-1/1/{ti.id}"


def test_refusal_runs_nothing_writes_nothing_and_fails(ledger, tmp_path):
    ledger.spend(KEY, GaussianMechanism(1.5))  # 2.98 of 3.0 checked: z=4 (-> 3.21) cannot fit
    before = ledger.history()
    dag_run, result, ran = run_release(tmp_path)
    assert str(dag_run.state) == "failed"
    assert task_states(dag_run)["release"] == "failed"
    assert not ran and result is None
    assert ledger.history() == before
    refusal = stored_xcom(dag_run, "release", "dp_budget_receipt")
    # The task learns that it was refused, and a reference: no account, no eps.
    assert set(refusal) == {"refused", "mechanism", "keys", "reference"}
    assert refusal["refused"] is True and refusal["keys"] == 1
    # The administrator opens the reference: the account that refused, and by how much.
    facts = ADMIN.open(refusal["reference"])
    assert facts["refusal"] == "BudgetExhausted" and facts["account"] == KEY.as_dict()
    # What the cap check counted (at cap 3's filter order).
    assert facts["epsilon"] == pytest.approx(
        checked_epsilon(3.0, 1e-5, (GaussianMechanism(1.5), 1), (DISCRETE_Z4, 1)), rel=1e-12
    )
    assert facts["epsilon"] > facts["cap_epsilon"] == 3.0
    link = stored_xcom(dag_run, "release", "_link_DPBudgetAccountLink")
    assert link.startswith("/plugin/dp-budget/dp-budget/accounts?") and "alice" not in link


def test_refusal_with_on_exhausted_skip_skips(ledger, tmp_path):
    ledger.spend(KEY, GaussianMechanism(1.5))
    dag_run, result, ran = run_release(tmp_path, on_exhausted="skip")
    assert task_states(dag_run)["release"] == "skipped"
    assert not ran and result is None


def test_a_callable_failing_after_it_started_is_charged(ledger, tmp_path):
    dag_run, _, ran = run_release(tmp_path, body="raise RuntimeError('data-dependent failure')")
    assert ran and task_states(dag_run)["release"] == "failed"
    receipt = stored_xcom(dag_run, "release", "dp_budget_receipt")
    assert receipt["epsilon"] == pytest.approx(ledger.epsilon_of(KEY)) and "refused" not in receipt
    assert ledger.epsilon_of(KEY) == pytest.approx(expected_eps(DISCRETE_Z4), rel=1e-12)


def test_a_task_retried_twice_is_charged_three_times(ledger, tmp_path):
    dag_run, _, _ = run_release(tmp_path, body="raise RuntimeError('flaky')", retries=2)
    assert task_states(dag_run)["release"] == "failed"
    commits = [e for e in ledger.history(KEY) if e["action"] == "commit"]
    attempts = [c["payload"]["attempt_id"].rsplit("/", 2) for c in commits]
    assert [try_number for _, try_number, _ in attempts] == ["1", "2", "3"]
    assert len({uuid for _, _, uuid in attempts}) == 3  # each try is a task instance of its own
    assert ledger.epsilon_of(KEY) == pytest.approx(expected_eps(*[DISCRETE_Z4] * 3))


def test_discrete_laplace_counts_are_integers_and_charged_as_pure_dp(ledger, tmp_path):
    dag_run, result, _ = run_release(
        tmp_path,
        body="return [12, 0, 5]",
        mechanism={"kind": "laplace", "epsilon0": 0.5},
        declare="\n        cells=3,\n        integer=True,",
        extra="\n        granularity=1,",
    )
    assert str(dag_run.state) == "success"
    assert all(isinstance(v, int) for v in result["value"])
    assert result["receipt"]["mechanism"] == {"kind": "pure_dp", "epsilon0": 0.5}


def test_auto_noise_multiplier_costs_the_cap_alone_whatever_was_spent(ledger, tmp_path):
    """ "auto" is planned on nothing spent: the same noise whoever charged the subject
    before (the noise scale is in the receipt, so planning on the spend would tell it)."""
    auto = {"kind": "gaussian", "noise_multiplier": "auto"}
    dag_run, result, _ = run_release(tmp_path, mechanism=auto)
    assert str(dag_run.state) == "success"
    assert result["receipt"]["epsilon"] == pytest.approx(3.0, rel=1e-6)
    assert result["receipt"]["epsilon"] <= 3.0
    other = key_for("bob", "heatmap", KEY.window)
    ledger.spend(other, GaussianMechanism(8.0))
    (tmp_path / "bob").mkdir()
    again, second, _ = run_release(tmp_path / "bob", mechanism=auto, subject="bob")
    assert str(again.state) == "failed"  # the same noise no longer fits bob's cap
    assert second is None


def test_templated_subject(ledger, tmp_path):
    dag_run, result, _ = run_release(
        tmp_path, subject="subject-{{ ti.task_id }}-{{ params.get('x', 7) }}"
    )
    assert ledger.epsilon_of(key_for("subject-release-7", "heatmap", KEY.window)) > 0


RACE_SCRIPT = """
import json, os, sys
home = {home!r}  # its own metadata database, a copy of the session's migrated one
os.environ.update(AIRFLOW_HOME=home, AIRFLOW__CORE__LOAD_EXAMPLES="False",
                  AIRFLOW__CORE__DAGS_FOLDER=os.path.join(home, "dags"),
                  AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="sqlite:///" + home + "/airflow.db")
os.makedirs(os.path.join(home, "dags"))
sys.path.insert(0, {root!r})
from tests.airflow.dag_runner import load_dag
states = []
for _ in range(4):
    states.append(str(load_dag({source!r}).test().state))
print(json.dumps(states))
"""


def test_two_processes_racing_on_one_key_never_exceed_the_cap(
    ledger, ledger_url, tmp_path, airflow_db
):
    # The racing processes charge the window of the real clock (theirs is not pinned).
    key = key_for("alice", "heatmap", this_week())
    source = release_source(
        tmp_path / "ignored.json",
        body="return 1.0",
        mechanism={"kind": "gaussian", "noise_multiplier": 3.0},
        declare="",
        window=key.window,
    )
    root = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    homes = [metadata_copy(airflow_db, tmp_path / f"home{i}") for i in range(2)]
    env = {
        **__import__("os").environ,
        "AIRFLOW_CONN_DP_BUDGET_DEFAULT": json.dumps(
            {
                "conn_type": "dpbudget",
                "extra": {"url": ledger_url, "admin_public_key": ADMIN.public.text},
            }
        ),
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(RACE_SCRIPT.format(root=root, source=source, home=str(home))),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        for home in homes
    ]
    states = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    successes = sum(s.count("success") for s in states)
    assert ledger.epsilon_of(key) <= 3.0
    assert ledger.epsilon_of(key) == pytest.approx(
        expected_eps(*[ZCDPMechanism(rho=1 / 18)] * successes), rel=1e-12
    )
    commits = [e for e in ledger.history(key) if e["action"] == "commit"]
    assert len(commits) == successes >= 1
    assert sum(s.count("failed") for s in states) == 8 - successes
    assert ledger.verify().ok


WARNING_DAG = """
from datetime import datetime, timezone
import json, pathlib
from airflow.sdk import DAG, BaseNotifier
from dp_budget_provider.operators.release import DPReleaseOperator

class FileNotifier(BaseNotifier):
    def notify(self, context):
        pathlib.Path({out!r}).write_text(json.dumps(context["dp_budget_receipt"]))

with DAG("DAG_ID", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
    DPReleaseOperator(task_id="release", python_callable=lambda: 1.0,
                      mechanism={{"kind": "gaussian", "noise_multiplier": 4.0}}, l2_sensitivity=1.0,
                      subject="alice", query_type="heatmap", window="2026-w28",
                      on_budget_warning=FileNotifier())
"""


def test_warning_notifier_and_metrics_fire_past_the_warning_fraction_where_exposed(
    ledger, tmp_path, monkeypatch
):
    """Warnings tell an account's state: the task (and its notifier) hears of them only
    where the deployment exposes the budget state; otherwise nothing is said."""
    from dp_budget_provider.operators import release as release_module

    calls = []
    monkeypatch.setattr(release_module.Stats, "incr", lambda name, *a, **k: calls.append(name))
    out = tmp_path / "warning.json"
    ledger.spend(KEY, GaussianMechanism(1.8))
    assert str(load_dag(WARNING_DAG.format(out=str(out))).test().state) == "success"
    assert not out.exists() and calls == ["dp_budget.spends"]  # past 80%, but not exposed
    monkeypatch.setenv("AIRFLOW__DP_BUDGET__EXPOSE_BUDGET_STATE", "True")
    assert str(load_dag(WARNING_DAG.format(out=str(out))).test().state) == "success"
    warning = json.loads(out.read_text())
    assert warning["warned"] and warning["fraction"] >= 0.8
    assert warning["account"]["subject"] == "alice"
    assert calls[-1] == "dp_budget.warnings"


@pytest.mark.parametrize("retired", ["float", "discrete"])
def test_retired_noise_names_are_refused_naming_the_new_ones(retired):
    from dp_budget_provider.operators.release import DPReleaseOperator

    with pytest.raises(ValueError, match="'lattice'.*'unsafe_float'") as refused:
        DPReleaseOperator(
            task_id="release",
            python_callable=lambda: 1,
            mechanism={"kind": "gaussian", "noise_multiplier": 4.0},
            l2_sensitivity=1.0,
            subject="alice",
            query_type="heatmap",
            noise=retired,
        )
    assert "got " + repr(retired) in str(refused.value)


def test_non_finite_answers_are_released_by_the_declared_rule_and_verify(ledger, tmp_path):
    """NaN -> nan_value and +-inf -> bounds before noise: a release, never a data error."""
    dag_run, result, ran = run_release(
        tmp_path,
        body="return [float('nan'), float('inf'), -float('inf'), 5.0]",
        declare="\n        cells=4,",
        extra="\n        bounds=(0.0, 10.0),\n        nan_value=2.0,",
    )
    assert ran and str(dag_run.state) == "success"
    float_cells = plan_noise(GaussianMechanism(4.0), l2_sensitivity=1.0, rule=AnswerRule(cells=4))
    g = float_cells.granularity
    assert all(v / g == int(v / g) for v in result["value"])
    assert result["receipt"]["mechanism"] == float_cells.charged.to_spec()
    assert float_cells.charged.rho > DISCRETE_Z4.rho  # four float cells pay for snapping
    assert ledger.epsilon_of(KEY) == pytest.approx(expected_eps(float_cells.charged), rel=1e-12)
    assert ledger.verify().ok  # the recorded mechanism is the one charged


def test_an_answer_with_more_cells_than_declared_fails_charged_without_release(ledger, tmp_path):
    """cells defaults to 1: a 2 x 2 answer fails after the reservation, before any noise."""
    dag_run, result, ran = run_release(tmp_path, body="return [[0.5, 1.5], [2.5, 3.5]]", declare="")
    assert ran and task_states(dag_run)["release"] == "failed"
    assert result is None  # no release reached the downstream task
    receipt = stored_xcom(dag_run, "release", "dp_budget_receipt")
    assert receipt["mechanism"] == DISCRETE_Z4.to_spec()  # a scalar's charge, as declared
    assert ledger.epsilon_of(KEY) == pytest.approx(expected_eps(DISCRETE_Z4), rel=1e-12)
    assert [e["action"] for e in ledger.history(KEY)] == ["reserve", "commit"]
    assert ledger.verify().ok  # the recorded mechanism is what was charged


def test_unsafe_float_noise_is_charged_as_the_continuous_gaussian(ledger, tmp_path):
    dag_run, result, _ = run_release(tmp_path, noise="unsafe_float")
    assert str(dag_run.state) == "success"
    assert result["receipt"]["mechanism"] == {"kind": "gaussian", "noise_multiplier": 4.0}
    assert result["receipt"]["granularity"] is None
    assert ledger.epsilon_of(KEY) == pytest.approx(expected_eps(GaussianMechanism(4.0)))


def test_a_run_with_an_empty_data_interval_and_no_window_is_warned_about(ledger, capsys):
    """Airflow 3's @weekly gives a zero-length data interval: a release over last week's
    data would be charged to the run's moment's window only, so the task log says so."""
    from datetime import datetime, timezone

    from dp_budget_provider.hooks.dp_budget import DPBudgetHook
    from dp_budget_provider.operators.release import DPReleaseOperator

    operator = DPReleaseOperator(
        task_id="release",
        python_callable=lambda: 1.0,
        mechanism={"kind": "gaussian", "noise_multiplier": 4.0},
        l2_sensitivity=1.0,
        subject="alice",
        query_type="heatmap",
    )
    gate = DPBudgetHook().get_ledger()
    moment = datetime(2026, 7, 13, tzinfo=timezone.utc)
    context = {"data_interval_start": moment, "data_interval_end": moment}
    capsys.readouterr()
    operator._windows(gate, context)
    logged = "".join(capsys.readouterr())
    assert "data interval is empty" in logged and "CronDataIntervalTimetable" in logged
    context["data_interval_end"] = datetime(2026, 7, 20, tzinfo=timezone.utc)
    operator._windows(gate, context)
    assert "data interval is empty" not in "".join(capsys.readouterr())
