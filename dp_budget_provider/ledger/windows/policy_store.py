"""The ledger's policies as stored: read, reused while their version holds, written audited.

Every release needs the policy of each of its keys. Reading and validating the policy
rows for every release cost more than the release's own writes, so:

* a ``Policy`` built from a row is kept and reused for an identical row (rows are still
  read whenever policies are asked for: never stale);
* a row is honoured only with its administrator's signature (:mod:`authority`), checked
  once per distinct row;
* on PostgreSQL a trigger bumps ``dp_ledger_config.policy_version`` on any change to
  ``dp_policies``, and the server reports that version with the rows it locks, so the
  policies last read are reused for as long as the version they were read at is current.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, insert, update

from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.audit.authority import LedgerAuthority
from dp_budget_provider.ledger.errors import LedgerCorrupt
from dp_budget_provider.ledger.storage import database, history, pipeline, statements
from dp_budget_provider.ledger.storage.entries import PolicyEntry
from dp_budget_provider.ledger.storage.journal import Journal
from dp_budget_provider.ledger.storage.schema import LedgerConfig, PolicyRow
from dp_budget_provider.ledger.windows.calendar import WindowCalendar
from dp_budget_provider.ledger.windows.policy import ANY, Policy, lookup_order
from dp_budget_provider.ledger.windows.shares import Share, parse_share

Policies = dict[tuple[str, str], Policy]


class PolicyStore:
    """Reads the stored policies for one ledger, reusing what it validated before."""

    def __init__(self, reading: database.Transaction) -> None:
        self._reading = reading  # a read transaction of the ledger's own
        self._built: dict[tuple[object, ...], Policy] = {}
        # Set when the ledger is opened (its administrator key decides what is honoured).
        self.authority: LedgerAuthority | None = None
        # (policy_version, policies read at it), PostgreSQL only: reused while current.
        self.snapshot: tuple[int, Policies] | None = None

    def read(self, source: Connection | pipeline.Pipeline, *, honoured: bool = True) -> Policies:
        """The stored policies, read now, in the caller's transaction (or pipeline's).

        With ``honoured`` (every read that decides or reports a cap), a row its
        administrator did not sign is refused (:class:`LedgerCorrupt`): ignoring it could
        fall back to a looser policy. Only the administrator's own ``set_policy`` reads
        without, to replace such a row.
        """
        if isinstance(source, pipeline.Pipeline):
            rows = source.query(statements.POLICY_ROWS)
        else:
            rows = source.exec_driver_sql(statements.POLICY_ROWS).all()
        policies = {}
        policy_set = None
        for row in rows:
            values = tuple(row)
            policy_set = values[-1]
            policy = self._built.get(values)
            if policy is None:
                policy = policy_of_row(values)
                if honoured:
                    self._check_signed(policy, values[-2])
                    self._built[values] = policy
            policies[(values[0], values[1])] = policy
        if (ANY, ANY) not in policies:
            raise LedgerCorrupt("the ledger has no default policy")
        if honoured and not self._authority().policy_set_honoured(
            set_records(policies.values()), policy_set
        ):
            raise LedgerCorrupt(
                "the ledger's set of policies is not the one its administrator signed (a "
                "policy deleted, added or swapped for another in its database): it is not "
                "honoured, and nothing is released until the administrator sets a policy "
                "again (`dp-budget policy set`) and `dp-budget verify` is run"
            )
        return policies

    def _authority(self) -> LedgerAuthority:
        if self.authority is None:
            raise LedgerCorrupt("the ledger's policies were read before its authority")
        return self.authority

    def _check_signed(self, policy: Policy, signature: object) -> None:
        if not self._authority().policy_honoured(policy.as_record(), signature):
            raise LedgerCorrupt(
                f"the policy of tenant {policy.tenant!r}, query type {policy.query_type!r} "
                f"(cap eps {policy.cap_epsilon!r}) is not signed by the ledger's administrator: "
                "it was written without the administrator's authority (by SQL or by task "
                "code) and is not honoured; nothing is released until the administrator "
                "sets it again (`dp-budget policy set`) and `dp-budget verify` is run"
            )

    def remember(self, connection: Connection, version: int) -> Policies:
        """Read the policies at ``version`` (read after it, in the same transaction)."""
        policies = self.read(connection)
        self.snapshot = (version, policies)
        return policies

    def current(self, pipe: pipeline.Pipeline) -> Policies:
        """The policies as a charge chooses its wider scopes by, before its locks: the
        last read at a known version (PostgreSQL), else read now in ``pipe``'s transaction
        without their signatures' check (none when they are unreadable). The charge
        proves its choice against the honoured policies it reads under its locks
        (:meth:`at`), after it has refused a quarantined ledger, so a tampered policy is
        refused where it always was and never chooses anything."""
        if self.snapshot is not None:
            return self.snapshot[1]
        try:
            return self.read(pipe, honoured=False)
        except (LedgerCorrupt, ValueError):  # a row no policy can be built from
            return {}

    def at(self, pipe: pipeline.Pipeline | None, version: int | None) -> Policies:
        """The policies, reusing the last ones read while ``version`` says they are current.

        ``version`` is ``dp_ledger_config.policy_version`` as the server reported it with
        the locked rows (PostgreSQL); None (SQLite, in-process reads are cheap) always
        reads. Without ``pipe`` they are read in a transaction of their own.
        """
        if version is not None and self.snapshot is not None:
            known, policies = self.snapshot
            if known == version:
                return policies
        if pipe is None:
            with self._reading() as connection:
                policies = self.read(connection)
        else:
            policies = self.read(pipe)
        if version is not None:
            self.snapshot = (version, policies)
        return policies


def policy_of_row(values: tuple[Any, ...]) -> Policy:
    """A policy as :data:`statements.POLICY_ROWS` reads its row."""
    tenant, query_type, cap, warn, calendar, length, min_window, clause, grace = values[:9]
    span, order, shares = values[9:12]
    return Policy(
        cap_epsilon=cap,
        warn_fraction=warn,
        tenant=tenant,
        query_type=query_type,
        calendar=WindowCalendar(calendar, length, span or 1),
        min_window=timedelta(seconds=min_window),
        compliance_clause=clause,
        grace=timedelta(seconds=grace),
        filter_order=order,
        shares=tuple(Share.from_record(r) for r in json.loads(shares)) if shares else (),
    )


def set_records(policies: Iterable[Policy]) -> list[dict[str, object]]:
    """The whole set of policies as the administrator signs it: records in scope order."""
    return [policy.as_record() for policy in sorted(policies, key=lambda p: p.scope)]


def policy_of_scope(
    policies: Mapping[tuple[str, str], Policy], tenant: str, query_type: str
) -> Policy:
    """The policy over a (canonical) tenant and query type: the most specific stored scope;
    for a principal's share accounts, its share of the scope's policy (:mod:`shares`)."""
    share = parse_share(query_type)
    if share is not None:
        principal, scope_query_type = share
        return policy_of_scope(policies, tenant, scope_query_type).share_policy(principal)
    for scope in lookup_order(tenant, query_type):
        if scope in policies:
            return policies[scope]
    raise LedgerCorrupt("the ledger has no default policy")


def policy_for(policies: Mapping[tuple[str, str], Policy], key: LedgerKey) -> Policy:
    """The policy that applies to ``key``: that of its tenant and query type."""
    return policy_of_scope(policies, key.tenant, key.query_type)


def policy_lookup(policies: Mapping[tuple[str, str], Policy]) -> Callable[[LedgerKey], Policy]:
    """:func:`policy_for` over many keys, looking each (tenant, query_type) up once."""
    found: dict[tuple[str, str], Policy] = {}

    def policy_of(key: LedgerKey) -> Policy:
        policy = found.get((key.tenant, key.query_type))
        if policy is None:
            policy = found[(key.tenant, key.query_type)] = policy_for(policies, key)
        return policy

    return policy_of


def write_policy(
    connection: Connection,
    journal: Journal,
    authority: LedgerAuthority,
    policy: Policy,
    now: str,
) -> None:
    """Create or replace the policy of ``policy.scope``, signed by the administrator (on
    a ledger that has one), with its history entry."""
    if isinstance(policy.filter_order, str):  # "auto" is set_policy's to resolve
        raise ValueError(
            f"a policy is stored with its filter order resolved, not {policy.filter_order!r}"
        )
    record = policy.as_record()
    signature = authority.sign_policy(record) if authority.trusted is not None else None
    values = {k: v for k, v in record.items() if k not in ("tenant", "query_type")}
    values["calendar_span"] = record.get("calendar_span")
    values["filter_order"] = record.get("filter_order")
    values["shares"] = history.canonical_json(record["shares"]) if "shares" in record else None
    values["updated_at"] = now
    values["signature"] = signature
    updated = connection.execute(
        update(PolicyRow)
        .where(PolicyRow.tenant == policy.tenant, PolicyRow.query_type == policy.query_type)
        .values(**values)
    )
    if updated.rowcount == 0:
        connection.execute(
            insert(PolicyRow).values(tenant=policy.tenant, query_type=policy.query_type, **values)
        )
    if authority.trusted is not None:
        stored = connection.exec_driver_sql(statements.POLICY_ROWS).all()
        whole = set_records(policy_of_row(tuple(row)) for row in stored)
        connection.execute(
            update(LedgerConfig)
            .where(LedgerConfig.id == 1)
            .values(policy_set=authority.sign_policy_set(whole))
        )
    journal.append(connection, PolicyEntry(policy=policy, signature=signature), at=now)
