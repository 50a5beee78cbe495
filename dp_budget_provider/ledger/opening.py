"""Opening a ledger database: its configuration is written once, then checked forever.

delta, the orders grid and the conversion are fixed when a ledger is created, because
curves on different grids or at different deltas cannot be compared or composed
(letting delta vary is "delta shopping"). Opening an existing ledger with other values
is refused; the default cap may be omitted to take what is stored. Every task opens a
ledger, so a ready one is opened in a read transaction (no write lock); only a new one
takes the write lock, where a racing twin's creation is found and checked instead, and
where the new ledger's first entries are written once the schema exists and the
transaction has proven its revision like every write (:func:`database.proven`).
"""

from __future__ import annotations

import contextlib
import json
from datetime import timedelta
from typing import NamedTuple

import numpy as np
from sqlalchemy import Connection, insert, select, text, update

from dp_budget_provider.accounting import Conversion
from dp_budget_provider.ledger.accounts.pricing import Pricing
from dp_budget_provider.ledger.audit.authority import AdminKey, AdminPublicKey, LedgerAuthority
from dp_budget_provider.ledger.errors import LedgerConfigMismatch, LedgerCorrupt
from dp_budget_provider.ledger.storage import clock, database, history
from dp_budget_provider.ledger.storage.entries import CreateEntry
from dp_budget_provider.ledger.storage.journal import Journal
from dp_budget_provider.ledger.storage.schema import ChainHead, LedgerConfig
from dp_budget_provider.ledger.windows.calendar import WindowCalendar
from dp_budget_provider.ledger.windows.policy import (
    ANY,
    AUTO_ORDER,
    BudgetCap,
    Policy,
    checked_at,
)
from dp_budget_provider.ledger.windows.policy_store import PolicyStore, write_policy

# Taken by every process creating a ledger, so only one initialises it.
_CREATE_LOCK = 7263514


class Settings(NamedTuple):
    """What a ledger's database fixes for its whole life (besides grid and conversion)."""

    delta: float
    chains: int
    authority: LedgerAuthority


class NewLedger(NamedTuple):
    """What a new ledger is created with."""

    orders: np.ndarray
    conversion: Conversion
    calendar: WindowCalendar
    actor: str
    key: history.ChainKey
    admin: AdminKey | None  # the administrator's key, where an administrator opens it
    admin_pin: AdminPublicKey | None  # the key the opener requires the ledger to have


def open_ledger(
    reading: database.Transaction,
    creating: database.Transaction,
    clock_skew: timedelta,
    policies: PolicyStore,
    new: NewLedger,
    cap: BudgetCap | None,
    if_new: BudgetCap | None,
) -> Settings:
    """Open the ledger, creating schema and configuration if the database has none.

    ``cap`` must match what is stored (delta and default cap); ``if_new``'s default cap
    only applies to a new ledger, but its delta must match too: every eps the caller
    reads is at that delta. The grid and conversion must always match. ``creating`` is a
    write transaction that may create the schema (:func:`database.migrating`); its writes
    come after the proof every write gives, with ``clock_skew``.
    """
    with reading() as connection:
        if not database.is_empty(connection):
            database.check_schema(connection)
            if database.is_initialised(connection):
                return _check(connection, policies, new, cap, if_new)
    with creating() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(text(f"SELECT pg_advisory_xact_lock({_CREATE_LOCK})"))
        if database.is_empty(connection):
            database.create_schema(connection)
        database.check_schema(connection)
        if database.is_initialised(connection):
            return _check(connection, policies, new, cap, if_new)
        if connection.execute(text("SELECT count(*) FROM dp_history")).scalar_one():
            raise LedgerCorrupt(
                "dp_ledger_config is empty but the history has entries: the configuration "
                "was deleted; refusing to create a new ledger over this one"
            )
        default = cap or if_new
        if default is None:
            raise LedgerConfigMismatch("a new ledger needs a BudgetCap for its default policy")
        with database.proving(connection, clock_skew):
            return _initialise(connection, policies, new, default, clock.stamp(clock.now()))


def _initialise(
    connection: Connection, policies: PolicyStore, new: NewLedger, cap: BudgetCap, now: str
) -> Settings:
    admin = new.admin.public if new.admin is not None else None
    if new.admin_pin is not None and new.admin_pin != admin:
        raise LedgerConfigMismatch(
            f"the ledger does not exist, and it is expected to have administrator key "
            f"{new.admin_pin.key_id}: its administrator creates it (`dp-budget init "
            "--admin-key FILE`)"
        )
    connection.execute(
        insert(LedgerConfig).values(
            id=1,
            delta=cap.delta,
            orders=json.dumps(new.orders.tolist()),
            conversion=new.conversion,
            created_at=now,
            chains=history.CHAINS,
            chain_key_id=new.key.key_id,
            admin_key=admin.text if admin is not None else None,
        )
    )
    connection.execute(
        insert(ChainHead),
        [
            {"id": chain, "seq": 0, "hash": history.GENESIS, "key_id": new.key.key_id}
            for chain in range(1, history.CHAINS + 1)
        ],
    )
    journal = Journal(new.key, history.CHAINS, new.actor)
    seq = journal.append(
        connection,
        CreateEntry(
            delta=cap.delta,
            orders=tuple(new.orders.tolist()),
            conversion=new.conversion,
            chains=history.CHAINS,
            chain_key_id=new.key.key_id,
            admin_key=admin.text if admin is not None else None,
        ),
        at=now,
    )
    if new.key.keyed:
        connection.execute(update(LedgerConfig).where(LedgerConfig.id == 1).values(keyed_from=seq))
    authority = LedgerAuthority(history.ledger_identity(connection), admin, new.admin)
    policies.authority = authority
    write_policy(
        connection,
        journal,
        authority,
        Policy(
            cap.epsilon,
            cap.warn_fraction,
            calendar=new.calendar,
            filter_order=Pricing(new.orders, cap.delta, new.conversion).fixed_order(
                cap.filter_order, cap.epsilon
            ),
        ),
        now,
    )
    return Settings(cap.delta, history.CHAINS, authority)


def _authority(connection: Connection, stored: str | None, new: NewLedger) -> LedgerAuthority:
    """The administrator key the ledger records, as long as it is the one the opener
    pins (and the one it signs with, if it holds one)."""
    try:
        trusted = AdminPublicKey(stored) if stored is not None else None
    except ValueError as error:
        raise LedgerCorrupt(f"dp_ledger_config.admin_key is unreadable: {error}") from None
    for expected, who in ((new.admin_pin, "pinned by the connection"), (new.admin, None)):
        if expected is None:
            continue
        public = expected.public if isinstance(expected, AdminKey) else expected
        if trusted is None and who is not None:
            raise LedgerConfigMismatch(
                f"the ledger has no administrator key, but key {public.key_id} is {who}: "
                "record it with `dp-budget admin init --admin-key FILE`"
            )
        if trusted is not None and trusted != public:
            raise LedgerConfigMismatch(
                f"the ledger's administrator key is {trusted.key_id}, not {public.key_id} "
                f"({who or 'the key given to sign with'}); if the ledger's key was swapped "
                "in its database, that is an insider's edit: run `dp-budget verify`"
            )
    return LedgerAuthority(history.ledger_identity(connection), trusted, new.admin)


def _check_key(stored: str | None, key: history.ChainKey) -> None:
    """Refuse to open a keyed history without its key, or with another one (fail closed)."""
    if stored == key.key_id:
        return
    if stored is None:
        raise LedgerConfigMismatch(
            "this ledger's history is not keyed, but a chain key was given: key it once with "
            "`dp-budget db adopt-key` (if it was keyed before, its history has been rewritten)"
        )
    if key.key_id is None:
        raise LedgerConfigMismatch(
            f"this ledger's history is keyed (key id {stored[:12]}): open it with its chain key "
            "(DP_BUDGET_CHAIN_KEY for the CLI, the connection extra chain_key in Airflow)"
        )
    raise LedgerConfigMismatch(
        f"this ledger's history is keyed with key id {stored[:12]}, not with the chain key "
        f"given (id {key.key_id[:12]})"
    )


def _check(
    connection: Connection,
    policies: PolicyStore,
    new: NewLedger,
    cap: BudgetCap | None,
    if_new: BudgetCap | None,
) -> Settings:
    """Refuse another grid, conversion, delta or default cap; return what is stored."""
    config = connection.execute(select(LedgerConfig).where(LedgerConfig.id == 1)).one_or_none()
    if config is None:
        raise LedgerCorrupt("dp_ledger_config has no row with id 1: the configuration was edited")
    _check_key(config.chain_key_id, new.key)
    authority = policies.authority = _authority(connection, config.admin_key, new)
    if connection.dialect.name == "postgresql":
        # Policies read after their version: reused while that version is current. One
        # its administrator did not sign is not remembered: every release refuses it, but
        # the ledger opens, so that verify can name it.
        with contextlib.suppress(LedgerCorrupt):
            policies.remember(connection, config.policy_version)
    stored_orders = json.loads(config.orders)
    if stored_orders != new.orders.tolist():
        raise LedgerConfigMismatch(
            f"ledger was created with a grid of {len(stored_orders)} orders; opening it with "
            f"a different grid of {new.orders.size} would mix incomparable curves"
        )
    if config.conversion != new.conversion:
        raise LedgerConfigMismatch(
            f"ledger was created with conversion {config.conversion!r}, not {new.conversion!r}"
        )
    asked = cap or if_new
    if asked is not None and asked.delta != config.delta:
        raise LedgerConfigMismatch(
            f"ledger delta is fixed at {config.delta!r} (since it was created); refusing to "
            f"open it with delta={asked.delta!r}"
        )
    if cap is not None:
        held = policies.snapshot
        default = (held[1] if held else policies.read(connection, honoured=False))[(ANY, ANY)]
        if (cap.epsilon, cap.warn_fraction) != (default.cap_epsilon, default.warn_fraction):
            raise LedgerConfigMismatch(
                f"ledger default cap is eps={default.cap_epsilon} (warn at "
                f"{default.warn_fraction}); refusing eps={cap.epsilon} (warn at "
                f"{cap.warn_fraction}). Change caps with set_policy, which is audited"
            )
        if cap.filter_order not in (AUTO_ORDER, default.filter_order):
            raise LedgerConfigMismatch(
                f"ledger default cap is checked {checked_at(default.filter_order)}; refusing "
                f"one checked {checked_at(cap.filter_order)}. Change it with set_policy"
            )
    return Settings(config.delta, config.chains, authority)
