"""Ledger keys: the account a privacy cost is charged to.

Canonicalisation is a privacy control, not cosmetics: if "Alice", " alice" and
"ALICE" were three accounts, one person could be charged three times less than they
leak. Every part goes through Unicode NFKC, casefolding, trimming and whitespace
collapsing; parts that are empty, too long or carry control/format characters
(zero-width joiners would otherwise fork accounts invisibly) are refused.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

MAX_PART_LENGTH = 256
_WHITESPACE = re.compile(r"\s+")


def canonical_part(name: str, value: object) -> str:
    """Canonical form of one key part, or ValueError naming the part."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    text = _WHITESPACE.sub(" ", unicodedata.normalize("NFKC", value).casefold()).strip()
    if not text:
        raise ValueError(f"{name} must not be empty")
    if len(text) > MAX_PART_LENGTH:
        raise ValueError(f"{name} is {len(text)} characters long; the limit is {MAX_PART_LENGTH}")
    for char in text:
        if unicodedata.category(char).startswith("C"):
            raise ValueError(f"{name} contains the control or format character {char!r}")
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
