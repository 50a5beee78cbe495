"""The administrator's acts as the UI does them, with the api-server's administrator key.

The administrator's key signs policies and clearings and opens refusal references
(:mod:`dp_budget_provider.ledger.audit.authority`). Tasks never run on the Airflow 3 api-server,
so it may hold the key, in the file ``[dp_budget] admin_key_file`` names (readable by its
owner only, as ``dp-budget --admin-key`` wants it); workers never have it. Without that
option the UI offers no administrator's acts, and the API says why.

Each act opens the ledger with the key and with the acting Airflow user as the actor of
its history entry (the ledger's writes name the actor the ledger was opened with), and
closes it again: acts are rare, and a ledger that can sign is kept open no longer than
one act needs. The decisions are the ledger's and the CLI's: a policy change is read by
:func:`~dp_budget_provider.ledger.windows.policy.revised_policy`, as ``dp-budget policy set``
reads one; clearing is ``clear_quarantine``; a reference opens with ``AdminKey.open``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

from dp_budget_provider.ledger import AdminKey, Policy, PrivacyBudgetLedger, Share
from dp_budget_provider.ledger.accounts.keys import plain_text
from dp_budget_provider.ledger.windows.calendar import CalendarKind
from dp_budget_provider.ledger.windows.policy import revised_policy

KEY_OPTION = "admin_key_file"
# Opens the ledger to act with the administrator's key, as the named actor.
AdminLedgers = Callable[[AdminKey, str], PrivacyBudgetLedger]
ACTOR_SUFFIX = " (Airflow UI)"


class AdminUnavailable(Exception):
    """This api-server cannot do administrator's acts (no key, or an unreadable one)."""


def key_file() -> str | None:
    """The administrator's key file this api-server is configured with (None: none)."""
    from airflow.configuration import conf

    return conf.get("dp_budget", KEY_OPTION, fallback=None) or None


def admin_key() -> AdminKey:
    """The administrator's key, read from its file for each act (a key removed or replaced
    on the api-server takes effect at once); :class:`AdminUnavailable` without one."""
    path = key_file()
    if path is None:
        raise AdminUnavailable(
            f"this api-server holds no administrator key ([dp_budget] {KEY_OPTION} is not "
            "set): administer the ledger with `dp-budget --admin-key FILE`, or set the option "
            "on the api-server (never on a worker)"
        )
    try:
        return AdminKey.load(path)
    except ValueError as error:
        raise AdminUnavailable(f"[dp_budget] {KEY_OPTION}: {error}") from None


def actor_of(name: str) -> str:
    """What the history names as the actor of an act done by Airflow user ``name``."""
    return plain_text("actor", f"{name}{ACTOR_SUFFIX}")


@dataclass(frozen=True)
class PolicyChange:
    """A change of one scope's policy; what is None keeps the scope's current value (the
    fields of ``dp-budget policy set``)."""

    tenant: str = "*"
    query_type: str = "*"
    cap_epsilon: float | None = None
    warn_fraction: float | None = None
    calendar: CalendarKind | None = None
    length_seconds: int | None = None
    min_window_seconds: int | None = None
    grace_seconds: int | None = None
    compliance_clause: str | None = None
    across: str | None = None
    horizon_windows: int | None = None
    filter_order: float | str | None = None
    shares: list[dict[str, Any]] | None = None

    @classmethod
    def of(cls, values: dict[str, Any]) -> PolicyChange:
        """The change of a mapping holding some of the fields (the rest are ignored)."""
        names = {field.name for field in fields(cls)}
        return cls(**{name: value for name, value in values.items() if name in names})

    def apply(self, ledger: PrivacyBudgetLedger) -> tuple[Policy, bool]:
        """Set the changed policy; returns it, and whether its scope is new."""
        policy, created = revised_policy(
            ledger.policies(),
            self.tenant,
            self.query_type,
            cap_epsilon=self.cap_epsilon,
            warn_fraction=self.warn_fraction,
            calendar=self.calendar,
            length_seconds=self.length_seconds,
            min_window=_seconds(self.min_window_seconds),
            grace=_seconds(self.grace_seconds),
            compliance_clause=self.compliance_clause,
            across=self.across,
            horizon_windows=self.horizon_windows,
            filter_order=self.filter_order,
            shares=None
            if self.shares is None
            else [Share(s["principal"], s["fraction"], tuple(s["dags"])) for s in self.shares],
        )
        return ledger.set_policy(policy), created


def _seconds(value: int | None) -> timedelta | None:
    return None if value is None else timedelta(seconds=value)


def acting(
    opener: AdminLedgers | None, name: str, act: Callable[[PrivacyBudgetLedger], Any]
) -> Any:
    """``act(ledger)`` on the ledger opened with the administrator's key, as ``name``."""
    if opener is None:
        raise AdminUnavailable(
            "this UI was started without a way to open its ledger to administer it"
        )
    ledger = opener(admin_key(), actor_of(name))
    try:
        return act(ledger)
    finally:
        ledger.close()


def open_reference(reference: str) -> dict[str, Any]:
    """The facts a refusal reference seals (which account refused, and why); ValueError
    for one this key did not seal, or a damaged one."""
    return admin_key().open(reference.strip())
