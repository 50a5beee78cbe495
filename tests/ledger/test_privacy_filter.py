"""A policy with a filter order checks its cap as a privacy filter (both backends).

The counterexample pair of docs/accounting.md: a Gaussian release and then a pure-DP one,
each granted at exactly the cap by the least over the grid and the exact Gaussian bound
(the rule of a policy without a filter order), is refused its second release by the
filter, which checks the one order fixed with the policy.
"""

from __future__ import annotations

import numpy as np
import pytest

from dp_budget_provider.accounting import (
    GaussianMechanism,
    PureDPMechanism,
    RDPAccountant,
    rdp_to_epsilon,
)
from dp_budget_provider.ledger import BudgetCap, BudgetExhausted, LedgerError, Policy, key_for
from dp_budget_provider.ledger.storage import clock as ledger_clock
from tests.admin import ADMIN

LEDGER_WINDOWS = ("2026-w28",)
WEEK = LEDGER_WINDOWS[0]
DELTA = 1e-5


def key(subject: str, query_type: str = "heatmap"):
    return key_for(subject, query_type, WEEK, tenant="acme")


@pytest.fixture
def ledger(ledger_url, make_ledger):
    """Cap 1 everywhere; acme's counts are checked as a filter ("auto": order 18)."""
    ledger = make_ledger(BudgetCap(1.0, DELTA), url=ledger_url, admin=ADMIN)
    ledger.set_policy(Policy(1.0, tenant="acme", query_type="counts", filter_order="auto"))
    return ledger


def filter_fit(ledger, mechanism, order: float) -> int:
    """How many ``mechanism`` releases the filter at ``order`` grants, computed apart from
    the ledger: an accountant's curve at that order, converted there alone."""
    index = int(np.flatnonzero(ledger.orders == order)[0])
    releases = 0
    while True:
        accountant = RDPAccountant(ledger.orders)
        accountant.compose(mechanism, releases + 1)
        one = slice(index, index + 1)
        if rdp_to_epsilon(ledger.orders[one], accountant.rdp[one], DELTA)[0] > 1.0:
            return releases
        releases += 1


def test_auto_writes_down_the_caps_own_order(ledger, ledger_url, make_ledger):
    policy = ledger.policy_for_scope("acme", "counts")
    assert policy.filter_order == 18.0
    assert ledger.policy_for_scope("acme", "heatmap").filter_order is None
    reopened = make_ledger(url=ledger_url)
    assert reopened.policy_for_scope("acme", "counts") == policy
    assert reopened.verify().ok


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
    # A change of cap keeps the order; another order, or none, is refused.
    ledger.set_policy(Policy(1.5, tenant="acme", query_type="counts", filter_order=18.0))
    for order in (7.5, None, "auto"):
        with pytest.raises(LedgerError, match="one privacy filter"):
            ledger.set_policy(Policy(1.5, tenant="acme", query_type="counts", filter_order=order))
    with pytest.raises(LedgerError, match="on the reported epsilon"):
        ledger.set_policy(Policy(2.0, tenant="acme", filter_order="auto"))
    assert ledger.policy_for_scope("acme", "counts").filter_order == 18.0


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
