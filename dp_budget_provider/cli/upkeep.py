"""The commands that create, change or maintain the ledger: schema, creation, verify,
quarantine, keys, resets, reaping and policies."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta

from dp_budget_provider.cli.errors import CommandError, UsageError
from dp_budget_provider.cli.output import (
    print_lines,
    shortest,
)
from dp_budget_provider.cli.target import (
    admin_key_of,
    chain_key_of,
    is_initialised,
    ledger_target,
    make_sqlite_folder,
    open_ledger,
    opened,
    url_of,
)
from dp_budget_provider.ledger import BudgetCap, PrivacyBudgetLedger
from dp_budget_provider.ledger.audit.authority import ADMIN_KEY_ENV, AdminKey, AdminPublicKey
from dp_budget_provider.ledger.storage import database, history
from dp_budget_provider.ledger.views import report
from dp_budget_provider.ledger.windows.calendar import display_window
from dp_budget_provider.ledger.windows.policy import ANY, checked_at, revised_policy


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    """Create or upgrade the ledger schema (Alembic)."""
    make_sqlite_folder(url_of(args))
    engine = database.make_engine(url_of(args))
    try:
        revision = database.upgrade(engine)
        print(f"ledger schema of {database.safe_url(engine)} is at revision {revision}")
    finally:
        engine.dispose()
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    """Create a ledger with its default cap, fixed delta and conversion."""
    url = url_of(args)
    cap = BudgetCap(args.epsilon, args.delta, args.warn_fraction, args.filter_order)
    make_sqlite_folder(url)
    existed = is_initialised(url)
    admin = admin_key_of(args)
    ledger = PrivacyBudgetLedger(
        cap,
        url=url,
        conversion=args.conversion,
        chain_key=chain_key_of(args),
        admin=admin,
        admin_public_key=ledger_target(args).admin_pin,
    )
    try:
        verb = "exists already with this configuration" if existed else "created"
        checked = ledger.policy_for_scope(ANY, ANY).filter_order
        print(
            f"ledger {ledger.url} {verb}: delta={shortest(ledger.delta)}, default cap "
            f"eps={shortest(cap.epsilon)} (warning at {cap.warn_fraction:.0%}) checked "
            f"{checked_at(checked)}, conversion={ledger.conversion}, "
            f"{ledger.orders.size} Rényi orders"
        )
        if checked is None:
            print(
                "warning: the default cap is checked on the reported epsilon, which is not a "
                "privacy filter under adaptive releases (docs/accounting.md)",
                file=sys.stderr,
            )
        if admin is None:
            print(
                "warning: no administrator key (--admin-key): this ledger's policies cannot "
                "change until one is recorded with `dp-budget admin init`",
                file=sys.stderr,
            )
    finally:
        ledger.close()
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Prove the ledger's tables from its history; quarantine the ledger if they disagree."""
    store = args.checkpoint
    with opened(args) as ledger:
        result = report.verification_record(ledger, store)
    if not result["keyed"]:
        print(
            f"warning: the history is not keyed ({history.CHAIN_KEY_ENV} unset): whoever can "
            "write the ledger database can rewrite it unnoticed after the last checkpoint",
            file=sys.stderr,
        )
    for note in result["notes"]:
        print(f"note: {note}", file=sys.stderr)
    if result["ok"]:
        checkpointed = "" if store is None else f"; checkpointed in {store.path}"
        print(
            f"OK: {result['entries']} history entries, {result['accounts']} accounts; links, "
            f"reservations, accounts, windows, policies and caps check out{checkpointed}"
        )
        return 0
    counted = (
        f" in {result['entries']} history entries and {result['accounts']} accounts"
        if result["entries"] is not None
        else ""
    )
    print(f"FAILED: {len(result['problems'])} problem(s){counted}; the ledger is quarantined")
    print_lines([f"  {problem}" for problem in result["problems"]])
    return 1


def cmd_quarantine_clear(args: argparse.Namespace) -> int:
    """Let releases run again (an audited entry naming you and the reason)."""
    with opened(args) as ledger:
        ledger.clear_quarantine(args.reason)
        print(f"quarantine cleared by {ledger.actor}: {args.reason.strip()}")
    return 0


def cmd_db_adopt_key(args: argparse.Namespace) -> int:
    """Key an unkeyed ledger's history with $DP_BUDGET_CHAIN_KEY from now on."""
    key = chain_key_of(args)
    if key is None:
        raise UsageError(
            f"set {history.CHAIN_KEY_ENV} (or the --conn-id connection's extra "
            "chain_key_secret) to the new chain key first"
        )
    ledger = open_ledger(
        url_of(args),
        chain_key=None,
        admin=admin_key_of(args),
        admin_pin=ledger_target(args).admin_pin,
    )
    try:
        ledger.adopt_chain_key(key)
        print(
            f"the history of {ledger.url} is keyed from now on: open it with "
            f"{history.CHAIN_KEY_ENV} (and the Airflow connection's extra chain_key_secret) "
            "everywhere"
        )
    finally:
        ledger.close()
    return 0


def cmd_admin_keygen(args: argparse.Namespace) -> int:
    """Write a new administrator key to a new file only its owner can read."""
    key = AdminKey.generate()
    try:
        key.write(args.out)
    except FileExistsError:
        raise CommandError(f"{args.out} exists: an admin key is never overwritten") from None
    print(f"administrator key written to {args.out} (keep it off every Airflow worker)")
    print(f"public key: {key.public.text}")
    return 0


def cmd_admin_init(args: argparse.Namespace) -> int:
    """Make --admin-key the ledger's administrator key (once); print the pin for the
    connections."""
    if admin_key_of(args) is None:
        raise UsageError(
            f"admin init needs the administrator's key: --admin-key or ${ADMIN_KEY_ENV}"
        )
    with opened(args) as ledger:
        public = ledger.record_admin_key()
    print(f"the ledger's administrator key is {AdminPublicKey(public).key_id}")
    print("pin it in every dp_budget connection's extra (workers refuse another key):")
    print(json.dumps({"admin_public_key": public}))
    return 0


def cmd_reset(args: argparse.Namespace) -> int:
    """Drop the live accounts of closed windows (history is kept)."""
    with opened(args) as ledger:
        if args.closed:
            dropped = ledger.reset_closed()
            if not dropped:
                print("no closed window has live accounts")
            for window, count in dropped.items():
                print(
                    f"reset window {display_window(window)}: {count} account(s) dropped, "
                    "history kept"
                )
        else:
            count = ledger.reset(args.window)
            print(
                f"reset window {display_window(args.window)}: {count} account(s) dropped, "
                "history kept"
            )
    return 0


def cmd_reap(args: argparse.Namespace) -> int:
    """Charge reservations left open by dead workers: their lease ran out (or, with
    ``--older-than``, they are older than that)."""
    with opened(args) as ledger:
        reaped = ledger.reap(args.older_than)
    if not reaped:
        older = "" if args.older_than is None else f" and none is older than {args.older_than}"
        print(f"no open reservation's lease has run out{older}")
        return 0
    print_lines([f"reaped {reservation_id}" for reservation_id in reaped])
    print(f"{len(reaped)} reservation(s) charged (never refunded)")
    return 0


def cmd_policy_set(args: argparse.Namespace) -> int:
    """Create or replace one scope's policy; options not given keep the scope's current values."""
    with opened(args) as ledger:
        policy, created = revised_policy(
            ledger.policies(),
            args.tenant,
            args.query_type,
            cap_epsilon=args.epsilon,
            warn_fraction=args.warn_fraction,
            calendar=args.calendar,
            length_seconds=args.length_seconds,
            min_window=None
            if args.min_window_seconds is None
            else timedelta(seconds=args.min_window_seconds),
            grace=args.grace,
            compliance_clause=args.clause,
            across=args.across,
            horizon_windows=args.horizon_windows,
            filter_order=args.filter_order,
            shares=() if args.no_shares else args.shares,
        )
        policy = ledger.set_policy(policy)
    print(
        f"policy {policy.tenant}/{policy.query_type} {'created' if created else 'updated'}: cap "
        f"{shortest(policy.cap_epsilon)}, warning at {policy.warn_fraction:.0%}, calendar "
        f"{policy.calendar.label}, checked {checked_at(policy.filter_order)}, minimum window "
        f"{int(policy.min_window.total_seconds())}s, "
        f"grace {int(policy.grace.total_seconds())}s, "
        f"clause: {policy.compliance_clause or '(none)'}"
    )
    for share in policy.shares:
        print(
            f"  share {share.principal}: {share.fraction:g} of the budget (cap "
            f"{shortest(share.cap_epsilon or 0.0)} at order {policy.filter_order:g}), "
            f"DAGs {', '.join(share.dags)}"
        )
    return 0
