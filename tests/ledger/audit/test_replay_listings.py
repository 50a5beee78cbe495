"""The replay's listings in their scratch file: what ``ScopeState`` held in memory before,
with the same answers (the verify tests prove them against tampered tables)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dp_budget_provider.ledger.audit.replay_listings import ListingStore


@pytest.fixture
def store():
    listings = ListingStore()
    yield listings
    listings.close()


def test_a_cohort_is_listed_with_its_accounts_and_the_reverse(store):
    scope = store.scope()
    scope.record("cohort-a", {"c:1", "c:2"})
    scope.record("cohort-b", {"c:2", "c:3"})
    assert scope.labels("cohort-a") == {"c:1", "c:2"}
    assert scope.labels("cohort-c") is None
    assert scope.cohorts_of("c:2") == {"cohort-a", "cohort-b"}
    assert scope.cohorts_of("c:9") == set()
    assert "cohort-b" in scope and "cohort-c" not in scope and 3 not in scope
    assert len(scope) == 2
    assert scope.lists_account("c:3") and not scope.lists_account("c:9")


def test_a_split_lists_the_child_wherever_its_parent_is(store):
    scope = store.scope()
    scope.record("cohort-a", {"c:1"})
    scope.record("cohort-b", {"c:1", "c:2"})
    scope.split("c:1", "c:4")
    scope.record("cohort-c", {"c:4"})
    assert scope.labels("cohort-a") == {"c:1", "c:4"}
    assert scope.labels("cohort-b") == {"c:1", "c:2", "c:4"}
    assert scope.cohorts_of("c:4") == {"cohort-a", "cohort-b", "cohort-c"}
    assert scope.cohorts_of("c:1") == {"cohort-a", "cohort-b"}
    scope.split("c:7", "c:8")  # a parent listed nowhere: its part is listed nowhere either
    assert scope.cohorts_of("c:8") == set() and not scope.lists_account("c:8")


def test_scopes_are_apart_and_a_reset_drops_only_its_own(store):
    first, second = store.scope(), store.scope()
    first.record("cohort-a", {"c:1"})
    second.record("cohort-a", {"c:1", "c:2"})
    assert first.labels("cohort-a") == {"c:1"}
    assert second.cohorts_of("c:2") == {"cohort-a"}
    first.drop()
    assert first.labels("cohort-a") is None and len(first) == 0
    assert not first.lists_account("c:1")
    assert second.labels("cohort-a") == {"c:1", "c:2"}
    first.record("cohort-b", {"c:1"})  # the window charged again after its reset
    assert first.cohorts_of("c:1") == {"cohort-b"}


def test_unseen_names_the_cohorts_the_table_lacks_in_order(store):
    scope = store.scope()
    for digest in ("d", "b", "a", "c"):
        scope.record(digest, {f"c:{digest}"})
    assert scope.see("b") == {"c:b"}
    assert scope.see("z") is None
    scope.see("d")
    assert list(scope.unseen()) == ["a", "c"]


def test_the_scratch_file_goes_with_the_store():
    store = ListingStore()
    folder = Path(store._directory.name)
    store.scope().record("cohort-a", {"c:1"})
    assert (folder / "listings.db").exists()
    store.close()
    assert not folder.exists()
