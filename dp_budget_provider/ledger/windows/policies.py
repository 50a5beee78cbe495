"""The ledger's policies as its administrator sets them and every release reads them.

Setting a policy is an administrator's act (signed with the administrator key, an audited
history entry); reading one goes through the ledger's :class:`PolicyStore`, which refuses
a policy its administrator did not sign.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from sqlalchemy import select

from dp_budget_provider.ledger.accounts.covered import one_key
from dp_budget_provider.ledger.accounts.keys import LedgerKey, canonical_part, free_text
from dp_budget_provider.ledger.accounts.pricing import Pricing
from dp_budget_provider.ledger.errors import LedgerError
from dp_budget_provider.ledger.storage import clock
from dp_budget_provider.ledger.storage.journal import Journal
from dp_budget_provider.ledger.storage.schema import LedgerConfig
from dp_budget_provider.ledger.storage.schema import Window as WindowRow
from dp_budget_provider.ledger.storage.transactions import LedgerDatabase
from dp_budget_provider.ledger.windows.policy import (
    ANY,
    AUTO_ORDER,
    REPORTED,
    Policy,
    checked_at,
)
from dp_budget_provider.ledger.windows.policy_store import (
    PolicyStore,
    policy_lookup,
    policy_of_scope,
    write_policy,
)
from dp_budget_provider.ledger.windows.shares import (
    Share,
    parse_share,
    principal_of,
    share_caps,
    shares_sound,
)


class Policies:
    """Sets and reads the caps, calendars and grace periods of a ledger's scopes."""

    def __init__(
        self,
        database: LedgerDatabase,
        journal: Journal,
        store: PolicyStore,
        pricing: Pricing,
    ) -> None:
        self._database = database
        self._journal = journal
        self._store = store
        self._pricing = pricing  # resolves a policy's filter order on the ledger's grid

    def set_policy(self, policy: Policy) -> Policy:
        """Create or replace the policy of ``policy.scope`` (an audited history entry);
        returns it as set (its ``"auto"`` filter order made the cap's own).

        An administrator's act: the ledger must have been opened with its administrator
        key (``admin=``), which signs the policy; no worker holds it (:mod:`authority`).

        A scope that has been charged keeps its calendar for the ledger's life: a second
        calendar would cut the same time into a second set of windows, each with a full
        cap. So a policy that would change the calendar of any charged (tenant, query
        type) is refused; give new query types a calendar of their own instead.

        Likewise a charged scope keeps how its cap is checked: at the one Rényi order of
        its ``filter_order`` (a privacy filter, :mod:`~dp_budget_provider.accounting.filter`,
        valid only with its order fixed before its first release), or on the epsilon the
        ledger reports (``None``, not a filter; kept only where asked for, or by a scope
        charged so by an older release of this package). ``"auto"`` (the default) is the
        rule the charged (tenant, query type) pairs the policy governs are checked by,
        where they all share one, else the cap's own order. A policy that would check a
        charged scope otherwise is refused.
        """
        if not isinstance(policy, Policy):
            raise ValueError(f"policy must be a Policy, got {policy!r}")
        if parse_share(policy.query_type) is not None:
            raise ValueError(
                f"query type {policy.query_type!r} names a principal's share: a share is set "
                "as part of its scope's policy (Policy(shares=...))"
            )
        free_text("compliance_clause", policy.compliance_clause)
        self._store.authority.sign_policy(policy.as_record())  # refused without the admin key
        with self._database.write() as connection:
            # Every charge share-locks this row (PostgreSQL): the check below then sees
            # every scope charged by a transaction under way (SQLite: one writer at a time).
            connection.execute(
                select(LedgerConfig.id).where(LedgerConfig.id == 1).with_for_update()
            )
            stored = self._store.read(connection, honoured=False)
            charged = [
                LedgerKey.from_canonical(tenant, "-", query_type, "-")
                for tenant, query_type in connection.execute(
                    select(WindowRow.tenant, WindowRow.query_type).distinct()
                ).all()
            ]
            before = policy_lookup(stored)
            order = self._order(policy, charged, stored)
            policy = dataclasses.replace(
                policy, filter_order=order, shares=self._priced_shares(policy, order)
            )
            after = policy_lookup({**stored, policy.scope: policy})
            for probe in charged:
                tenant, query_type = probe.tenant, probe.query_type
                was, becomes = before(probe).calendar, after(probe).calendar
                if was != becomes:
                    raise LedgerError(
                        f"tenant {tenant!r}, query type {query_type!r} has been charged in "
                        f"{was.kind} windows; a policy giving it {becomes.kind} windows would "
                        "open a second set of windows over the same time. Keep its calendar "
                        "(or use a new query type)"
                    )
                was_order, order = before(probe).filter_order, after(probe).filter_order
                if was_order != order:
                    raise LedgerError(
                        f"tenant {tenant!r}, query type {query_type!r} has been charged with "
                        f"its cap checked {checked_at(was_order)}; a policy checking it "
                        f"{checked_at(order)} would not be one privacy filter (a filter's "
                        "order is fixed before its first release). Keep its filter_order "
                        f"({_spelled(was_order)}), or use a new query type"
                    )
            write_policy(
                connection, self._journal, self._store.authority, policy, clock.stamp(clock.now())
            )
        return policy

    def _priced_shares(self, policy: Policy, order: float | None) -> tuple[Share, ...]:
        """``policy``'s shares with their caps at its filter order (:mod:`shares`)."""
        if not policy.shares or order is None:
            return policy.shares
        term = self._pricing.conversion_term(order)
        priced = share_caps(policy.shares, policy.cap_epsilon, term)
        if not shares_sound(priced, policy.cap_epsilon, term):  # what verify will prove
            raise ValueError(
                f"a cap of {policy.cap_epsilon:g} leaves too small a Rényi budget at order "
                f"{order:g} to divide (its conversion alone costs {term:.17g}): give a larger cap"
            )
        return priced

    def _order(
        self, policy: Policy, charged: list[LedgerKey], stored: Mapping[tuple[str, str], Policy]
    ) -> float | None:
        """``policy``'s filter order as it is stored: ``"auto"`` the one rule the charged
        pairs it governs are checked by (a change of cap keeps a filter's order, and a
        scope charged on the reported epsilon keeps that), else the cap's own order."""
        order = policy.filter_order
        if order == AUTO_ORDER:
            before, governs = policy_lookup(stored), policy_lookup({**stored, policy.scope: policy})
            was = {before(p).filter_order for p in charged if governs(p).scope == policy.scope}
            if len(was) == 1:
                return next(iter(was))
        return self._pricing.fixed_order(order, policy.cap_epsilon)

    def policies(self) -> list[Policy]:
        """Every stored policy, default first."""
        with self._database.reading() as connection:
            stored = self._store.read(connection)
        return sorted(stored.values(), key=lambda p: (p.scope != (ANY, ANY), p.scope))

    def policy_for(self, key: LedgerKey) -> Policy:
        """The policy that applies to ``key``."""
        key = one_key(key)[0]
        return self.policy_for_scope(key.tenant, key.query_type)

    def policy_for_scope(self, tenant: str, query_type: str) -> Policy:
        """The policy for a tenant and query type (what decides a key's window calendar)."""
        tenant = canonical_part("tenant", tenant)
        query_type = canonical_part("query_type", query_type)
        with self._database.reading() as connection:
            return policy_of_scope(self._store.read(connection), tenant, query_type)

    def policy_for_release(self, tenant: str, query_type: str, dag: str | None) -> Policy:
        """The policy a release by DAG ``dag`` is held to at (tenant, query type): its
        principal's share where the cap is divided (:mod:`shares`), else the scope's. What
        noise is planned against and a sensor's "never fits" is decided on."""
        policy = self.policy_for_scope(tenant, query_type)
        share = principal_of(policy.shares, dag)
        return policy if share is None else policy.share_policy(share.principal)


def _spelled(order: float | None) -> str:
    """A stored filter order as ``filter_order`` (and ``--filter-order``) is given."""
    return REPORTED if order is None else f"{order:g}"
