"""The ledger's configuration and authority acts, replayed: its creation, the adoption of
its chain key, its administrator's key, its policies and its quarantines, each act the
administrator must sign checked for the signature (see ``authority``).

What they make is what ``dp_ledger_config`` and ``dp_policies`` must hold (``table_checks``),
and the policies they set are those every later charge is judged under (``replay_charges``).
"""

from __future__ import annotations

from typing import Any

from dp_budget_provider.accounting.conversion import conversion_term
from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.audit import authority
from dp_budget_provider.ledger.audit.authority import AdminPublicKey
from dp_budget_provider.ledger.audit.replay_state import AuditSettings, Findings, Handler
from dp_budget_provider.ledger.storage.entries import (
    AdminKeyEntry,
    AdoptKeyEntry,
    CreateEntry,
    PolicyEntry,
    QuarantineEntry,
    UnquarantineEntry,
)
from dp_budget_provider.ledger.storage.payloads import Entry
from dp_budget_provider.ledger.windows.policy import Policy
from dp_budget_provider.ledger.windows.shares import shares_sound


class Configuration:
    """The ledger's configuration as the history's acts make it, entry by entry."""

    def __init__(self, findings: Findings, settings: AuditSettings) -> None:
        self.findings = findings
        self.settings = settings
        self.policies: dict[tuple[str, str], Policy] = {}
        self.policy_entries: dict[tuple[str, str], tuple[dict[str, Any], str]] = {}
        self.create: tuple[Any, CreateEntry] | None = None  # (its row, its record)
        self.adopted: tuple[int, str] | None = None  # (seq, key id) of a key adoption
        self.quarantine: tuple[str, str] | None = None  # (at, reason)
        # The administrator's key as the history records it, the ledger's identity that
        # its signatures name, how many quarantines there were, and the signature that
        # lifted the last one (see ``authority``).
        self.admin: AdminPublicKey | None = None
        self.identity = ""
        self.quarantines = 0
        self.clearance: str | None = None

    def handlers(self) -> dict[type[Entry], Handler]:
        """The acts, by the kind of their entries."""
        return {
            CreateEntry: self._on_create,
            AdminKeyEntry: self._on_admin_key,
            AdoptKeyEntry: self._on_adopt_key,
            PolicyEntry: self._on_policy,
            QuarantineEntry: self._on_quarantine,
            UnquarantineEntry: self._on_unquarantine,
        }

    def _on_create(self, entry: Any, created: CreateEntry, keys: list[LedgerKey]) -> None:
        if self.create is not None:
            self.findings.problem(entry, "a second creation entry")
            return
        self.create = (entry, created)
        self.identity = entry.hash
        if created.admin_key is not None:
            self.admin = AdminPublicKey(created.admin_key)

    def _on_admin_key(self, entry: Any, recorded: AdminKeyEntry, keys: list[LedgerKey]) -> None:
        if self.admin is not None:
            self.findings.problem(entry, "a second administrator key (a ledger keeps its first)")
            return
        self.admin = AdminPublicKey(recorded.admin_key)

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

    def _on_adopt_key(self, entry: Any, adopted: AdoptKeyEntry, keys: list[LedgerKey]) -> None:
        if self.adopted is not None:
            self.findings.problem(entry, "a second key adoption")
        self._authorised(
            entry, "adopt-key", {"chain_key_id": adopted.chain_key_id}, adopted.signature
        )
        self.adopted = (entry.seq, adopted.chain_key_id)

    def _on_policy(self, entry: Any, recorded: PolicyEntry, keys: list[LedgerKey]) -> None:
        policy = recorded.policy
        record = policy.as_record()
        self._authorised(entry, "policy", record, recorded.signature)
        if policy.shares and not self._shares_sound(policy):
            self.findings.problem(
                entry,
                f"the shares of ({policy.tenant}, {policy.query_type}) add up to more than "
                "its cap's Rényi budget at its filter order: they do not bound the scope",
            )
        self.policies[policy.scope] = policy
        self.policy_entries[policy.scope] = ({**record, "signature": recorded.signature}, entry.at)

    def _shares_sound(self, policy: Policy) -> bool:
        """Whether ``policy``'s shares' caps add up to at most its cap's Rényi budget at
        its filter order, on the ledger's grid, delta and conversion (:mod:`shares`)."""
        order = policy.filter_order
        s = self.settings
        if not isinstance(order, float) or order not in s.orders:
            return False
        term = conversion_term(order, s.delta, s.conversion)
        return shares_sound(policy.shares, policy.cap_epsilon, term)

    def _on_quarantine(self, entry: Any, recorded: QuarantineEntry, keys: list[LedgerKey]) -> None:
        self.quarantines += 1
        if recorded.epoch not in (None, self.quarantines):
            self.findings.problem(
                entry, f"quarantine #{recorded.epoch} is the {self.quarantines}th"
            )
        self.quarantine = (entry.at, recorded.reason)
        self.clearance = None

    def _on_unquarantine(
        self, entry: Any, recorded: UnquarantineEntry, keys: list[LedgerKey]
    ) -> None:
        if self.quarantine is None:
            self.findings.problem(entry, "clears a quarantine that was not in force")
        if recorded.epoch not in (None, self.quarantines):
            self.findings.problem(entry, f"clears quarantine #{recorded.epoch}, not the last")
        self._authorised(entry, "clear-quarantine", {"epoch": self.quarantines}, recorded.signature)
        self.quarantine = None
        self.clearance = recorded.signature
