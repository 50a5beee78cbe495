"""Ledger keys: the account a privacy cost is charged to.

Canonicalisation is a privacy control, not cosmetics: if "Alice", " alice" and
"ALICE" were three accounts, one person could be charged three times less than they
leak. Every part goes through Unicode NFKC, casefolding, trimming and collapsing of
spaces. Refused, because they would fork one account invisibly:

* empty or over-long parts;
* control characters (tab, newline and ``\x1f`` too: they are refused, not turned into
  spaces), format characters, line and paragraph separators, unassigned and private-use
  code points;
* default-ignorable code points (Unicode's Default_Ignorable_Code_Point: U+034F, variation
  selectors such as U+FE0F, Hangul fillers such as U+3164, zero-width characters, ...)
  and the blank U+2800;
* a part that mixes letters of the Latin, Greek, Cyrillic or Armenian scripts ("аlice"
  with a Cyrillic "а" would be a second alice). A part written wholly in one script is
  accepted as it is: whole-script look-alikes are not folded.
"""

from __future__ import annotations

import numbers
import operator
import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Any

MAX_PART_LENGTH = 256
_SPACES = re.compile(r" +")
_ASCII_CONTROL = re.compile("[\x00-\x1f\x7f]")
# Unicode 15.1 DerivedCoreProperties.txt, Default_Ignorable_Code_Point, plus U+2800.
_IGNORABLE = re.compile(
    "[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f"
    "\u202a-\u202e\u2060-\u206f\u2800\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufff8"
    "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e0fff]"
)
# Scripts whose letters pass for each other's ("a" Latin, "а" Cyrillic, "α" Greek, ...).
_CONFUSABLE_SCRIPTS = frozenset({"LATIN", "GREEK", "CYRILLIC", "ARMENIAN"})


def _refuse_invisible(name: str, text: str) -> None:
    for char in text:
        category = unicodedata.category(char)
        if category[0] == "C" or category in ("Zl", "Zp") or _IGNORABLE.match(char):
            raise ValueError(
                f"{name} contains the invisible or control character U+{ord(char):04X} "
                f"({unicodedata.name(char, category)}); such characters would make one "
                "account look like another"
            )


def _refuse_mixed_scripts(name: str, text: str) -> None:
    scripts = set()
    for char in text:
        if unicodedata.category(char)[0] == "L":
            script = unicodedata.name(char, "").split(" ")[0]
            if script in _CONFUSABLE_SCRIPTS:
                scripts.add(script)
    if len(scripts) > 1:
        raise ValueError(
            f"{name} {text!r} mixes {' and '.join(sorted(scripts))} letters, which can look "
            "identical: write it in one script"
        )


def plain_text(name: str, value: object, limit: int = MAX_PART_LENGTH) -> str:
    """A short, visible string as given (actors, reasons): no control or invisible
    characters, at most ``limit`` characters; ValueError naming it otherwise."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{name} must not be empty")
    if len(value) > limit:
        raise ValueError(f"{name} is {len(value)} characters long; the limit is {limit}")
    _refuse_invisible(name, value)
    return value


# The largest value of a 64-bit database integer: every count, offset and sequence number.
MAX_STORED_INT = 2**63 - 1


def free_text(name: str, value: object, limit: int | None = None) -> str:
    """Text the ledger stores as given (reasons, attempt ids, compliance clauses): a string
    with no control character but tab and newline and no lone surrogate (what a shell
    makes of undecodable bytes: no database can store one), at most ``limit`` characters;
    ValueError naming it otherwise, before any query is made."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    if limit is not None and len(value) > limit:
        raise ValueError(f"{name} is {len(value)} characters long; the limit is {limit}")
    for char in value:
        if (char < " " and char not in "\t\n") or char == "\x7f" or "\ud800" <= char <= "\udfff":
            raise ValueError(
                f"{name} contains the control or undecodable character U+{ord(char):04X}"
            )
    return value


def whole_number(name: str, value: object) -> int:
    """A non-negative integer a 64-bit database column can hold (a limit, an offset, a
    sequence number); ValueError naming it otherwise, before any query is made."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_STORED_INT:
        raise ValueError(f"{name} must be an integer in [0, {MAX_STORED_INT}], got {value!r}")
    return value


def canonical_part(name: str, value: object) -> str:
    """Canonical form of one key part, or ValueError naming the part."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    if len(value) > 4 * MAX_PART_LENGTH:  # before normalising: NFKC of a huge text is slow
        raise ValueError(f"{name} is {len(value)} characters long; the limit is {MAX_PART_LENGTH}")
    if value.isascii() and not _ASCII_CONTROL.search(value):
        # The common case, 10^5 times per release: NFKC and casefold of visible ASCII are
        # lower(), and ASCII holds no invisible character and one script.
        text = _SPACES.sub(" ", value.lower()).strip()
        if not text:
            raise ValueError(f"{name} must not be empty")
        if len(text) > MAX_PART_LENGTH:
            raise ValueError(
                f"{name} is {len(text)} characters long; the limit is {MAX_PART_LENGTH}"
            )
        return text
    _refuse_invisible(name, value)
    normal = unicodedata.normalize("NFKC", value).casefold()
    _refuse_invisible(name, normal)
    text = _SPACES.sub(" ", "".join(" " if char.isspace() else char for char in normal)).strip()
    if not text:
        raise ValueError(f"{name} must not be empty")
    if len(text) > MAX_PART_LENGTH:
        raise ValueError(f"{name} is {len(text)} characters long; the limit is {MAX_PART_LENGTH}")
    _refuse_mixed_scripts(name, text)
    return text


@dataclass(frozen=True, order=True)
class LedgerKey:
    """(tenant, subject, query_type, window), always canonical; sorted in lock order."""

    tenant: str
    subject: str
    query_type: str
    window: str

    def __post_init__(self) -> None:
        for field in ("tenant", "subject", "query_type", "window"):
            object.__setattr__(self, field, canonical_part(field, getattr(self, field)))

    @classmethod
    def from_row(cls, row: Any) -> LedgerKey:
        """The key a stored row names (its ``tenant``, ``subject``, ``query_type`` and
        ``window`` columns, canonical as the ledger wrote them)."""
        return cls.from_canonical(row.tenant, row.subject, row.query_type, row.window)

    @classmethod
    def from_canonical(cls, tenant: str, subject: str, query_type: str, window: str) -> LedgerKey:
        """A key from parts already canonical (rows the ledger itself wrote): no re-validation.

        Reading back ten thousand keys of one release must not re-run NFKC on each.
        """
        key = object.__new__(cls)
        for field, value in (
            ("tenant", tenant),
            ("subject", subject),
            ("query_type", query_type),
            ("window", window),
        ):
            object.__setattr__(key, field, value)
        return key

    def __str__(self) -> str:
        return f"{self.tenant}/{self.subject}/{self.query_type}/{self.window}"

    def as_dict(self) -> dict[str, str]:
        """The four parts by name (JSON, reports, history)."""
        return {
            "tenant": self.tenant,
            "subject": self.subject,
            "query_type": self.query_type,
            "window": self.window,
        }


def key_for(subject: str, query_type: str, window: str, *, tenant: str = "default") -> LedgerKey:
    """The canonical key for a subject's releases of one query type in one window."""
    return LedgerKey(tenant=tenant, subject=subject, query_type=query_type, window=window)


SubjectSource = Iterable[object]
# An integer id is its decimal digits, so it has fewer than MAX_PART_LENGTH of them.
_INT_LIMIT = 10**MAX_PART_LENGTH


_LINE_EDGE_SPACE = re.compile(" ?\n ?")
_RUNS_OF_SPACES = re.compile("  +")
_VISIBLE_OR_NEWLINE = bytes(range(0x20, 0x7F)) + b"\n"


def _canonical_ascii(subjects: list[object]) -> list[str] | None:
    """Canonical forms of many ids at once when all are visible-ASCII strings (the common
    case: a million ids in a few tens of milliseconds), exactly what :func:`canonical_part`
    makes of each; None when any is not, or would be refused (the caller then goes id by
    id, which names the bad one)."""
    if not subjects:
        return None
    try:
        text = "\n".join(subjects)  # type: ignore[arg-type]
    except TypeError:  # an id that is not a string
        return None
    if not text.isascii() or text.encode().translate(None, _VISIBLE_OR_NEWLINE):
        return None  # not ASCII, or a control character
    if text.count("\n") != len(subjects) - 1:  # an id holding a newline
        return None
    folded = _RUNS_OF_SPACES.sub(" ", text.lower())
    if " \n" in folded or "\n " in folded:
        folded = _LINE_EDGE_SPACE.sub("\n", folded)
    parts = folded.strip(" ").split("\n")
    if len(parts) != len(subjects) or not all(parts) or max(map(len, parts)) > MAX_PART_LENGTH:
        return None
    return parts


def subject_ids(subjects: SubjectSource) -> list[str]:
    """The distinct canonical subject ids of a release, from wherever its data lists them.

    ``subjects`` is any iterable of ids (a list, a set, a numpy array, a pandas Series,
    the list an upstream task returned through XCom); an id is a string or an integer
    (``17`` is the subject ``"17"``). Ids that are the
    same canonical id ("Alice" and "alice") are one subject, charged once. A single
    string is refused: it would be a list of its characters; so is anything that is not
    one-dimensional (a table iterates over its column labels, a 0-d array not at all).
    """
    return list(dict.fromkeys(canonical_subject_ids(subjects)))


def sorted_subject_ids(subjects: SubjectSource) -> list[str]:
    """:func:`subject_ids` in code-point order (a cohort's canonical form). Sorted before
    deduplicated: a sort is linear on ids that come in order (an upstream query's ORDER
    BY), and sorted ids hold their repeats side by side, so distinct ids (the common
    case) are known by one pass of comparisons, without hashing a million strings."""
    ids = sorted(canonical_subject_ids(subjects))
    if any(map(operator.eq, ids, islice(ids, 1, None))):
        ids = list(dict.fromkeys(ids))
    return ids


def _check_source(subjects: object) -> None:
    """Refuse what is not a one-dimensional collection of ids (see :func:`subject_ids`)."""
    if isinstance(subjects, str | bytes) or not isinstance(subjects, Iterable):
        raise ValueError(
            "subjects must be a collection of subject ids (a list, an array, an upstream "
            f"task's output), got {type(subjects).__name__}"
            + (
                ": a template renders to a string; pass the upstream task's .output"
                if isinstance(subjects, str)
                else ""
            )
        )
    if isinstance(subjects, Mapping):
        raise ValueError("subjects must be a collection of subject ids, not a mapping")
    dimensions = getattr(subjects, "ndim", 1)
    if dimensions != 1:
        raise ValueError(
            "subjects must be one-dimensional (a list or a column of ids, e.g. "
            f"frame['user_id']), got a {dimensions}-dimensional {type(subjects).__name__}"
        )


def canonical_subject_ids(subjects: SubjectSource) -> list[str]:
    """Each id of ``subjects`` canonical, in order, repeats kept (see :func:`subject_ids`):
    what the ledger makes of each id a caller hands it, for a caller that must find its
    own ids among the ledger's."""
    _check_source(subjects)
    listed = subjects if isinstance(subjects, list) else list(subjects)
    batch = _canonical_ascii(listed)
    if batch is not None:
        return batch
    canonical = []
    for subject in listed:
        if isinstance(subject, numbers.Integral) and not isinstance(subject, bool):
            number = int(subject)
            if not -_INT_LIMIT < number < _INT_LIMIT:
                raise ValueError(
                    f"subject is an integer of more than {MAX_PART_LENGTH} digits; the limit "
                    f"is {MAX_PART_LENGTH} characters"
                )
            subject = str(number)
        canonical.append(canonical_part("subject", subject))
    if not canonical:
        raise ValueError("subjects is empty: a release must charge at least one subject")
    return canonical


def keys_for(
    subjects: SubjectSource, query_type: str, windows: Iterable[str], *, tenant: str = "default"
) -> list[LedgerKey]:
    """One key per distinct subject and window (see :func:`subject_ids`), each part
    canonicalised once: a release over a million subjects builds its keys in about a
    second."""
    if isinstance(windows, str | bytes):
        raise ValueError(
            "windows must be a collection of window labels, not one string (it would be "
            f"a list of its characters): pass [{windows!r}]"
        )
    ids = subject_ids(subjects)
    tenant = canonical_part("tenant", tenant)
    query_type = canonical_part("query_type", query_type)
    labels = list(dict.fromkeys(canonical_part("window", window) for window in windows))
    if not labels:
        raise ValueError("a release must charge at least one window")
    return [
        LedgerKey.from_canonical(tenant, subject, query_type, window)
        for window in labels
        for subject in ids
    ]
