"""Budget policy: caps, warning thresholds, window calendars and where each comes from.

A cap is not a taste decision; it descends from a compliance clause (e.g. GDPR Art. 25
data minimisation expressed as a maximum cumulative eps per subject). So each policy
row carries the clause it implements, and reports show it. delta is ledger-wide and
fixed at creation: letting it vary per query is "delta shopping".
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import TypeVar

import numpy as np

from dp_budget_provider.accounting import validation as check
from dp_budget_provider.ledger.accounts.keys import canonical_part
from dp_budget_provider.ledger.windows.calendar import CalendarKind, WindowCalendar
from dp_budget_provider.ledger.windows.shares import (
    Share,
    checked_shares,
    parse_share,
    share_query_type,
)

ANY = "*"
# The query types of the accounts that hold a subject's total at a wider scope than one
# query type: across all query types in a window, and across the windows of a horizon
# (and all query types). No release may name them (see :mod:`scopes`).
ACROSS_QUERY_TYPES = "*across query types"
ACROSS_WINDOWS = "*across windows"
SCOPE_QUERY_TYPES = {"query_types": ACROSS_QUERY_TYPES, "windows": ACROSS_WINDOWS}
SCOPE_ACCOUNTS = frozenset(SCOPE_QUERY_TYPES.values())
# A policy's filter order chosen by its cap (``Policy(filter_order="auto")``).
AUTO_ORDER = "auto"
# The spelling of a cap checked on the reported epsilon instead of at one order (not a
# privacy filter under adaptive releases: docs/accounting.md). Held as None, stored NULL.
REPORTED = "reported"
DEFAULT_MIN_WINDOW = timedelta(days=1)
# How long after a window ends late, retried and backfilled runs may still be charged to
# it, before maintenance may seal it. Scheduled runs start after their data interval
# ends, so a window must stay chargeable for a while after its end.
DEFAULT_GRACE = timedelta(days=3)
MAX_GRACE = timedelta(days=3660)
_T = TypeVar("_T")


@dataclass(frozen=True)
class BudgetCap:
    """The default cap of a ledger: cumulative eps per account at the fixed delta.

    ``filter_order`` is how a new ledger's default policy checks it (as
    :attr:`Policy.filter_order`); an existing ledger keeps its stored policy, and one
    named explicitly (not ``"auto"``) must be the stored one.
    """

    epsilon: float
    delta: float
    warn_fraction: float = 0.8
    filter_order: float | str | None = AUTO_ORDER

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", check.positive("epsilon", self.epsilon))
        object.__setattr__(self, "delta", check.open_unit("delta", self.delta))
        object.__setattr__(self, "warn_fraction", _warn_fraction(self.warn_fraction))
        object.__setattr__(self, "filter_order", checked_filter_order(self.filter_order))


def checked_filter_order(order: object) -> float | str | None:
    """A filter order as given: a Rényi order above 1 (a float), ``"auto"``, or None for
    the reported-epsilon rule (``"reported"``)."""
    if order is None or order == REPORTED:
        return None
    if order == AUTO_ORDER:
        return AUTO_ORDER
    if (
        isinstance(order, bool | np.bool_)
        or not isinstance(order, numbers.Real)
        or not (1.0 < float(order) < float("inf"))
    ):
        raise ValueError(
            f"filter_order must be a Rényi order above 1, {AUTO_ORDER!r} or {REPORTED!r}, "
            f"got {order!r}"
        )
    return float(order)


def _warn_fraction(value: object) -> float:
    fraction = check.positive("warn_fraction", value)
    if fraction > 1.0:
        raise ValueError(f"warn_fraction must be in (0, 1], got {value!r}")
    return fraction


@dataclass(frozen=True)
class Policy:
    """The cap for one (tenant, query_type) pair; ``"*"`` matches any.

    Lookup prefers an exact tenant and query type, then tenant only, then query type
    only, then the default ``("*", "*")``.

    ``across`` makes it a cap on a subject's total at a wider scope, enforced together
    with the per-query-type caps: ``"query_types"`` caps the total over all the tenant's
    query types in each window of ``calendar``; ``"windows"`` caps the total over all
    query types in each horizon of ``horizon_windows`` consecutive windows (a calendar
    whose periods span that many windows). Such a policy is stored under the query type
    :data:`ACROSS_QUERY_TYPES` or :data:`ACROSS_WINDOWS`; ``tenant="*"`` applies it to
    every tenant that has none of its own.
    """

    cap_epsilon: float
    warn_fraction: float = 0.8
    tenant: str = ANY
    query_type: str = ANY
    calendar: WindowCalendar = field(default_factory=WindowCalendar)
    min_window: timedelta = DEFAULT_MIN_WINDOW
    compliance_clause: str = ""
    grace: timedelta = DEFAULT_GRACE
    across: str | None = None
    horizon_windows: int | None = None
    # The one Rényi order the cap is checked at, making it a privacy filter (see
    # :mod:`~dp_budget_provider.accounting.filter`). "auto" (the default): the cap's own
    # order, or how a charged scope is already checked, written down by ``set_policy``.
    # None (spelled "reported" too): the cap is checked on the epsilon the ledger
    # reports, which is not a filter under adaptive releases. A charged scope keeps it.
    filter_order: float | str | None = AUTO_ORDER
    # The scope's cap divided among principals (:mod:`shares`); empty: not divided.
    shares: tuple[Share, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "cap_epsilon", check.positive("cap_epsilon", self.cap_epsilon))
        object.__setattr__(self, "warn_fraction", _warn_fraction(self.warn_fraction))
        object.__setattr__(self, "tenant", canonical_part("tenant", self.tenant))
        object.__setattr__(self, "query_type", canonical_part("query_type", self.query_type))
        if not isinstance(self.calendar, WindowCalendar):
            raise ValueError(f"calendar must be a WindowCalendar, got {self.calendar!r}")
        self._scope_of_policy()
        object.__setattr__(self, "filter_order", checked_filter_order(self.filter_order))
        object.__setattr__(
            self, "shares", checked_shares(self.shares, self.filter_order, self.cap_epsilon)
        )
        if not isinstance(self.min_window, timedelta) or self.min_window <= timedelta(0):
            raise ValueError(f"min_window must be a positive timedelta, got {self.min_window!r}")
        if self.calendar.shortest_window < self.min_window:
            raise ValueError(
                f"calendar windows of {self.calendar.shortest_window} are shorter than the "
                f"minimum window {self.min_window}: resetting faster than the correlation "
                "horizon lets cumulative leakage exceed the cap"
            )
        if not isinstance(self.compliance_clause, str):
            raise ValueError("compliance_clause must be a string")
        if (
            not isinstance(self.grace, timedelta)
            or self.grace < timedelta(0)
            or self.grace.microseconds
            or self.grace > MAX_GRACE
        ):
            raise ValueError(
                f"grace must be whole seconds between 0 and {MAX_GRACE.days} days, "
                f"got {self.grace!r}"
            )

    def _scope_of_policy(self) -> None:
        """Settle ``across``, the stored query type and the horizon's calendar, whichever
        of them was given (a policy read back names only its query type and calendar)."""
        across = self.across
        share = parse_share(self.query_type)
        stored_as = share[1] if share else self.query_type  # a share's: its scope's
        if across is None:
            across = next((a for a, q in SCOPE_QUERY_TYPES.items() if q == stored_as), None)
        elif across not in SCOPE_QUERY_TYPES:
            raise ValueError(
                f"across must be one of {sorted(SCOPE_QUERY_TYPES)} (or None), got {across!r}"
            )
        elif stored_as not in (ANY, SCOPE_QUERY_TYPES[across]):
            raise ValueError(
                f"a cap across {across.replace('_', ' ')} covers every query type: give no "
                f"query_type, got {self.query_type!r}"
            )
        horizon, span = self.horizon_windows, self.calendar.span
        if across == "windows":
            horizon = span if horizon is None and span > 1 else horizon
            if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 2:
                raise ValueError(
                    "a cap across windows needs horizon_windows, the number of consecutive "
                    f"windows of its horizon (at least 2), got {self.horizon_windows!r}"
                )
            if span not in (1, horizon):
                raise ValueError(f"horizon_windows={horizon} but the calendar spans {span} windows")
            calendar = WindowCalendar(self.calendar.kind, self.calendar.length_seconds, horizon)
            object.__setattr__(self, "calendar", calendar)
        elif horizon is not None or span > 1:
            raise ValueError(
                "horizon_windows (a calendar spanning several windows) is for a cap across "
                "windows only: give across='windows'"
            )
        object.__setattr__(self, "across", across)
        object.__setattr__(self, "horizon_windows", horizon)
        if across is not None and share is None:
            object.__setattr__(self, "query_type", SCOPE_QUERY_TYPES[across])

    @property
    def scope(self) -> tuple[str, str]:
        """(tenant, query_type) this policy applies to."""
        return self.tenant, self.query_type

    def as_record(self) -> dict[str, object]:
        """The policy as plain JSON values: its table row, its history entry, the API."""
        return {
            "tenant": self.tenant,
            "query_type": self.query_type,
            "cap_epsilon": self.cap_epsilon,
            "warn_fraction": self.warn_fraction,
            "calendar": self.calendar.kind,
            "calendar_length_seconds": self.calendar.length_seconds,
            "min_window_seconds": int(self.min_window.total_seconds()),
            "compliance_clause": self.compliance_clause,
            "grace_seconds": int(self.grace.total_seconds()),
            # Only where set: a record written before them signs as it did.
            **({"calendar_span": self.calendar.span} if self.calendar.span > 1 else {}),
            **({"filter_order": self.filter_order} if self.filter_order is not None else {}),
            **({"shares": [share.as_record() for share in self.shares]} if self.shares else {}),
        }

    def share_policy(self, principal: str) -> Policy:
        """The policy of ``principal``'s share accounts of this scope: its share's cap,
        checked like the scope's (same order, calendar and grace). A principal with no
        share (one removed since its accounts were charged) reads with the scope's own
        cap, which bounds its accounts as the scope's account bounds the sum."""
        share = next((s for s in self.shares if s.principal == principal), None)
        cap = share.cap_epsilon if share is not None else None
        return replace(
            self,
            query_type=share_query_type(principal, self.query_type),
            cap_epsilon=self.cap_epsilon if cap is None else cap,
            shares=(),
        )

    def admits(self, checked_epsilon: float) -> bool:
        """Whether the cap grants an account whose spend, with the release asked for, the
        cap check counts as ``checked_epsilon`` (:meth:`Pricing.checked_epsilon`)."""
        return within_cap(checked_epsilon, self.cap_epsilon)

    def warns_at(self, epsilon: float) -> bool:
        """True once ``epsilon`` reaches the warning fraction of the cap."""
        return epsilon >= self.warn_fraction * self.cap_epsilon

    def exhausts_at(self, epsilon: float, next_epsilon: float | None = None) -> bool:
        """True once ``epsilon`` reaches the cap, or once ``next_epsilon`` passes it.

        ``next_epsilon`` is the eps the cheapest release the account's scope has made
        would bring it to: past the cap, that release and every dearer one is refused,
        so the account can take no more of what its scope releases (see
        :mod:`~dp_budget_provider.ledger.accounts.standing`). Decided at read time because a
        refused release leaves the ledger untouched.
        """
        if epsilon >= self.cap_epsilon:
            return True
        return next_epsilon is not None and not self.admits(next_epsilon)

    def state_at(self, epsilon: float, next_epsilon: float | None = None) -> str:
        """The state an account holding ``epsilon`` is shown in: ``ok``, ``WARNING`` (past
        the warning fraction) or ``EXHAUSTED`` (:meth:`exhausts_at`)."""
        if self.exhausts_at(epsilon, next_epsilon):
            return STATE_EXHAUSTED
        return STATE_WARNING if self.warns_at(epsilon) else STATE_OK


def within_cap(checked_epsilon: float, cap_epsilon: float) -> bool:
    """The cap decision, the one comparison every grant, check, plan and state makes:
    what the cap check counts (the filter's statistic at the policy's order, or the
    reported epsilon) may reach the cap, not pass it."""
    return checked_epsilon <= cap_epsilon


STATE_OK, STATE_WARNING, STATE_EXHAUSTED = "ok", "WARNING", "EXHAUSTED"
STATE_RESCOPED = "RESCOPED"
STATE_SEALED = "SEALED"  # the window is sealed: the final spend, never charged again


def checked_at(order: float | str | None) -> str:
    """How a cap with this ``filter_order`` is checked, as people read it."""
    if order is None or order == REPORTED:
        return "on the reported epsilon"
    return f"at Rényi order {order:g}" if isinstance(order, float) else f"at order {order}"


def kept_by_ledger(query_type: str) -> bool:
    """Whether ``query_type`` is one the ledger keeps for itself (a subject's total at a
    wider scope, or a principal's share account), never a release's own."""
    return query_type in SCOPE_ACCOUNTS or parse_share(query_type) is not None


def lookup_order(tenant: str, query_type: str) -> list[tuple[str, str]]:
    """Policy scopes to try for a key, most specific first. A total across query types or
    windows is capped only by a policy of its own (the tenant's or every tenant's)."""
    if query_type in SCOPE_ACCOUNTS:
        return [(tenant, query_type), (ANY, query_type)]
    return [(tenant, query_type), (tenant, ANY), (ANY, query_type), (ANY, ANY)]


def revised_policy(
    policies: Iterable[Policy],
    tenant: str = ANY,
    query_type: str = ANY,
    *,
    cap_epsilon: float | None = None,
    warn_fraction: float | None = None,
    calendar: CalendarKind | None = None,
    length_seconds: int | None = None,
    min_window: timedelta | None = None,
    grace: timedelta | None = None,
    compliance_clause: str | None = None,
    across: str | None = None,
    horizon_windows: int | None = None,
    filter_order: float | str | None = None,
    shares: Iterable[Share] | None = None,
) -> tuple[Policy, bool]:
    """The policy an administrator's change makes of a scope's stored one, and whether the
    scope is new (its policy is created rather than updated).

    What is not given (None) keeps the scope's current value, or the default of a new
    scope: an administrator changing a warning fraction must not have to restate the cap,
    and must not reset the calendar by omission. A new scope needs its cap. A fixed
    calendar's length alone keeps the scope's calendar kind. ``policies`` are the stored
    ones (``PrivacyBudgetLedger.policies()``). This is the one reading of such a change,
    for ``dp-budget policy set`` and the UI alike. ``across`` names a cap across query
    types or windows (its query type is the scope's own: give none); a horizon keeps
    its number of windows unless ``horizon_windows`` is given, and its shares unless
    ``shares`` is given (empty: the cap is no longer divided). ``filter_order`` not given
    is ``"auto"``: a charged scope keeps how its cap is checked, an uncharged one is
    checked at its (new) cap's own order.
    """
    tenant = canonical_part("tenant", tenant)
    query_type = canonical_part("query_type", query_type)
    if across is not None:
        if across not in SCOPE_QUERY_TYPES:
            raise ValueError(
                f"across must be one of {sorted(SCOPE_QUERY_TYPES)} (or None), got {across!r}"
            )
        if query_type != ANY:
            raise ValueError("a cap across query types or windows takes no query_type")
        query_type = SCOPE_QUERY_TYPES[across]
    current = {policy.scope: policy for policy in policies}.get((tenant, query_type))
    if cap_epsilon is None and current is None:
        raise ValueError(
            f"scope {tenant}/{query_type} has no policy yet: give its cap with cap_epsilon"
        )
    if calendar is not None:
        windows = WindowCalendar(calendar, length_seconds)
    elif length_seconds is not None:
        windows = WindowCalendar(current.calendar.kind if current else "iso_week", length_seconds)
    else:
        windows = current.calendar if current else WindowCalendar()

    def kept(given: _T | None, now: _T | None, default: _T) -> _T:
        return given if given is not None else now if now is not None else default

    horizon = None
    if query_type == ACROSS_WINDOWS:  # the horizon's windows, and how many it spans
        windows = windows.windows
        horizon = kept(horizon_windows, current and current.horizon_windows, None)
    elif horizon_windows is not None:
        raise ValueError("horizon_windows is for a cap across windows: give across='windows'")

    policy = Policy(
        cap_epsilon=kept(cap_epsilon, current and current.cap_epsilon, 0.0),
        warn_fraction=kept(warn_fraction, current and current.warn_fraction, 0.8),
        tenant=tenant,
        query_type=query_type,
        calendar=windows,
        min_window=kept(min_window, current and current.min_window, DEFAULT_MIN_WINDOW),
        grace=kept(grace, current and current.grace, DEFAULT_GRACE),
        compliance_clause=kept(compliance_clause, current and current.compliance_clause, ""),
        horizon_windows=horizon,
        shares=tuple(shares) if shares is not None else current.shares if current else (),
        # Not given: "auto", which keeps the rule a charged scope is checked by and gives an
        # uncharged one its cap's own order (set_policy resolves it).
        filter_order=AUTO_ORDER if filter_order is None else filter_order,
    )
    return policy, current is None
