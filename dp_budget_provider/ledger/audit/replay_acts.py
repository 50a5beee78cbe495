"""The ledger's configuration and authority acts, replayed: its creation, the adoption of
its chain key, its administrator's key, its policies and its quarantines, each act the
administrator must sign checked for the signature (see ``authority``).

What they make is what ``dp_ledger_config`` and ``dp_policies`` must hold (``table_checks``),
and the policies they set are those every later charge is judged under (``replay_charges``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.audit import authority
from dp_budget_provider.ledger.audit.authority import AdminPublicKey
from dp_budget_provider.ledger.audit.replay_state import Findings, Handler
from dp_budget_provider.ledger.windows.calendar import WindowCalendar
from dp_budget_provider.ledger.windows.policy import DEFAULT_GRACE, Policy


def _policy_of_payload(payload: dict[str, Any]) -> Policy:
    """A policy as its history entry recorded it (entries before grace periods: the default)."""
    calendar = payload.get("calendar") or {}
    if isinstance(calendar, str):
        calendar = {"kind": calendar, "length_seconds": payload.get("calendar_length_seconds")}
    return Policy(
        cap_epsilon=payload["cap_epsilon"],
        warn_fraction=payload["warn_fraction"],
        tenant=payload["tenant"],
        query_type=payload["query_type"],
        calendar=WindowCalendar(calendar.get("kind", "iso_week"), calendar.get("length_seconds")),
        min_window=timedelta(seconds=payload["min_window_seconds"]),
        compliance_clause=payload.get("compliance_clause", ""),
        grace=timedelta(seconds=payload.get("grace_seconds", DEFAULT_GRACE.total_seconds())),
    )


class Configuration:
    """The ledger's configuration as the history's acts make it, entry by entry."""

    def __init__(self, findings: Findings) -> None:
        self.findings = findings
        self.policies: dict[tuple[str, str], Policy] = {}
        self.policy_entries: dict[tuple[str, str], tuple[dict[str, Any], str]] = {}
        self.create: tuple[Any, dict[str, Any]] | None = None
        self.adopted: tuple[int, str] | None = None  # (seq, key id) of a key adoption
        self.quarantine: tuple[str, str] | None = None  # (at, reason)
        # The administrator's key as the history records it, the ledger's identity that
        # its signatures name, how many quarantines there were, and the signature that
        # lifted the last one (see ``authority``).
        self.admin: AdminPublicKey | None = None
        self.identity = ""
        self.quarantines = 0
        self.clearance: str | None = None

    def handlers(self) -> dict[str, Handler]:
        """The acts, by the action their entries name."""
        return {
            "create": self._on_create,
            "admin-key": self._on_admin_key,
            "adopt-key": self._on_adopt_key,
            "policy": self._on_policy,
            "quarantine": self._on_quarantine,
            "unquarantine": self._on_unquarantine,
        }

    def _on_create(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        if self.create is not None:
            self.findings.problem(entry, "a second creation entry")
            return
        self.create = (entry, payload)
        self.identity = entry.hash
        if payload.get("admin_key") is not None:
            self.admin = AdminPublicKey(payload["admin_key"])

    def _on_admin_key(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        if self.admin is not None:
            self.findings.problem(entry, "a second administrator key (a ledger keeps its first)")
            return
        self.admin = AdminPublicKey(payload["admin_key"])

    def _authorised(self, entry: Any, act: str, fields: dict[str, Any], signature: Any) -> None:
        """An administrator's act must carry the administrator's signature, once the
        ledger has an administrator."""
        if self.admin is not None and not self.admin.signed(
            authority.message(self.identity, act, fields), signature
        ):
            self.findings.problem(
                entry,
                f"not signed by the ledger's administrator (key {self.admin.key_id}): written "
                "without the administrator's authority (by SQL, or by code without the key)",
            )

    def _on_adopt_key(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        if self.adopted is not None:
            self.findings.problem(entry, "a second key adoption")
        self._authorised(
            entry,
            "adopt-key",
            {"chain_key_id": payload["chain_key_id"]},
            payload.get("signature"),
        )
        self.adopted = (entry.seq, payload["chain_key_id"])

    def _on_policy(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        policy = _policy_of_payload(payload)
        record = policy.as_record()
        self._authorised(entry, "policy", record, payload.get("signature"))
        self.policies[policy.scope] = policy
        self.policy_entries[policy.scope] = (
            {**record, "signature": payload.get("signature")},
            entry.at,
        )

    def _on_quarantine(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        self.quarantines += 1
        if payload.get("epoch", self.quarantines) != self.quarantines:
            self.findings.problem(
                entry, f"quarantine #{payload['epoch']} is the {self.quarantines}th"
            )
        self.quarantine = (entry.at, payload["reason"])
        self.clearance = None

    def _on_unquarantine(self, entry: Any, payload: dict[str, Any], keys: list[LedgerKey]) -> None:
        if self.quarantine is None:
            self.findings.problem(entry, "clears a quarantine that was not in force")
        if payload.get("epoch", self.quarantines) != self.quarantines:
            self.findings.problem(entry, f"clears quarantine #{payload['epoch']}, not the last")
        self._authorised(
            entry, "clear-quarantine", {"epoch": self.quarantines}, payload.get("signature")
        )
        self.quarantine = None
        self.clearance = payload.get("signature")
