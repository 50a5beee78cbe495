"""The release service (``make_release``) without Airflow, on a real SQLite ledger: each
outcome it names, what it wrote, and that the noise is added once.

The gate is the one a task holds (``ReleaseGate``), over a ledger whose administrator
(``tests.admin``) opens the sealed references; the query is a plain Python callable.
"""

from __future__ import annotations

import logging

import pytest

from dp_budget_provider.accounting import GaussianMechanism, RDPAccountant, ZCDPMechanism
from dp_budget_provider.accounting.answer_rule import AnswerRule
from dp_budget_provider.accounting.release import NoisePlan
from dp_budget_provider.ledger import (
    BudgetCap,
    DeclaredRelease,
    PrivacyBudgetLedger,
    ReleaseGate,
    ReleaseOutcome,
    ReleaseRefused,
    ReleaseResult,
    key_for,
    make_release,
)
from tests.admin import ADMIN

DELTA = 1e-5
WINDOW = "2026-w28"
LEDGER_WINDOWS = (WINDOW,)
KEY = key_for("alice", "heatmap", WINDOW)
ANSWER = [[3, 1], [0, 7]]
# z = 4 at L2 sensitivity 1 on the derived lattice 2**-8, four integer cells: a discrete
# Gaussian charged as rho = 256**2 / (2 * 1024**2) = 1/32 (as in tests/operators).
DISCRETE_Z4 = ZCDPMechanism(rho=1 / 32)
GRANULARITY = 2**-8
LOG = logging.getLogger("tests.release_service")


def declared(**overrides) -> DeclaredRelease:
    arguments = {
        "mechanism": {"kind": "gaussian", "noise_multiplier": 4.0},
        "tenant": "default",
        "query_type": "heatmap",
        "l2_sensitivity": 1.0,
        "rule": AnswerRule(cells=4, integer=True),
        **overrides,
    }
    return DeclaredRelease(**arguments)


def eps(*mechanisms) -> float:
    accountant = RDPAccountant()
    for mechanism in mechanisms:
        accountant.compose(mechanism)
    return accountant.get_epsilon(DELTA)[0]


@pytest.fixture
def ledger(sqlite_url):
    ledger = PrivacyBudgetLedger(BudgetCap(3.0, DELTA), url=sqlite_url, admin=ADMIN)
    yield ledger
    ledger.close()


@pytest.fixture
def gate(ledger) -> ReleaseGate:
    return ReleaseGate(ledger)


@pytest.fixture
def noised(monkeypatch) -> list[tuple[object, object]]:
    """(exact answer, noisy release) of every call of ``NoisePlan.add_noise``."""
    calls: list[tuple[object, object]] = []
    add_noise = NoisePlan.add_noise

    def spy(plan, answer, **kwargs):
        noisy = add_noise(plan, answer, **kwargs)
        calls.append((answer, noisy))
        return noisy

    monkeypatch.setattr(NoisePlan, "add_noise", spy)
    return calls


class Query:
    """The caller's query: counts its calls, returns ``answer`` or raises ``error``."""

    def __init__(self, answer: object = ANSWER, error: BaseException | None = None) -> None:
        self.answer, self.error, self.calls = answer, error, 0

    def __call__(self) -> object:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return self.answer


def release(gate: ReleaseGate, query: Query, keys=None, **overrides) -> ReleaseOutcome:
    return make_release(
        gate, declared(**overrides), [KEY] if keys is None else keys, query, attempt="a-1", log=LOG
    )


def actions(ledger: PrivacyBudgetLedger) -> list[str]:
    return [entry["action"] for entry in ledger.history(KEY)]


def test_released_runs_once_adds_the_noise_once_and_commits(ledger, gate, noised, caplog):
    query = Query()
    with caplog.at_level(logging.INFO, logger=LOG.name):
        outcome = release(gate, query)
    assert outcome.result is ReleaseResult.released
    assert outcome.error is None and outcome.refusal is None
    assert query.calls == 1
    # The noise was added exactly once, and what was returned is that one noisy release.
    assert noised == [(ANSWER, outcome.value)]
    assert outcome.value != ANSWER and len(outcome.value) == 2
    assert all(v / GRANULARITY == int(v / GRANULARITY) for row in outcome.value for v in row)
    assert outcome.receipt.epsilon == pytest.approx(eps(DISCRETE_Z4), rel=1e-12)
    assert ledger.epsilon_of(KEY) == pytest.approx(outcome.receipt.epsilon)
    assert actions(ledger) == ["reserve", "commit"]
    assert ledger.history(KEY)[-1]["payload"]["attempt_id"] == "a-1"
    assert ledger.open_reservations() == []
    summary = outcome.summary
    assert summary["granularity"] == GRANULARITY and summary["keys"] == 1
    assert summary["mechanism"] == DISCRETE_Z4.to_spec() and "refused" not in summary
    (reserved,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("reserved")]
    assert reserved.startswith(f"reserved {DISCRETE_Z4.to_spec()} on 1 subject(s) (reservation ")
    assert reserved.endswith("is renewed while the query runs")


def test_refused_runs_nothing_writes_nothing_and_names_no_account(ledger, gate, noised):
    ledger.spend(KEY, GaussianMechanism(1.5))  # 2.98 of 3.0 checked: z=4 cannot fit
    before = ledger.history()
    query = Query()
    outcome = release(gate, query)
    assert outcome.result is ReleaseResult.refused
    assert query.calls == 0 and noised == []
    assert outcome.value is None and outcome.receipt is None and outcome.error is None
    assert isinstance(outcome.refusal, ReleaseRefused)
    assert ledger.history() == before and ledger.open_reservations() == []
    assert outcome.summary == {
        "refused": True,
        "mechanism": DISCRETE_Z4.to_spec(),
        "keys": 1,
        "reference": outcome.refusal.reference,
    }
    facts = ADMIN.open(outcome.refusal.reference)  # only the administrator learns why
    assert facts["refusal"] == "BudgetExhausted" and facts["account"] == KEY.as_dict()


def test_a_query_raising_after_the_reservation_is_charged_and_its_error_returned(
    ledger, gate, noised
):
    failure = RuntimeError("data-dependent failure")
    outcome = release(gate, Query(error=failure))
    assert outcome.result is ReleaseResult.failed
    assert outcome.error is failure and outcome.value is None
    assert noised == []  # nothing to add noise to, so nothing released
    # The reservation was committed, not given back: the data was touched.
    assert ledger.open_reservations() == []
    assert actions(ledger) == ["reserve", "commit"]
    assert ledger.epsilon_of(KEY) == pytest.approx(eps(DISCRETE_Z4), rel=1e-12)
    assert outcome.summary["epsilon"] == pytest.approx(ledger.epsilon_of(KEY))
    assert outcome.summary["granularity"] == GRANULARITY


def test_a_timeout_during_the_query_is_charged_too(ledger, gate):
    """Airflow's timeouts are BaseExceptions: the attempt is charged all the same."""

    class Timeout(BaseException):
        pass

    timeout = Timeout()
    outcome = release(gate, Query(error=timeout))
    assert outcome.result is ReleaseResult.failed and outcome.error is timeout
    assert actions(ledger) == ["reserve", "commit"] and ledger.open_reservations() == []


def test_an_answer_of_the_wrong_shape_fails_before_noise_and_is_charged(ledger, gate):
    outcome = release(gate, Query(answer=[1, 2, 3, 4, 5]))  # five cells, four declared
    assert outcome.result is ReleaseResult.failed and isinstance(outcome.error, ValueError)
    assert outcome.value is None
    assert actions(ledger) == ["reserve", "commit"]
    assert ledger.epsilon_of(KEY) == pytest.approx(eps(DISCRETE_Z4), rel=1e-12)


def test_a_commit_refused_by_a_quarantine_is_withheld_and_its_reservation_stays_open(
    ledger, gate, noised
):
    def query() -> object:
        ledger.quarantine("investigating")
        return ANSWER

    outcome = make_release(gate, declared(), [KEY], query, attempt="a-1", log=LOG)
    assert outcome.result is ReleaseResult.withheld
    assert isinstance(outcome.refusal, ReleaseRefused)
    assert outcome.value is None and outcome.receipt is None and outcome.summary is None
    assert len(noised) == 1  # the noise was added once; the release is withheld
    (still_open,) = ledger.open_reservations()  # charged by the reap, not given back
    assert still_open.attempt_id == "a-1"
    assert actions(ledger) == ["reserve"]


def test_invalid_declarations_and_keys_run_nothing_and_write_nothing(ledger, gate):
    before = ledger.history()
    query = Query()
    twice = release(gate, query, keys=[KEY, KEY])
    assert twice.result is ReleaseResult.invalid and isinstance(twice.error, ValueError)
    assert "more than once" in str(twice.error)
    auto = {"kind": "gaussian", "noise_multiplier": "auto"}
    unfit = release(gate, query, mechanism=auto, target_epsilon=-1.0)
    assert unfit.result is ReleaseResult.invalid and unfit.plan is None
    assert query.calls == 0 and ledger.history() == before
    assert twice.summary is None and unfit.summary is None
    with pytest.raises(ValueError, match="auto.*l2_sensitivity"):
        declared(mechanism=auto, l2_sensitivity=None, l1_sensitivity=1.0)


def test_auto_noise_is_resolved_on_the_cap_and_logged(ledger, gate, caplog):
    auto = {"kind": "gaussian", "noise_multiplier": "auto"}
    with caplog.at_level(logging.INFO, logger=LOG.name):
        outcome = release(gate, Query(), mechanism=auto)
    assert outcome.result is ReleaseResult.released
    assert outcome.receipt.epsilon == pytest.approx(3.0, rel=1e-6)
    assert outcome.receipt.epsilon <= 3.0
    assert any("noise_multiplier='auto' resolved to" in r.getMessage() for r in caplog.records)
