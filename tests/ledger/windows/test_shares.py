"""Shares of a cap among principals: each release charged to its principal's share,
shares that never add up to more than the cap, and what a principal is told depending
only on its own releases. Both backends.

Tenant acme's total across query types is capped at 2, divided: "analytics" (DAGs
``etl_a`` and ``etl_a2``) holds 0.5 of it, "growth" (``etl_g``) 0.3; the per-query-type
cap is 10 (never the binding one). A Gaussian release of noise multiplier 3 costs eps
1.27 alone.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from fractions import Fraction

import mpmath
import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import (
    BudgetCap,
    BudgetExhausted,
    LedgerError,
    Policy,
    PrivacyBudgetLedger,
    key_for,
)
from dp_budget_provider.ledger.gate import ReleaseGate, ReleaseRefused
from dp_budget_provider.ledger.windows.policy import ACROSS_QUERY_TYPES
from dp_budget_provider.ledger.windows.scopes import NoShare
from dp_budget_provider.ledger.windows.shares import (
    SHARE_MARGIN,
    Share,
    dag_of,
    parse_share,
    share_caps,
    share_query_type,
    shares_sound,
)
from tests.admin import ADMIN

pytestmark = pytest.mark.heavy  # long: xdist starts it first (tests/conftest.py)

LEDGER_WINDOWS = ("2026-w28", "2026-w29")
W28, W29 = LEDGER_WINDOWS
SHARES = (Share("analytics", 0.5, ("etl_a", "etl_a2")), Share("growth", 0.3, ("etl_g",)))
CHEAP = GaussianMechanism(12.0)


def own(subject: str, query_type: str, window: str = W28):
    return key_for(subject, query_type, window, tenant="acme")


def share_key(subject: str, principal: str, window: str = W28):
    return key_for(subject, share_query_type(principal, ACROSS_QUERY_TYPES), window, tenant="acme")


def attempt(dag: str, n: int) -> str:
    """An attempt id as the operators write it (unique per call: an attempt reserves once)."""
    return f"{dag}/release/manual__{n}/-1/1/{uuid.uuid4()}"


@pytest.fixture
def divided(ledger_url, make_ledger):
    ledger = make_ledger(BudgetCap(10.0, 1e-5), url=ledger_url, admin=ADMIN)
    ledger.set_policy(Policy(2.0, tenant="acme", across="query_types", shares=SHARES))
    return ledger


def releases_granted(ledger: PrivacyBudgetLedger, dag: str, subject: str, query_type: str) -> int:
    """How many CHEAP releases ``dag`` is granted over ``subject`` before a refusal."""
    for n in range(10_000):
        try:
            ledger.commit(
                ledger.reserve([own(subject, query_type)], CHEAP, attempt=attempt(dag, n))
            )
        except BudgetExhausted:
            return n
    raise AssertionError("never refused")


def improved_term(order: float, delta: float) -> float:
    """The improved conversion's term c(a) (Canonne, Kamath and Steinke 2020, Prop. 12),
    in 50-digit arithmetic: eps = rdp(a) + log((a-1)/a) - (log(delta) + log(a)) / (a-1)."""
    a, d = mpmath.mpf(order), mpmath.mpf(delta)
    with mpmath.workdps(50):
        return float(mpmath.log((a - 1) / a) - (mpmath.log(d) + mpmath.log(a)) / (a - 1))


def share_budget_fit(ledger: PrivacyBudgetLedger, fraction: float) -> int:
    """How many CHEAP releases fit a share of ``fraction``, from the definition: n fit
    while n times the release's Rényi divergence at the scope's order stays within the
    share's part of the budget there (cap less the conversion's term), apart from the
    ledger's own share arithmetic."""
    policy = ledger.policy_for_scope("acme", ACROSS_QUERY_TYPES)
    order = policy.filter_order
    one = order / (2 * CHEAP.noise_multiplier**2)  # the Gaussian's curve, a / (2 z^2)
    budget = fraction * (1 - SHARE_MARGIN) * (policy.cap_epsilon - improved_term(order, 1e-5))
    return math.floor(budget / one)


def test_shares_are_validated():
    with pytest.raises(ValueError, match="at most 1"):
        Policy(
            2.0,
            across="query_types",
            filter_order="auto",
            shares=(Share("a", 0.6, ("x",)), Share("b", 0.5, ("y",))),
        )
    with pytest.raises(ValueError, match="reported epsilon"):
        Policy(2.0, across="query_types", filter_order="reported", shares=SHARES)
    with pytest.raises(ValueError, match="two shares"):
        Policy(2.0, shares=(Share("a", 0.2, ("x",)), Share("b", 0.2, ("x",))))
    with pytest.raises(ValueError, match="principal"):
        Share("Team A", 0.2, ("x",))
    with pytest.raises(ValueError, match="DAG id"):
        Share("a", 0.2, ("no/slash",))
    with pytest.raises(ValueError, match="fraction"):
        Share("a", 0.0, ("x",))
    # Fractions that add up to 1 as decimals are accepted although their floats pass it.
    tenth = [Share("a", 0.1, ("x",)), Share("b", 0.9, ("y",))]
    assert sum(Fraction(s.fraction) for s in tenth) > 1
    Policy(2.0, shares=tenth)
    with pytest.raises(ValueError, match="at most 1"):
        Policy(2.0, shares=[*tenth, Share("c", 0.001, ("z",))])


def test_names_of_share_accounts_and_dags():
    assert parse_share(share_query_type("growth", "heatmap")) == ("growth", "heatmap")
    assert parse_share(share_query_type("growth", ACROSS_QUERY_TYPES)) == (
        "growth",
        ACROSS_QUERY_TYPES,
    )
    assert parse_share("heatmap") is None
    assert dag_of("etl_a/task/run/-1/1/uuid") == "etl_a"
    assert dag_of("anonymous:123") is None
    assert dag_of(None) is None


def test_set_policy_computes_sound_share_caps(divided):
    policy = divided.policy_for_scope("acme", ACROSS_QUERY_TYPES)
    assert isinstance(policy.filter_order, float)
    caps = {s.principal: s.cap_epsilon for s in policy.shares}
    assert 0 < caps["growth"] < caps["analytics"] < policy.cap_epsilon
    term = divided._pricing.conversion_term(policy.filter_order)  # noqa: SLF001
    assert shares_sound(policy.shares, policy.cap_epsilon, term)
    # A share's cap is its part of the Rényi budget above the conversion's term.
    assert caps["analytics"] - term == pytest.approx(0.5 * (2.0 - term) * (1 - SHARE_MARGIN))


def test_each_principal_is_granted_its_share_and_no_more(divided):
    granted_a = releases_granted(divided, "etl_a", "dana", "heatmap")
    granted_g = releases_granted(divided, "etl_g", "dana", "counts")
    assert granted_a == share_budget_fit(divided, 0.5)
    assert granted_g == share_budget_fit(divided, 0.3)
    assert granted_a > granted_g > 0
    # Both principals' releases are in the subject's total, which stays under the cap.
    total = divided.epsilon_of(key_for("dana", ACROSS_QUERY_TYPES, W28, tenant="acme"))
    assert total <= 2.0
    report = divided.verify()
    assert report.ok, report.problems


def test_a_principal_s_refusals_do_not_depend_on_another_s_releases(divided):
    """The whole point: growth spends its share over dana first or not at all; what
    analytics is granted over dana is the same either way."""
    releases_granted(divided, "etl_g", "dana", "counts")
    after_other = releases_granted(divided, "etl_a", "dana", "heatmap")
    alone = releases_granted(divided, "etl_a", "erin", "heatmap")
    assert after_other == alone


def test_two_dags_of_one_principal_draw_on_one_share(divided):
    first = releases_granted(divided, "etl_a", "fay", "heatmap")
    assert releases_granted(divided, "etl_a2", "fay", "trajectory") == 0
    assert first == share_budget_fit(divided, 0.5)


def test_a_dag_without_a_share_is_refused_at_a_divided_scope(divided):
    with pytest.raises(NoShare, match="no share names DAG 'etl_x'"):
        divided.reserve([own("gus", "heatmap")], CHEAP, attempt=attempt("etl_x", 1))
    with pytest.raises(NoShare):
        divided.reserve([own("gus", "heatmap")], CHEAP)  # an anonymous attempt names no DAG
    with divided.reading() as connection:
        assert connection.execute(sa.text("SELECT count(*) FROM dp_reservations")).scalar_one() == 0
    # Another tenant's caps are not divided: any attempt releases there.
    divided.spend(key_for("gus", "heatmap", W28, tenant="beta"), CHEAP)


def test_a_release_charges_its_principal_s_share_accounts(divided):
    divided.commit(divided.reserve([own("hal", "heatmap")], CHEAP, attempt=attempt("etl_g", 1)))
    alone = divided.epsilon_alone(CHEAP)
    assert divided.epsilon_of(share_key("hal", "growth")) == pytest.approx(alone)
    assert divided.epsilon_of(share_key("hal", "analytics")) == 0.0
    cohort = divided.cohort([f"s{i}" for i in range(50)], tenant="acme")
    divided.commit(
        divided.reserve(cohort.in_window("heatmap", W28), CHEAP, attempt=attempt("etl_a", 2))
    )
    assert divided.epsilon_of(share_key("s7", "analytics")) == pytest.approx(alone)
    # One row per class per scope: the cohort's 50 subjects are one row of analytics' share.
    with divided.reading() as connection:
        rows = dict(
            connection.execute(
                sa.text("SELECT query_type, count(*) FROM dp_accounts GROUP BY query_type")
            ).all()
        )
    assert rows[share_query_type("analytics", ACROSS_QUERY_TYPES)] == 1
    assert rows["heatmap"] == 2  # hal's, and the cohort's class
    report = divided.verify()
    assert report.ok, report.problems


def test_a_release_may_not_name_a_share_account(divided):
    with pytest.raises(ValueError, match="share"):
        divided.reserve([share_key("ivy", "growth")], CHEAP, attempt=attempt("etl_g", 1))


def test_budget_check_and_the_gate_answer_for_the_dag_s_share(divided):
    releases_granted(divided, "etl_g", "jo", "counts")  # growth's share of jo is used up
    gate = ReleaseGate(divided, dag="etl_a")
    keys = [own("jo", "heatmap")]
    assert not ReleaseGate(divided, dag="etl_g").fits(keys, CHEAP)
    assert gate.fits(keys, CHEAP)
    assert not ReleaseGate(divided, dag="etl_x").fits(keys, CHEAP)  # no share: no budget
    assert not ReleaseGate(divided).fits(keys, CHEAP)  # a gate outside any task: none
    # A task's gate reserves only as its own DAG: it cannot spend another's share.
    with pytest.raises(ValueError, match="does not name this task's DAG 'etl_a'"):
        gate.reserve(keys, CHEAP, attempt=attempt("etl_g", 98))
    granted = gate.reserve(keys, CHEAP, attempt=attempt("etl_a", 99))
    receipt = gate.commit(granted).as_dict()
    share = receipt["share"]
    assert share["principal"] == "analytics"
    assert share["epsilon_after"] == pytest.approx(divided.epsilon_alone(CHEAP))
    assert "account" not in receipt  # nothing of the scope's own accounts
    with pytest.raises(ReleaseRefused):
        ReleaseGate(divided, dag="etl_g").reserve(keys, CHEAP, attempt=attempt("etl_g", 99))


def test_redividing_a_charged_scope_keeps_its_cap(divided):
    """An administrator who moves budget from a principal that spent it to another cannot
    let the total pass the cap: the scope's own account is still checked."""
    releases_granted(divided, "etl_a", "kim", "heatmap")
    policy = divided.policy_for_scope("acme", ACROSS_QUERY_TYPES)
    divided.set_policy(
        dataclasses.replace(
            policy, shares=(Share("analytics", 0.1, ("etl_a",)), Share("growth", 0.9, ("etl_g",)))
        )
    )
    releases_granted(divided, "etl_g", "kim", "counts")
    total = divided.epsilon_of(key_for("kim", ACROSS_QUERY_TYPES, W28, tenant="acme"))
    assert total <= 2.0
    report = divided.verify()
    assert report.ok, report.problems


def test_verify_names_a_release_that_skipped_its_share(divided, monkeypatch):
    """Code that charges the scopes but not the principal's share (a worker of an older
    release, or code that bypasses the shares) is named by verify."""
    from dp_budget_provider.ledger.windows import scopes

    original = scopes.with_wider_scopes
    monkeypatch.setattr(
        scopes,
        "with_wider_scopes",
        lambda keys, cohorts, policies, **kw: original(keys, cohorts, policies, shared=False),
    )
    divided.commit(divided.reserve([own("lea", "heatmap")], CHEAP, attempt=attempt("etl_a", 1)))
    report = divided.verify()
    assert not report.ok
    assert any(
        "not charged to its share account '*share:analytics:*across query types'" in problem
        for problem in report.problems
    ), report.problems


def test_verify_names_a_release_charged_to_another_principal_s_share(divided, monkeypatch):
    from dp_budget_provider.ledger.releases import locks

    monkeypatch.setattr(locks, "dag_of", lambda attempt: "etl_g")
    divided.commit(divided.reserve([own("max", "heatmap")], CHEAP, attempt=attempt("etl_a", 1)))
    report = divided.verify()
    assert not report.ok
    assert any("which its DAG 'etl_a' does not hold" in p for p in report.problems)
    assert any("not charged to its share account '*share:analytics:" in p for p in report.problems)


def test_shares_sound_holds_share_caps_to_the_budget():
    term = 0.9
    fair = share_caps(SHARES, 2.0, term)
    assert shares_sound(fair, 2.0, term)
    # Caps computed without the margin, or for fractions adding up past 1, do not bound it.
    greedy = tuple(
        dataclasses.replace(s, cap_epsilon=term + s.fraction * 1.1 / 0.8) for s in SHARES
    )
    assert not shares_sound(greedy, 2.0, term)
    exact = tuple(
        dataclasses.replace(s, cap_epsilon=term + s.fraction / 0.8 * (2.0 - term)) for s in SHARES
    )
    assert not shares_sound(exact, 2.0, term)
    with pytest.raises(ValueError, match="no Rényi budget"):
        share_caps(SHARES, 0.5, 0.9)


def test_the_report_states_how_a_divided_cap_is_shared(divided):
    from dp_budget_provider.ledger.views import report

    unit = report.build_report(divided)["privacy_unit"]
    (cap,) = unit["divided_caps"]
    assert cap["query_type"] == ACROSS_QUERY_TYPES
    assert [s["principal"] for s in cap["shares"]] == ["analytics", "growth"]
    assert (
        "divided among principals: analytics 0.5 (DAGs etl_a, etl_a2), growth 0.3"
        in (unit["statement"])
    )
    assert report.build_report(divided, tenant="beta")["privacy_unit"]["divided_caps"] == []


# ------------------------------------------------------------------ what a principal is told

PROBES = st.lists(
    st.tuples(
        st.sampled_from(["etl_a", "etl_g"]),
        st.lists(st.sampled_from(["p1", "p2", "p3", "p4"]), min_size=1, max_size=3, unique=True),
        st.sampled_from(["heatmap", "counts"]),
        st.sampled_from([2.0, 4.0, 9.0]),
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(releases=PROBES)
def test_a_principal_is_told_the_same_whatever_another_releases(tmp_path_factory, releases):
    """Where every cap a release meets is divided (each query type's, and the total
    across them), the sequence of grants and refusals a principal sees, and of its `fits`
    answers, is a function of its own releases: replayed on a ledger where the other
    principal released nothing, it is the same."""

    def told(with_others: bool) -> list[tuple[bool, bool]]:
        url = f"sqlite:///{tmp_path_factory.mktemp('told') / 'ledger.db'}"
        ledger = PrivacyBudgetLedger(BudgetCap(10.0, 1e-5), url=url, admin=ADMIN)
        try:
            ledger.set_policy(Policy(3.0, shares=SHARES))  # every query type
            ledger.set_policy(Policy(2.0, tenant="acme", across="query_types", shares=SHARES))
            seen = []
            for n, (dag, subjects, query_type, z) in enumerate(releases):
                if dag != "etl_a" and not with_others:
                    continue
                gate = ReleaseGate(ledger, dag=dag)
                keys = [own(subject, query_type) for subject in subjects]
                release = GaussianMechanism(z)
                fits = gate.fits(keys, release)
                try:
                    gate.commit(gate.reserve(keys, release, attempt=attempt(dag, n)))
                    granted = True
                except ReleaseRefused:
                    granted = False
                if dag == "etl_a":
                    seen.append((fits, granted))
            report = ledger.verify()
            assert report.ok, report.problems
            return seen
        finally:
            ledger.close()

    assert told(with_others=True) == told(with_others=False)


def test_an_undivided_cap_tells_one_principal_about_another(divided):
    """The converse, which is why every cap a team meets must be divided: a query type's
    cap that both principals draw on refuses one after the other's releases."""
    alone = divided.epsilon_alone(CHEAP)  # undivided, and one release fits it, not two
    divided.set_policy(Policy(1.2 * alone, tenant="acme", query_type="heatmap"))
    analytics, growth = ReleaseGate(divided, dag="etl_a"), ReleaseGate(divided, dag="etl_g")
    keys = [own("nia", "heatmap")]
    assert analytics.fits(keys, CHEAP)
    growth.commit(growth.reserve(keys, CHEAP, attempt=attempt("etl_g", 1)))
    assert not analytics.fits(keys, CHEAP)  # analytics has released nothing


def test_a_rescope_at_a_divided_cap_is_refused(divided):
    """A rescope moves the scope's own account (everyone's spend) and seals the key for
    every principal: from one principal's task it would tell it of others' releases and
    block theirs. Refused, from or to a query type whose cap is divided."""
    divided.set_policy(Policy(3.0, tenant="acme", query_type="heatmap", shares=SHARES))
    gate = ReleaseGate(divided, dag="etl_a")
    old, new = own("ola", "heatmap"), own("ola", "trajectory")
    gate.commit(gate.reserve([old], CHEAP, attempt=attempt("etl_a", 1)))
    for source, target in ((old, new), (own("ola", "counts"), old)):
        with pytest.raises(ReleaseRefused):
            gate.rescope(source, target, reason="re-scored")
        with pytest.raises(LedgerError, match="divided among principals"):
            divided.rescope(source, target, reason="re-scored")
    assert divided.epsilon_of(new) == 0.0
    # An undivided pair of query types is re-scoped as before.
    divided.spend(own("ola", "snapshot"), CHEAP, attempt=attempt("etl_a", 2))
    divided.rescope(own("ola", "snapshot"), own("ola", "counts"), reason="re-scored")


def test_set_policy_refuses_shares_of_a_budget_too_small_to_divide(divided):
    policy = divided.policy_for_scope("acme", ACROSS_QUERY_TYPES)
    term = divided._pricing.conversion_term(policy.filter_order)  # noqa: SLF001
    tiny = term + 4 * math.ulp(term)
    with pytest.raises(ValueError, match="too small a Rényi budget"):
        divided.set_policy(
            Policy(tiny, tenant="acme", across="query_types", filter_order=policy.filter_order,
                   shares=[Share(f"p{j}", 0.25, (f"d{j}",)) for j in range(4)])
        )  # fmt: skip
    assert divided.verify().ok
