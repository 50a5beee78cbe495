"""Key canonicalisation: one person, one account."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dp_budget_provider.ledger import LedgerKey, key_for
from dp_budget_provider.ledger.accounts.keys import sorted_subject_ids, subject_ids


@pytest.mark.parametrize(
    "variant",
    ["Alice", " alice", "ALICE ", "alice", "\u0041lice", "Ａｌｉｃｅ", "ALİCE".replace("İ", "I")],
)
def test_equivalent_spellings_collapse_onto_one_key(variant):
    assert key_for(variant, "Heat Map", "2026-W28") == key_for("alice", "heat map", "2026-w28")


def test_inner_whitespace_is_collapsed_and_casefold_applies():
    assert key_for("Straße  Nord", "q", "w").subject == "strasse nord"
    assert key_for("a\u00a0\u3000 b", "q", "w").subject == "a b"  # spaces fold to one


@pytest.mark.parametrize(
    ("subject", "message"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("a\x00b", "control"),
        ("a\u200db", "U+200D"),
        ("a\x1bb", "control"),
        # Control characters are refused, not turned into spaces.
        ("a\x1fb", "U+001F"),
        ("a\nb", "U+000A"),
        ("a\tb", "U+0009"),
        ("a\u2028b", "U+2028"),
        # Default-ignorable and blank code points would fork one account invisibly.
        ("alice\u034f", "U+034F"),
        ("alice\ufe0f", "U+FE0F"),
        ("\u3164alice", "U+3164"),
        ("alice\u2800", "U+2800"),
        ("al\u00adice", "U+00AD"),
        ("alice\U000e0041", "U+E0041"),
        ("alice\ue000", "U+E000"),  # private use
        # Mixed-script look-alikes: Cyrillic "а", Greek "ο" inside Latin words.
        ("\u0430lice", "CYRILLIC and LATIN"),
        ("b\u03bfb", "GREEK and LATIN"),
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


@pytest.mark.parametrize("subject", ["Müller", "東京タワー", "Ελλάδα", "москва", "user-0042"])
def test_single_script_and_ascii_subjects_are_accepted(subject):
    assert key_for(subject, "q", "w").subject == subject.casefold()


@given(st.text(min_size=1, max_size=40))
def test_no_accepted_part_holds_an_invisible_or_control_character(text):
    try:
        part = key_for(text, "q", "w").subject
    except ValueError:
        return
    for char in part:
        assert char == " " or char.isprintable(), repr(part)
    assert part == part.strip() and "  " not in part


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


@pytest.mark.parametrize(
    "subjects",
    [
        ["b", "a", "c"],
        ["a", "b", "c"],
        ["c", "B", "b", "a", "b"],  # repeats, one of them only once canonical
        ["a", "a"],
        [3, "3", "Zed", "zed", "alpha"],
        ["Ünïcode", "ünïcode", "plain"],
    ],
)
def test_sorted_subject_ids_are_the_distinct_canonical_ids_in_code_point_order(subjects):
    assert sorted_subject_ids(subjects) == sorted(set(subject_ids(subjects)))
    assert sorted_subject_ids(subjects) == sorted(subject_ids(subjects))  # distinct
