"""Caps checked as privacy filters (both backends).

Here the default policy checks its cap at the cap's own Rényi order ("auto"), and acme's
heatmaps on the reported epsilon (``filter_order="reported"``). The counterexample pair
of docs/accounting.md: a Gaussian release and then a pure-DP one, each granted at
exactly the cap by the least over the grid and the exact Gaussian bound (the reported
rule), is refused its second release by the filter, which checks the one order fixed
with the policy.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from dp_budget_provider.accounting import (
    GaussianMechanism,
    PureDPMechanism,
    RDPAccountant,
    plan_noise_multiplier,
    rdp_to_epsilon,
)
from dp_budget_provider.ledger import (
    BudgetCap,
    BudgetExhausted,
    DeclaredRelease,
    LedgerError,
    Policy,
    ReleaseGate,
    ReleaseResult,
    key_for,
    make_release,
)
from dp_budget_provider.ledger.storage import clock as ledger_clock
from dp_budget_provider.ledger.windows.policy import revised_policy
from tests.admin import ADMIN

LEDGER_WINDOWS = ("2026-w28",)
WEEK = LEDGER_WINDOWS[0]
DELTA = 1e-5
LOG = logging.getLogger("tests.privacy_filter")


def key(subject: str, query_type: str = "heatmap"):
    return key_for(subject, query_type, WEEK, tenant="acme")


@pytest.fixture
def ledger(ledger_url, make_ledger):
    """Cap 1 everywhere, checked at its own order (18); acme's heatmaps are checked on
    the reported epsilon."""
    ledger = make_ledger(BudgetCap(1.0, DELTA), url=ledger_url, admin=ADMIN)
    ledger.set_policy(Policy(1.0, filter_order="auto"))
    ledger.set_policy(Policy(1.0, tenant="acme", query_type="heatmap", filter_order="reported"))
    return ledger


def filter_curve(ledger, mechanism, releases: int, order: float) -> float:
    """The filter's statistic for ``releases`` of ``mechanism``, computed apart from the
    ledger: an accountant's curve at ``order``, converted there alone."""
    one = slice(*(int(np.flatnonzero(ledger.orders == order)[0]) + i for i in (0, 1)))
    accountant = RDPAccountant(ledger.orders)
    accountant.compose(mechanism, releases)
    return rdp_to_epsilon(ledger.orders[one], accountant.rdp[one], DELTA)[0]


def filter_fit(ledger, mechanism, order: float) -> int:
    """How many ``mechanism`` releases the filter at ``order`` grants, computed apart from
    the ledger: an accountant's curve at that order, converted there alone."""
    releases = 0
    while filter_curve(ledger, mechanism, releases + 1, order) <= 1.0:
        releases += 1
    return releases


def test_auto_writes_down_the_caps_own_order(ledger, ledger_url, make_ledger):
    default = ledger.policy_for_scope("acme", "counts")
    assert default.scope == ("*", "*") and default.filter_order == 18.0
    assert ledger.policy_for_scope("acme", "heatmap").filter_order is None
    assert Policy(1.0, filter_order=None) == Policy(1.0, filter_order="reported")
    # Orders of docs/accounting.md for caps 0.5, 3 and 8 (default grid, delta 1e-5).
    for cap, order in ((0.5, 32.0), (3.0, 7.5), (8.0, 3.9)):
        policy = Policy(cap, tenant=f"t{cap:g}", filter_order="auto")
        assert ledger.set_policy(policy).filter_order == order
    reopened = make_ledger(url=ledger_url)
    assert reopened.policy_for_scope("acme", "counts") == default
    assert reopened.verify().ok


def test_a_changed_cap_of_an_uncharged_scope_is_checked_at_its_own_order(ledger):
    """``policy set`` and the UI leave ``filter_order`` out: an uncharged scope then follows
    its new cap's order (a filter's order is fixed only by its first release), a charged
    one keeps its own; numpy numbers are orders too."""
    ledger.set_policy(Policy(0.5, tenant="acme", query_type="maps"))
    assert ledger.policy_for_scope("acme", "maps").filter_order == 32.0
    raised, _ = revised_policy(ledger.policies(), "acme", "maps", cap_epsilon=8.0)
    assert ledger.set_policy(raised).filter_order == 3.9
    ledger.spend(key("cat", "maps"), GaussianMechanism(20.0))
    again, _ = revised_policy(ledger.policies(), "acme", "maps", cap_epsilon=3.0)
    assert ledger.set_policy(again).filter_order == 3.9
    for number in (np.float32(7.5), np.int64(4), np.float64(7.5)):
        assert isinstance(Policy(1.0, filter_order=number).filter_order, float)
    for wrong in (np.bool_(True), float("nan"), 1.0, "Auto"):
        with pytest.raises(ValueError, match="filter_order"):
            Policy(1.0, filter_order=wrong)


def test_the_filter_grants_exactly_what_its_order_allows(ledger):
    release = GaussianMechanism(20.0)
    granted = {"counts": 0, "heatmap": 0}
    for query_type in granted:
        while True:
            try:
                ledger.spend(key("ann", query_type), release)
            except BudgetExhausted:
                break
            granted[query_type] += 1
    assert granted["counts"] == filter_fit(ledger, release, 18.0) == 24
    assert granted["heatmap"] == 28  # the exact Gaussian bound, not a filter
    assert ledger.verify().ok


def test_the_counterexamples_second_release_is_refused_by_the_filter(ledger):
    first = GaussianMechanism(200.0)
    for query_type in ("heatmap", "counts"):
        ledger.spend(key("ben", query_type), first)
    # The largest pure-DP release the reported epsilon still grants after it (about 0.98).
    low, high = 0.5, 1.0
    for _ in range(40):
        middle = (low + high) / 2
        fits = not ledger.budget_check(key("ben", "heatmap"), PureDPMechanism(middle)).exceeds
        low, high = (middle, high) if fits else (low, middle)
    second = PureDPMechanism(low)
    assert low > 0.97
    ledger.spend(key("ben", "heatmap"), second)  # granted on the reported epsilon
    check = ledger.budget_check(key("ben", "counts"), second)
    assert check.exceeds and check.epsilon <= 1.0 < check.checked_epsilon
    with pytest.raises(BudgetExhausted) as refused:
        ledger.spend(key("ben", "counts"), second)
    assert refused.value.would_be_epsilon == pytest.approx(check.checked_epsilon)
    assert ledger.verify().ok


def test_a_charged_scope_keeps_how_its_cap_is_checked(ledger):
    ledger.spend(key("cat", "counts"), GaussianMechanism(20.0))
    ledger.spend(key("cat"), GaussianMechanism(20.0))
    # A change of cap keeps the order: "auto" is the order the charged scope has (cap
    # 1.5's own would be 12); another order, or the reported rule, is refused.
    raised = Policy(1.5, tenant="acme", query_type="counts", filter_order="auto")
    assert ledger.set_policy(raised).filter_order == 18
    for order in (7.5, None):
        with pytest.raises(LedgerError, match="one privacy filter"):
            ledger.set_policy(Policy(1.5, tenant="acme", query_type="counts", filter_order=order))
    # A scope charged on the reported epsilon keeps that ("auto", the default, keeps it;
    # an order is refused).
    with pytest.raises(LedgerError, match=r"on the reported epsilon.*\(reported\)"):
        ledger.set_policy(Policy(2.0, tenant="acme", query_type="heatmap", filter_order=18.0))
    kept = Policy(2.0, tenant="acme", query_type="heatmap")
    assert ledger.set_policy(kept).filter_order is None
    assert ledger.policy_for_scope("acme", "counts").filter_order == 18.0
    # A new scope over charged pairs checked at one order takes it over; over none, its own.
    ledger.spend(key("cat", "maps"), GaussianMechanism(20.0))  # under the default, order 18
    for tenant, order in (("acme", 18.0), ("beta", 7.5)):
        policy = Policy(3.0, tenant=tenant, filter_order="auto")
        assert ledger.set_policy(policy).filter_order == order
    assert ledger.verify().ok


def test_verify_holds_a_filters_grants_to_its_order(ledger, monkeypatch):
    """A grant the filter would have refused (code that skipped it) is named by verify."""
    from dp_budget_provider.ledger.accounts.pricing import Pricing

    for _ in range(24):
        ledger.spend(key("dan", "counts"), GaussianMechanism(20.0))
    monkeypatch.setattr(Pricing, "checked_epsilon", lambda self, spend, policy: 0.0)
    ledger.spend(key("dan", "counts"), GaussianMechanism(20.0))
    monkeypatch.undo()
    monkeypatch.setattr(ledger_clock, "now", ledger_clock.now)
    report = ledger.verify()
    assert not report.ok
    assert any("above its cap 1" in problem for problem in report.problems), report.problems


def test_noise_planned_for_a_filter_is_granted_on_an_empty_account(ledger):
    """Continuous Gaussian noise sized on the reported epsilon (the exact Gaussian bound)
    is refused by the filter on an empty account; ``auto`` plans at the filter's order."""
    gate = ReleaseGate(ledger)
    auto = {"kind": "gaussian", "noise_multiplier": "auto"}
    declared = DeclaredRelease(
        auto, tenant="acme", query_type="counts", noise="unsafe_float", l2_sensitivity=1.0
    )
    outcome = make_release(
        gate, declared, [key("eve", "counts")], lambda: 0.0, attempt="eve-1", log=LOG
    )
    assert outcome.result is ReleaseResult.released, outcome
    z = outcome.plan.charged.noise_multiplier
    # The least z the filter at order 18 grants (to the planner's tolerance), apart from it.
    assert filter_curve(ledger, GaussianMechanism(z), 1, 18.0) <= 1.0
    assert filter_curve(ledger, GaussianMechanism(z * (1 - 1e-8)), 1, 18.0) > 1.0
    on_reported = plan_noise_multiplier(RDPAccountant(ledger.orders), 1.0, DELTA)
    assert on_reported < z
    assert not ledger.fits_an_empty_account("acme", "counts", GaussianMechanism(on_reported))
    assert ledger.fits_an_empty_account("acme", "heatmap", GaussianMechanism(on_reported))
    assert ledger.verify().ok


def test_an_account_at_the_filters_limit_shows_no_room(ledger):
    """Receipts, remaining and the state count the spend as the filter does: past what it
    grants, no room, whatever the reported epsilon."""
    release = GaussianMechanism(20.0)
    for query_type in ("counts", "heatmap"):
        for _ in range(24):
            ledger.spend(key("fay", query_type), release)
    checked = filter_curve(ledger, release, 24, 18.0)
    assert filter_curve(ledger, release, 25, 18.0) > 1.0  # the filter grants no 25th
    filtered, reported = (ledger.receipt(key("fay", q)) for q in ("counts", "heatmap"))
    assert filtered.epsilon == reported.epsilon < checked <= 1.0
    assert filtered.remaining == pytest.approx(1.0 - checked, abs=1e-12)
    assert filtered.fraction == pytest.approx(checked, abs=1e-12)
    assert reported.remaining == pytest.approx(1.0 - reported.epsilon, abs=1e-12)
    states = {s.key.query_type: s for s in ledger.accounts(subject="fay")}
    assert states["counts"].state == "EXHAUSTED"
    assert states["counts"].remaining_after_held == pytest.approx(1.0 - checked, abs=1e-12)
    assert states["heatmap"].state == "WARNING"  # the reported rule grants 28
