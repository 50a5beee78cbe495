"""The ledger's own tables against the replay: the configuration and the policies against
the acts that set them, each reservation against its reserve and closing entries, each
account (live, or sealed by a reset) against the charges, and each window against its
first charge and its seal.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
from sqlalchemy import Connection, and_, select

from dp_budget_provider.ledger.accounts import classes
from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.accounts.spend import Pending, Spend
from dp_budget_provider.ledger.audit import authority
from dp_budget_provider.ledger.audit.class_checks import referred_cohort_ids
from dp_budget_provider.ledger.audit.replay_acts import Configuration
from dp_budget_provider.ledger.audit.replay_charges import Charges
from dp_budget_provider.ledger.audit.replay_state import BATCH, ENTRY_BATCH, AuditSettings
from dp_budget_provider.ledger.errors import LedgerCorrupt
from dp_budget_provider.ledger.storage import history
from dp_budget_provider.ledger.storage.schema import (
    Account,
    ChainHead,
    HistoryEntry,
    LedgerConfig,
    PolicyRow,
    Reservation,
    ReservationKey,
    SealedAccount,
    Window,
)
from dp_budget_provider.ledger.windows.policy import ANY, Policy
from dp_budget_provider.ledger.windows.policy_store import policy_lookup, set_records

_STATES = {"commit": "committed", "reap": "reaped", "release": "released"}


def check_config(
    connection: Connection,
    configuration: Configuration,
    settings: AuditSettings,
    problems: list[str],
) -> None:
    """dp_ledger_config against the creation entry, the key adoption, the quarantines and
    the administrator's key of the history, and against the verifier's own settings."""
    config = connection.execute(select(LedgerConfig)).all()
    if len(config) != 1 or config[0].id != 1:
        problems.append(f"dp_ledger_config: {len(config)} rows, not the one row with id 1")
        return
    row = config[0]
    if configuration.create is None:
        problems.append("dp_ledger_config: no creation entry in the history")
        return
    entry, created = configuration.create
    expected = {
        "delta": created.delta,
        "orders": history.canonical_json(list(created.orders)),
        "conversion": created.conversion,
        "created_at": entry.at,
        "chains": row.chains if created.chains is None else created.chains,
    }
    stored = {
        "delta": row.delta,
        "orders": history.canonical_json(json.loads(row.orders)),
        "conversion": row.conversion,
        "created_at": row.created_at,
        "chains": row.chains,
    }
    for column, value in expected.items():
        if stored[column] != value:
            problems.append(
                f"dp_ledger_config.{column}: {stored[column]!r} differs from the creation "
                f"entry's {value!r}"
            )
    if created.chain_key_id is not None:
        keyed = (entry.seq, created.chain_key_id)
    else:
        keyed = configuration.adopted
    if (row.keyed_from, row.chain_key_id) != (keyed or (None, None)):
        problems.append(
            f"dp_ledger_config: keyed from {row.keyed_from!r} with key {row.chain_key_id!r}, "
            f"but the history says {keyed!r}"
        )
    if row.chain_key_id != settings.key.key_id:
        problems.append("dp_ledger_config.chain_key_id: not the key this verifier holds")
    if (row.delta, row.conversion) != (settings.delta, settings.conversion) or not np.array_equal(
        np.array(json.loads(row.orders)), settings.orders
    ):
        problems.append("dp_ledger_config: delta, grid or conversion differ from the verifier's")
    quarantine = (row.quarantined_at, row.quarantine_reason)
    if quarantine != (configuration.quarantine or (None, None)):
        problems.append(
            f"dp_ledger_config: quarantine {quarantine!r} differs from the history's "
            f"{configuration.quarantine!r}"
        )
    admin = configuration.admin.text if configuration.admin is not None else None
    authority_columns = {
        "admin_key": admin,
        "quarantine_epoch": configuration.quarantines,
        "clearance": configuration.clearance,
    }
    for column, value in authority_columns.items():
        if getattr(row, column) != value:
            problems.append(
                f"dp_ledger_config.{column}: {getattr(row, column)!r} differs from the "
                f"history's {value!r} (written without the administrator's authority?)"
            )
    whole = {"policies": set_records(configuration.policies.values())}
    signed = configuration.admin is None or configuration.admin.signed(
        authority.message(configuration.identity, "policy-set", whole), row.policy_set
    )
    if not signed or (configuration.admin is None and row.policy_set is not None):
        problems.append(
            "dp_ledger_config.policy_set: not the administrator's signature over the policies "
            "the history sets"
        )
    if connection.dialect.name == "postgresql":
        triggers = connection.exec_driver_sql(
            "SELECT count(*) FROM pg_trigger WHERE tgname = 'dp_policies_version' "
            "AND tgrelid = 'dp_policies'::regclass AND tgenabled <> 'D'"
        ).scalar_one()
        if triggers != 1:
            problems.append(
                "dp_policies: trigger dp_policies_version is missing or disabled (policy "
                "changes would not reach processes reusing policies by version)"
            )
    heads = set(connection.execute(select(ChainHead.key_id).distinct()).scalars())
    if heads - {row.chain_key_id}:
        problems.append(f"dp_chain_head.key_id: {sorted(map(str, heads))} is not the ledger's key")


def check_policies(
    connection: Connection, configuration: Configuration, problems: list[str]
) -> None:
    """Each policy row against its latest policy entry, and every policy entry's row there."""
    seen = set()
    for row in connection.execute(select(PolicyRow)):
        scope = (row.tenant, row.query_type)
        seen.add(scope)
        audited = configuration.policy_entries.get(scope)
        if audited is None:
            problems.append(f"policy {scope}: no policy entry in the history")
            continue
        record, at = audited
        for column, value in {**record, "updated_at": at}.items():
            held = getattr(row, column)
            if column == "shares":  # stored as its canonical JSON text
                value = history.canonical_json(value)
            if held != value:
                problems.append(
                    f"policy {scope}.{column}: {held!r} differs from its latest entry's {value!r}"
                )
    for scope in sorted(configuration.policy_entries.keys() - seen):
        problems.append(f"policy {scope}: in the history but its row is missing")
    if (ANY, ANY) not in seen:
        problems.append("dp_policies: no default policy")


def check_reservations(
    connection: Connection, settings: AuditSettings, problems: list[str]
) -> None:
    """Each reservation row against its reserve entry and its closing entry (streamed)."""
    opened = HistoryEntry.__table__.alias("r")
    closed = HistoryEntry.__table__.alias("c")
    statement = (
        select(
            Reservation,
            opened.c.seq.label("r_seq"),
            opened.c.at.label("r_at"),
            opened.c.actor.label("r_actor"),
            opened.c.payload.label("r_payload"),
            closed.c.action.label("c_action"),
            closed.c.at.label("c_at"),
        )
        .outerjoin(
            opened, and_(opened.c.reservation_id == Reservation.id, opened.c.action == "reserve")
        )
        .outerjoin(
            closed,
            and_(
                closed.c.reservation_id == Reservation.id,
                closed.c.action.in_(tuple(_STATES)),
            ),
        )
        .order_by(Reservation.id)
    )
    size = settings.orders.size
    for row in connection.execution_options(yield_per=ENTRY_BATCH).execute(statement):
        name = f"reservation {row.id}"
        if row.r_seq is None:
            problems.append(f"{name}: no reserve entry in the history")
            continue
        try:
            payload = json.loads(row.r_payload)
            cost = Spend.from_columns(
                row.cost_rho, row.cost_residual, row.cost_gaussian_mu2, size
            ).as_payload()
            mechanism = history.canonical_json(json.loads(row.mechanism))
        except (ValueError, TypeError, LedgerCorrupt) as error:
            problems.append(f"{name}: unreadable ({error})")
            continue
        expected: dict[str, Any] = {
            "attempt_id": payload.get("attempt_id"),
            "state": _STATES.get(row.c_action or "", "open"),
            "mechanism": history.canonical_json(payload.get("mechanism")),
            "count": payload.get("count"),
            "cost": history.canonical_json(payload.get("cost")),
            "key_count": payload.get("key_count"),
            "keys_digest": payload.get("keys_digest"),
            "actor": row.r_actor,
            "created_at": row.r_at,
            "resolved_at": row.c_at,
        }
        stored: dict[str, Any] = {
            "attempt_id": row.attempt_id,
            "state": row.state,
            "mechanism": mechanism,
            "count": row.count,
            "cost": history.canonical_json(cost),
            "key_count": row.key_count,
            "keys_digest": row.keys_digest,
            "actor": row.actor,
            "created_at": row.created_at,
            "resolved_at": row.resolved_at,
        }
        for column in ("token_hash", "prospective_epsilon"):
            if column in payload:
                expected[column] = payload[column]
                stored[column] = getattr(row, column)
        if "prospective_epsilon" in payload:  # the server-side reserve's columns stay empty
            for column in ("prospective_rho", "prospective_mu2"):
                expected[column] = None
                stored[column] = getattr(row, column)
        if stored.get("token_hash", "") is None:
            # A downgrade below 0005 drops token hashes; without one, nobody can commit or
            # release the reservation (only reaping charges it), so nothing is gained.
            del expected["token_hash"]
        for column, value in expected.items():
            if stored[column] != value:
                problems.append(
                    f"{name}.{column}: {stored[column]!r} differs from its history's {value!r}"
                )
    orphans = connection.execute(
        select(ReservationKey.reservation_id)
        .distinct()
        .where(~ReservationKey.reservation_id.in_(select(Reservation.id)))
    ).scalars()
    problems += [
        f"reservation {rid}: key rows of a reservation that does not exist" for rid in orphans
    ]
    missing = connection.execute(
        select(HistoryEntry.seq, HistoryEntry.reservation_id).where(
            HistoryEntry.action == "reserve",
            ~HistoryEntry.reservation_id.in_(select(Reservation.id)),
        )
    )
    problems += [f"entry {seq}: reservation {rid} has no row" for seq, rid in missing]


def check_accounts(connection: Connection, charges: Charges, problems: list[str]) -> int:
    """dp_accounts against the live accounts of the replay, and dp_sealed_accounts against
    the final spend of those a reset sealed and kept (then also sealed when it says)."""
    count = _check_store(connection, charges, problems, Account)
    _check_store(connection, charges, problems, SealedAccount)
    return count


def _check_store(connection: Connection, charges: Charges, problems: list[str], table: Any) -> int:
    """One table of accounts (live or sealed) against the replay; how many rows it holds."""
    size = charges.size
    sealed = table is SealedAccount
    cohort_ids = referred_cohort_ids(connection, charges)
    seen: set[LedgerKey] = set()
    count = 0
    for row in connection.execution_options(yield_per=BATCH).execute(select(table)):
        count += 1
        key = LedgerKey.from_row(row)
        seen.add(key)
        state = charges.keys.get(key)
        if sealed and (state is None or not state.kept):
            problems.append(
                f"sealed account {key}: no reset of the history sealed it with its final spend"
            )
            continue
        if not sealed and (state is None or state.dropped):
            problems.append(f"account {key}: no history entry charged it (or its window was reset)")
            continue
        try:
            spend = Spend.from_columns(row.rho, row.residual, row.gaussian_mu2, size)
            pending = Pending.from_columns(
                row.pending_rho, row.pending_residual, row.pending_mu2, row.pending_others, size
            )
        except (ValueError, TypeError, LedgerCorrupt) as error:
            problems.append(f"account {key}: unreadable ({error})")
            continue
        checks: list[tuple[str, bool]] = [
            ("committed spend", spend.close_to(state.live)),
            ("pending spend", pending.close_to(state.pending)),
            ("open_reservations", row.open_reservations == state.open),
            ("releases", row.releases == state.releases),
            ("rescoped_to", row.rescoped_to == state.rescoped_to),
            ("updated_at", row.updated_at == state.updated_at),
            ("size", row.size == state.size),
            (
                "cohort_id (the cohort whose members are its members)",
                row.cohort_id == cohort_ids.get((key.tenant, state.refers)),
            ),
        ]
        if sealed:
            scope = charges.scopes.get((key.tenant, key.query_type, key.window))
            checks.append(("sealed_at", scope is not None and row.sealed_at == scope.sealed_at))
        wrong = [what for what, fine in checks if not fine]
        if wrong:
            name = (
                f"sealed account {key}" if sealed else f"account {_account_name(connection, key)}"
            )
            problems += [f"{name}: {what} differs from the history's" for what in wrong]
    for key, state in charges.keys.items():
        if key in seen or state.dropped != sealed or (sealed and not state.kept):
            continue
        if state.required:
            where = "sealed with its final spend" if sealed else "charged or held"
            problems.append(f"account {key}: {where} in the history but missing")
    return count


def _account_name(connection: Connection, key: LedgerKey) -> str:
    """An account as a problem names it: a class by one of its subjects too."""
    example = classes.example_subject(connection, key)
    return str(key) if example == key else f"{key} (holding {example})"


def check_windows(
    connection: Connection, configuration: Configuration, charges: Charges, problems: list[str]
) -> None:
    """Each window row against the history: canonical for its calendar, created at its first
    charge, sealed when a reset sealed it; and every window charged has its row."""
    policy_of: Callable[[LedgerKey], Policy] = policy_lookup(configuration.policies)
    seen = set()
    for row in connection.execution_options(yield_per=BATCH).execute(select(Window)):
        scope = (row.tenant, row.query_type, row.window)
        seen.add(scope)
        name = f"window {row.window} of ({row.tenant}, {row.query_type})"
        calendar = policy_of(
            LedgerKey.from_canonical(row.tenant, "-", row.query_type, row.window)
        ).calendar
        if not calendar.is_canonical(row.window):
            problems.append(f"{name}: not a window of its {calendar.kind} calendar")
        known = charges.scopes.get(scope)
        if known is None:
            problems.append(f"{name}: no history entry charged it")
            continue
        if row.created_at != known.first_at:
            problems.append(
                f"{name}: created_at {row.created_at} is not its first charge {known.first_at}"
            )
        sealed = known.sealed_at
        legacy = charges.legacy_resets.get(row.window)
        if sealed is None and legacy is not None and known.first_at <= legacy:
            sealed = legacy  # reset before seals existed: the upgrade sealed it then
        if row.sealed_at != sealed:
            problems.append(
                f"{name}: sealed_at {row.sealed_at} differs from the history's {sealed}"
            )
    for scope in sorted(charges.scopes.keys() - seen):
        problems.append(f"window {scope[2]} of ({scope[0]}, {scope[1]}): charged but has no row")
