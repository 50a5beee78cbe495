"""Spend classes: every account in exactly one class, each class one standing.

Against a brute-force grouping of ``ledger.accounts()`` by what a status shows, after
random overlapping releases (committed and open) on both backends.
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dp_budget_provider.accounting import GaussianMechanism, LaplaceMechanism
from dp_budget_provider.ledger import BudgetCap, BudgetExhausted, PrivacyBudgetLedger, keys_for
from dp_budget_provider.ledger.views import queries, report
from dp_budget_provider.ledger.views.pages import AccountFilter
from dp_budget_provider.ledger.views.spend_classes import class_members, find_classes

SUBJECTS = [f"s{i}" for i in range(12)]
WINDOWS = ["2026-w10", "2026-w11"]
LEDGER_WINDOWS = tuple(WINDOWS)
MECHANISMS = [GaussianMechanism(3.0), GaussianMechanism(6.0), LaplaceMechanism(0.4)]
STEPS = st.lists(
    st.tuples(
        st.lists(st.sampled_from(SUBJECTS), min_size=1, unique=True),
        st.sampled_from(WINDOWS),
        st.sampled_from(MECHANISMS),
        st.booleans(),
    ),
    min_size=1,
    max_size=6,
)
_tenants = itertools.count()


@pytest.fixture
def ledger(ledger_url):
    ledger = PrivacyBudgetLedger(BudgetCap(3.0, 1e-5), url=ledger_url)
    yield ledger
    ledger.close()


def shown(status):
    """What a class row shows for each of its members."""
    return (
        status.key.tenant, status.key.query_type, status.key.window, status.epsilon,
        status.held_epsilon, status.releases, status.open_reservations, status.state,
    )  # fmt: skip


def every(fetch):
    items, offset = [], 0
    while True:
        page = fetch(limit=5, offset=offset)
        items += page.items
        offset += len(page.items)
        if offset >= page.total:
            return page.total, items


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=STEPS)
def test_classes_partition_the_accounts_by_what_their_status_shows(ledger, steps):
    tenant = f"t{next(_tenants)}"
    for subjects, window, mechanism, stays_open in steps:
        try:
            reservation = ledger.reserve(keys_for(subjects, "heatmap", [window], tenant=tenant),
                                         mechanism)  # fmt: skip
        except BudgetExhausted:
            continue
        if not stays_open:
            ledger.commit(reservation)
    expected = defaultdict(set)
    for status in ledger.accounts(tenant=tenant):
        expected[shown(status)].add(status.key.subject)
    scope = AccountFilter(tenant=tenant)
    total, classes = every(lambda **page: find_classes(ledger, scope, **page))
    assert total == len(classes) == len({c.id for c in classes})
    # Statuses that look alike may be two classes (spends equal in eps, not in curve): merged.
    merged = defaultdict(set)
    for spend_class in classes:
        key = spend_class.status.key
        count, accounts = every(
            functools.partial(
                class_members, ledger, key.tenant, key.query_type, key.window, spend_class.id
            )
        )
        assert count == spend_class.subjects == len(accounts)
        assert {shown(a) for a in accounts} == {shown(spend_class.status)}
        assert key.subject == min(a.key.subject for a in accounts)
        assert not merged[shown(spend_class.status)] & {a.key.subject for a in accounts}
        merged[shown(spend_class.status)] |= {a.key.subject for a in accounts}
    assert merged == expected
    # The largest class first within a window, windows in order.
    order = [(c.status.key.window, -c.subjects) for c in classes]
    assert order == sorted(order)


def test_a_subject_search_finds_its_class_and_a_changed_class_is_gone(ledger):
    keys = keys_for(range(50), "heatmap", WINDOWS[:1], tenant="acme")
    ledger.commit(ledger.reserve(keys, GaussianMechanism(4.0)))
    ledger.commit(ledger.reserve(keys[:20], GaussianMechanism(4.0)))
    page = find_classes(ledger, AccountFilter(tenant="acme"))
    assert [c.subjects for c in page.items] == [30, 20]
    found = find_classes(ledger, AccountFilter(subject="7")).items
    assert len(found) == 1 and found[0].subjects == 1 and found[0].id == page.items[1].id
    exhausted = find_classes(ledger, AccountFilter(state="exhausted"))
    assert exhausted.total == 0
    ledger.commit(ledger.reserve(keys[20:], GaussianMechanism(4.0)))  # the 30 join the 20
    assert class_members(ledger, "acme", "heatmap", WINDOWS[0], page.items[0].id) is None
    assert [c.subjects for c in find_classes(ledger).items] == [50]


def test_accounts_list_each_subject_with_the_class_holding_its_spend(ledger):
    keys = keys_for(range(50), "heatmap", WINDOWS[:1], tenant="acme")
    ledger.commit(ledger.reserve(keys, GaussianMechanism(4.0)))
    ledger.commit(ledger.reserve(keys[:20], GaussianMechanism(4.0)))
    statuses = ledger.accounts(tenant="acme")
    assert [s.key for s in statuses] == sorted(keys)  # one row per subject, key order
    by_account = defaultdict(list)
    for status in statuses:
        assert status.account == ledger.account_of(status.key).subject
        by_account[status.account].append(status)
    assert sorted(len(members) for members in by_account.values()) == [20, 30]
    for members in by_account.values():
        assert {s.subjects for s in members} == {len(members)}
        assert len({(s.epsilon, s.releases) for s in members}) == 1
    assert [s.key for s in ledger.accounts(tenant="acme", limit=7, offset=10)] == sorted(keys)[
        10:17
    ]
    page = queries.find_accounts(ledger, AccountFilter(tenant="acme"), sort="releases", limit=5)
    assert page.total == 50 and [s.releases for s in page.items] == [1] * 5
    assert report.count_accounts(ledger, tenant="acme") == 50


def test_classes_read_by_account_and_by_subject_agree(ledger):
    """Without a subject filter classes are grouped from the accounts (counting their
    size); a filter matching every subject groups the per-subject rows: the same classes."""
    keys = keys_for([f"p{i:02d}" for i in range(40)], "heatmap", WINDOWS, tenant="acme")
    ledger.commit(ledger.reserve(keys, GaussianMechanism(4.0)))
    ledger.commit(ledger.reserve(keys[:25], LaplaceMechanism(0.4)))
    ledger.reserve(keys[10:15], GaussianMechanism(6.0))  # stays open
    ledger.commit(ledger.reserve(keys[30:], GaussianMechanism(3.0)))

    def listed(subject):
        found = find_classes(ledger, AccountFilter(tenant="acme", subject=subject), limit=1000)
        return [(c.id, c.subjects, c.status) for c in found.items]

    by_account = listed(None)
    assert sum(subjects for _, subjects, _ in by_account) == len(keys)
    assert len(by_account) > len(WINDOWS)  # the releases split the windows' subjects
    assert listed("p*") == by_account
    assert listed("*") == by_account  # a pattern matching anything is no filter
    one = listed("p07")  # the search for one subject: its class in each window
    assert [(n, s.key.subject, s.key.window) for _, n, s in one] == [(1, "p07", w) for w in WINDOWS]
    assert {i for i, _, _ in one} <= {i for i, _, _ in by_account}
