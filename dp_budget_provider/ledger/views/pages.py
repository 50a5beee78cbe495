"""What every page of the read models shares: which accounts a filter selects, and a page.

The CLI and the UI list accounts, spend classes, history entries and reservations a page
at a time, each page with the total it is part of. The pages agree on how filters read
(:class:`AccountFilter`: key fields exactly as keys are canonicalised, or as a ``*``
pattern; a state), on the bounds of a page (:func:`page_bounds`), on what a count or a
grouped read takes (:attr:`AccountFilter.per_subject`: an account counts for the ``size``
subjects of its class unless the subjects themselves are filtered), and they look up a
scope's policy and a stored spend's epsilon once per page (:class:`PolicyCache`,
:class:`Epsilons`).
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
from sqlalchemy import ColumnElement, Select

from dp_budget_provider.accounting import EpsilonBound
from dp_budget_provider.ledger.accounts.keys import MAX_PART_LENGTH, canonical_part, whole_number
from dp_budget_provider.ledger.accounts.spend import Spend
from dp_budget_provider.ledger.accounts.subject_rows import LIVE, STORES, Store, SubjectRow
from dp_budget_provider.ledger.ledger import PrivacyBudgetLedger
from dp_budget_provider.ledger.windows.policy import (
    STATE_EXHAUSTED,
    STATE_OK,
    STATE_WARNING,
    Policy,
)
from dp_budget_provider.ledger.windows.policy_store import policy_of_scope

T = TypeVar("T")

KEY_FIELDS = ("tenant", "subject", "query_type", "window")
STATES = (STATE_OK, STATE_WARNING, STATE_EXHAUSTED)
MAX_PAGE = 1000
WILDCARD = "*"


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a longer result: ``total`` counts every match, ``items`` this page."""

    total: int
    offset: int
    limit: int
    items: list[T] = field(default_factory=list)


@dataclass(frozen=True)
class AccountFilter:
    """Which accounts to list. Key fields match exactly (canonicalised like keys), or as a
    pattern when they contain ``*`` (any run of characters); ``state`` is ``ok``,
    ``warning`` or ``exhausted`` (any case)."""

    tenant: str | None = None
    subject: str | None = None
    query_type: str | None = None
    window: str | None = None
    state: str | None = None
    sealed: bool = False  # include the sealed windows' final spend (state SEALED)

    def __post_init__(self) -> None:
        for name in KEY_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} filter must be a string, got {value!r}")
            if value is not None and len(value) > MAX_PART_LENGTH:
                raise ValueError(
                    f"{name} filter is {len(value)} characters long; a {name} has at most "
                    f"{MAX_PART_LENGTH}"
                )
        if self.state is not None:
            wanted = str(self.state).strip().lower()
            match = next((s for s in STATES if s.lower() == wanted), None)
            if match is None:
                raise ValueError(f"state must be one of {', '.join(STATES)}; got {self.state!r}")
            object.__setattr__(self, "state", match)
        if not isinstance(self.sealed, bool):
            raise ValueError(f"sealed must be True or False, got {self.sealed!r}")

    @property
    def stores(self) -> tuple[Store, ...]:
        """The stores these filters read: the live accounts, and the sealed ones when asked
        for (``sealed``) or when one window is named (its final spend, if it is sealed)."""
        one_window = self.window not in (None, "") and WILDCARD not in self.window
        return STORES if self.sealed or one_window else (LIVE,)

    @property
    def per_subject(self) -> bool:
        """Whether these filters ask something of the subjects (a subject, or a pattern):
        only the per-subject rows answer that, so a count or a grouped read of the matching
        subjects reads them one row per subject, instead of one row per class (each
        account standing for its ``size`` subjects)."""
        return _condition("subject", self.subject, SubjectRow.subject) is not None

    def conditions(self, source: Any) -> list[ColumnElement[bool]]:
        """What these filters ask of the key columns of ``source``: per-subject rows, an
        arm of the memberships, or (when the subject is left open) a store's accounts."""
        found = []
        for name, column in zip(KEY_FIELDS, key_columns(source), strict=True):
            condition = _condition(name, getattr(self, name), column)
            if condition is not None:
                found.append(condition)
        return found


def key_columns(entity: Any = SubjectRow) -> tuple[Any, ...]:
    """The key columns of ``entity`` (per-subject rows, or a store's accounts), in key order."""
    return (entity.tenant, entity.subject, entity.query_type, entity.window)


def _pattern(name: str, value: str) -> str | None:
    """The canonical text of a filter value, or None for an exact match (no wildcard)."""
    if WILDCARD not in value:
        return None
    text = " ".join(unicodedata.normalize("NFKC", value).casefold().split())
    for char in text:
        if unicodedata.category(char).startswith("C"):
            raise ValueError(f"{name} filter contains the control character {char!r}")
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped.replace(WILDCARD, "%")


def _condition(name: str, value: str | None, column: Any) -> ColumnElement[bool] | None:
    """What a filter value asks of its column; None when it matches anything."""
    if value is None or value == "":
        return None
    pattern = _pattern(name, value)
    if pattern is None:
        return column == canonical_part(name, value)
    if pattern.strip("%"):
        return column.like(pattern, escape="\\")
    return None


def filtered(query: Select[Any], filters: AccountFilter, entity: Any = SubjectRow) -> Select[Any]:
    """``query`` restricted to the rows of ``entity`` matching ``filters``' key fields:
    per-subject rows, or with ``entity=Account`` accounts (only when ``filters`` leaves
    the subject open, see :attr:`AccountFilter.per_subject`)."""
    return query.where(*filters.conditions(entity))


def page_bounds(limit: int, offset: int) -> tuple[int, int]:
    if not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise ValueError(f"limit must be an integer in [1, {MAX_PAGE}], got {limit!r}")
    return limit, whole_number("offset", offset)


def holds(column: Any, value: Any) -> ColumnElement[bool]:
    """The row's ``column`` holds exactly ``value`` (NULL included, which ``=`` misses)."""
    return column.is_(None) if value is None else column == value


class Epsilons:
    """Epsilon of stored spends, converting each distinct stored value once."""

    def __init__(self, ledger: PrivacyBudgetLedger) -> None:
        self._orders = np.asarray(ledger.orders)
        self._delta = ledger.delta
        self._conversion = ledger.conversion
        self._cache: dict[tuple[Any, Any, Any], EpsilonBound] = {}

    def of_columns(self, rho: float, residual: str | None, mu2: float | None) -> EpsilonBound:
        signature = (rho, residual, mu2)
        bound = self._cache.get(signature)
        if bound is None:
            spend = Spend.from_columns(rho, residual, mu2, self._orders.size)
            bound = spend.epsilon(self._orders, self._delta, self._conversion)
            self._cache[signature] = bound
        return bound

    def of_spend(self, spend: Spend) -> float:
        return spend.epsilon(self._orders, self._delta, self._conversion).epsilon


class PolicyCache:
    """The policy of each (tenant, query type), looked up once."""

    def __init__(self, ledger: PrivacyBudgetLedger) -> None:
        self._stored = {policy.scope: policy for policy in ledger.policies()}
        self._cache: dict[tuple[str, str], Policy] = {}

    def __call__(self, tenant: str, query_type: str) -> Policy:
        policy = self._cache.get((tenant, query_type))
        if policy is None:
            policy = self._cache[(tenant, query_type)] = policy_of_scope(
                self._stored, tenant, query_type
            )
        return policy
