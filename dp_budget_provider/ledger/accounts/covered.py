"""What a release covers, as its caller names it: keys, or registered cohorts' keys.

Validated before any database work (LedgerKey objects, at least one, none twice) and put
in lock order, so every write takes its row locks in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dp_budget_provider.accounting import Mechanism
from dp_budget_provider.ledger.accounts.classes import CohortKeys
from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.storage import statements

# What a charge covers in a window: subject keys, or a registered cohort's keys there.
Charged = LedgerKey | CohortKeys
# What reserve and the budget checks take: keys, or cohorts' keys in their windows.
Covered = LedgerKey | CohortKeys | Iterable[LedgerKey] | Sequence[CohortKeys]


def covered(keys: Covered) -> tuple[list[LedgerKey], list[CohortKeys]]:
    """What a charge covers: subject keys in lock order, or registered cohorts' keys in
    their windows (see ``cohort``)."""
    cohorts = cohorts_of(keys)
    return ([], cohorts) if cohorts else (in_lock_order(keys), [])  # type: ignore[arg-type]


def cohorts_of(keys: object) -> list[CohortKeys]:
    """``keys`` as cohorts' keys in their windows, or [] when they are not that."""
    if isinstance(keys, CohortKeys):
        return [keys]
    if (
        isinstance(keys, list | tuple)
        and keys
        and all(isinstance(item, CohortKeys) for item in keys)
    ):
        return list(keys)
    return []


def in_lock_order(keys: LedgerKey | Iterable[LedgerKey]) -> list[LedgerKey]:
    """Distinct keys in lock order (see ``statements.lock_order``)."""
    by_parts = _key_parts(keys)
    return [by_parts[parts] for parts in sorted(by_parts)]


def distinct(keys: LedgerKey | Iterable[LedgerKey]) -> list[LedgerKey]:
    """Distinct keys in the order given."""
    return list(_key_parts(keys).values())


def one_key(key: LedgerKey) -> list[LedgerKey]:
    """``key`` as a list of one, refused unless it is one LedgerKey."""
    if not isinstance(key, LedgerKey):
        raise ValueError(f"expected one LedgerKey (see key_for), got {key!r}")
    return [key]


def mechanism_of(mechanism: Mechanism | Mapping[str, Any]) -> Mechanism:
    """A mechanism, or its spec (as XCom carries it) made one."""
    if isinstance(mechanism, Mechanism):
        return mechanism
    return Mechanism.from_spec(mechanism)


def _key_parts(keys: LedgerKey | Iterable[LedgerKey]) -> dict[tuple[str, ...], LedgerKey]:
    """``keys`` validated (LedgerKey objects, at least one, none twice) by their parts."""
    if isinstance(keys, LedgerKey):
        listed = [keys]
    elif isinstance(keys, Iterable) and not isinstance(keys, str | bytes | Mapping):
        listed = list(keys)
    else:
        raise ValueError(f"keys must be a LedgerKey or LedgerKeys (see key_for), got {keys!r}")
    if not listed:
        raise ValueError("a reservation needs at least one key")
    for key in listed:
        if not isinstance(key, LedgerKey):
            raise ValueError(f"keys must be LedgerKey objects (see key_for), got {key!r}")
    by_parts = {statements.key_tuple(key): key for key in listed}  # tuples sort and hash in C
    if len(by_parts) != len(listed):
        raise ValueError("the same key appears more than once in one release")
    return by_parts
