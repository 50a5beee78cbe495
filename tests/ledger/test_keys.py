"""Key canonicalisation: one person, one account."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dp_budget_provider.ledger import LedgerKey, key_for


@pytest.mark.parametrize(
    "variant",
    ["Alice", " alice", "ALICE ", "alice", "\u0041lice", "Ａｌｉｃｅ", "ALİCE".replace("İ", "I")],
)
def test_equivalent_spellings_collapse_onto_one_key(variant):
    assert key_for(variant, "Heat Map", "2026-W28") == key_for("alice", "heat map", "2026-w28")


def test_inner_whitespace_is_collapsed_and_casefold_applies():
    assert key_for("Straße  Nord", "q", "w").subject == "strasse nord"
    assert key_for("a\t\n b", "q", "w").subject == "a b"


@pytest.mark.parametrize(
    ("subject", "message"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("a\x00b", "control"),
        ("a\u200db", "format"),
        ("a\x1bb", "control"),
        ("x" * 257, "256"),
        (None, "string"),
        (42, "string"),
        (b"alice", "string"),
    ],
)
def test_bad_parts_are_refused_with_a_clear_error(subject, message):
    with pytest.raises(ValueError, match="subject") as excinfo:
        key_for(subject, "q", "w")
    assert message in str(excinfo.value)


@pytest.mark.parametrize("part", ["tenant", "query_type", "window"])
def test_every_part_is_validated(part):
    args = {"tenant": "t", "subject": "s", "query_type": "q", "window": "w", part: ""}
    with pytest.raises(ValueError, match=part):
        LedgerKey(**args)


@given(st.text(min_size=1, max_size=40))
def test_canonicalisation_is_idempotent(text):
    try:
        key = key_for(text, "q", "w")
    except ValueError:
        return
    assert key_for(key.subject, "q", "w") == key


def test_keys_sort_in_a_fixed_lock_order():
    keys = [key_for(s, "q", "w") for s in ["b", "a", "c"]]
    assert [k.subject for k in sorted(keys)] == ["a", "b", "c"]
