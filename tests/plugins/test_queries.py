"""The UI's read queries against a brute-force reference, on SQLite and PostgreSQL."""

from __future__ import annotations

import itertools

import pytest

from dp_budget_provider.ledger.views import pages, queries
from dp_budget_provider.ledger.views.pages import AccountFilter
from dp_budget_provider.ledger.views.queries import find_accounts
from tests.plugins.conftest import WINDOW

# Over 20 s in all: scheduled before the light files (tests/conftest.py).
pytestmark = pytest.mark.heavy

# The tests seed their ledgers in this process: the ledger's clock is pinned inside WINDOW.
LEDGER_WINDOWS = (WINDOW,)

RANK = {"ok": 0, "WARNING": 1, "EXHAUSTED": 2}


def reference(ledger, filters: AccountFilter, sort: str, descending: bool) -> list[str]:
    """Every account the ledger lists, filtered and sorted in Python: what a page must show."""
    rows = []
    for account in ledger.accounts():
        state = "EXHAUSTED" if account.exhausted else ("WARNING" if account.warned else "ok")
        if filters.state is not None and state != filters.state:
            continue
        key = account.key
        if any(
            getattr(filters, name) is not None
            and not _matches(getattr(key, name), getattr(filters, name))
            for name in pages.KEY_FIELDS
        ):
            continue
        value = {
            "epsilon": account.epsilon,
            "fraction": account.fraction,
            "remaining": account.remaining,
            "state": RANK[state],
            "releases": account.releases,
            "open_reservations": account.open_reservations,
            "updated_at": account.updated_at,
        }.get(sort, getattr(key, sort, None))
        rows.append((value, (key.tenant, key.subject, key.query_type, key.window), str(key)))
    rows.sort(key=lambda row: row[1])
    if sort != "key":
        rows.sort(key=lambda row: row[0], reverse=descending)
    elif descending:
        rows.reverse()
    return [label for _, _, label in rows]


def _matches(value: str, wanted: str) -> bool:
    if "*" not in wanted:
        return value == wanted.strip().casefold()
    import fnmatch

    return fnmatch.fnmatchcase(value, wanted.casefold().replace("[", "[[]"))


FILTERS = [
    AccountFilter(),
    AccountFilter(state="warning"),
    AccountFilter(state="ok", subject="user-0*"),
    AccountFilter(tenant="acme", subject="*1*"),
    AccountFilter(state="exhausted"),
]


@pytest.mark.parametrize("one_pass", [False, True], ids=["grouped", "one-pass"])
def test_every_sort_filter_and_page_matches_the_reference(seeded, monkeypatch, one_pass):
    if one_pass:  # as when nearly every account has its own spend
        monkeypatch.setattr(queries, "MAX_GROUPS", 0)
    ledger = seeded.ledger
    for filters, sort, descending in itertools.product(FILTERS, queries.SORTS, (False, True)):
        expected = reference(ledger, filters, sort, descending)
        for limit, offset in ((1000, 0), (4, 0), (4, 6), (7, 9), (5, len(expected))):
            page = find_accounts(
                ledger, filters, sort=sort, descending=descending, limit=limit, offset=offset
            )
            case = (filters, sort, descending, limit, offset)
            assert page.total == len(expected), case
            assert [str(a.key) for a in page.items] == expected[offset : offset + limit], case


def test_statuses_equal_the_ledgers(seeded):
    ledger = seeded.ledger
    expected = {str(a.key): a for a in ledger.accounts()}
    for sort in ("key", "epsilon"):
        for account in find_accounts(ledger, sort=sort, limit=1000).items:
            assert account == expected[str(account.key)]
