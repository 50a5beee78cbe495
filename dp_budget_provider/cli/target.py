"""Which ledger a command opens (``--url``, ``$DP_BUDGET_URL`` or ``--conn-id``), and opening it
with the grid and conversion it was created with."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from sqlalchemy import select

from dp_budget_provider.cli.errors import CommandError, UsageError
from dp_budget_provider.ledger import PrivacyBudgetLedger
from dp_budget_provider.ledger.audit.authority import ADMIN_KEY_ENV, AdminKey
from dp_budget_provider.ledger.storage import database, history
from dp_budget_provider.ledger.storage.schema import LedgerConfig

URL_ENV = "DP_BUDGET_URL"


@dataclass(frozen=True)
class LedgerTarget:
    """The ledger a command works on: its database URL and its history's chain key."""

    url: str
    chain_key: str | None
    admin_pin: str | None = None  # the administrator key the connection pins
    # The maintenance jobs' intervals under the deployment's schedules (``--conn-id``
    # reads them from Airflow's configuration); None: the shipped DAGs' defaults.
    maintenance_intervals: Mapping[str, timedelta] | None = None


def _target_from_environment(args: argparse.Namespace) -> LedgerTarget:
    url = getattr(args, "url", None) or os.environ.get(URL_ENV)
    if not url:
        raise UsageError(
            f"no ledger database given: pass --url URL, set {URL_ENV} or pass --conn-id ID"
        )
    return LedgerTarget(url, os.environ.get(history.CHAIN_KEY_ENV) or None)


def _target_from_connection(conn_id: str) -> LedgerTarget:
    """The URL and chain key of an Airflow connection, read by the tasks' own hook (so
    every secrets backend, and the embedded default for ``dp_budget_default``, apply).

    Airflow's logging writes to the stdout it finds when it is set up (on import) and when
    a logger is first used; the CLI's stdout is the command's output (``--json``, a report
    redirected to a file). So Airflow is imported and asked here with stderr as its stdout,
    and the CLI uses no Airflow after that.
    """
    with contextlib.redirect_stdout(sys.stderr):
        return _read_connection(conn_id)


def _read_connection(conn_id: str) -> LedgerTarget:
    try:
        from airflow.sdk.exceptions import AirflowNotFoundException

        from dp_budget_provider.hooks.dp_budget import DPBudgetHook
        from dp_budget_provider.hooks.maintenance import maintenance_intervals
    except ImportError as error:
        raise UsageError(
            f"--conn-id needs Apache Airflow, which cannot be imported here ({error}); "
            f"install apache-airflow or pass --url URL / set {URL_ENV}"
        ) from None
    # Outside a task the Task SDK searches the metadata database only in a "server"
    # process; this is an administrator's tool, like `airflow connections get`, which
    # declares itself one the same way.
    os.environ.setdefault("_AIRFLOW_PROCESS_CONTEXT", "server")
    # Airflow's logging config shows INFO; the schema migrations' chatter is not output.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    hook = DPBudgetHook(conn_id)
    try:
        return LedgerTarget(
            hook.ledger_url(), hook.chain_key(), hook.admin_public_key(), maintenance_intervals()
        )
    except AirflowNotFoundException:
        raise CommandError(
            f"--conn-id {conn_id}: no such Airflow connection in any secrets backend "
            f"(AIRFLOW_CONN_{conn_id.upper()}, the metadata database or the configured backend)"
        ) from None
    except ValueError as error:
        raise CommandError(f"--conn-id {conn_id}: {error}") from None


def ledger_target(args: argparse.Namespace) -> LedgerTarget:
    """Where the ledger is, resolved once per command: a command that asks twice (e.g.
    ``db upgrade``) must not look the connection up twice."""
    if getattr(args, "ledger_target", None) is None:
        conn_id = getattr(args, "conn_id", None)
        if conn_id is None:
            args.ledger_target = _target_from_environment(args)
        elif getattr(args, "url", None) or os.environ.get(URL_ENV):
            raise UsageError(
                f"--conn-id and --url/{URL_ENV} name the ledger twice: give only one "
                f"(unset {URL_ENV} to use --conn-id)"
            )
        else:
            args.ledger_target = _target_from_connection(conn_id)
    return args.ledger_target


def url_of(args: argparse.Namespace) -> str:
    return ledger_target(args).url


def chain_key_of(args: argparse.Namespace) -> str | None:
    return ledger_target(args).chain_key


def admin_key_of(args: argparse.Namespace) -> AdminKey | None:
    """The administrator's key, from --admin-key or $DP_BUDGET_ADMIN_KEY_FILE (None
    without either: the commands that need it say so)."""
    path = getattr(args, "admin_key", None) or os.environ.get(ADMIN_KEY_ENV)
    if not path:
        return None
    try:
        return AdminKey.load(path)
    except ValueError as error:
        raise UsageError(f"--admin-key: {error}") from None


def _sqlite_file(url: str) -> Path | None:
    parsed = database.parse_url(url)
    return database.sqlite_path(parsed) if parsed.get_backend_name() == "sqlite" else None


def _refuse_missing_sqlite_file(url: str) -> None:
    """Reading commands must not create an empty SQLite file at a mistyped path."""
    path = _sqlite_file(url)
    if path is not None and not path.exists():
        missing = "" if path.parent.is_dir() else f" (its folder {path.parent} does not exist)"
        raise CommandError(
            f"no ledger database file {path}{missing}: create one with `dp-budget init`"
        )


def make_sqlite_folder(url: str) -> None:
    """The commands that create a ledger create its SQLite file's folder, and say so."""
    path = _sqlite_file(url)
    if path is not None and not path.parent.is_dir():
        path.parent.mkdir(parents=True)
        print(f"created folder {path.parent}")


def open_ledger(
    url: str,
    *,
    chain_key: str | None,
    admin: AdminKey | None = None,
    admin_pin: str | None = None,
) -> PrivacyBudgetLedger:
    """Open an existing ledger with the grid and conversion it was created with (and
    with the administrator's key, where one is given)."""
    _refuse_missing_sqlite_file(url)
    engine = database.make_engine(url)
    try:
        with database.transaction(engine, write=False) as connection:
            missing = database.is_empty(connection)
            if not missing:
                database.check_schema(connection)
                missing = not database.is_initialised(connection)
            if missing:
                raise CommandError(
                    f"no ledger in {database.safe_url(engine)}: create one with "
                    "`dp-budget init --epsilon E --delta D`"
                )
            config = connection.execute(
                select(LedgerConfig.orders, LedgerConfig.conversion).where(LedgerConfig.id == 1)
            ).one()
    finally:
        engine.dispose()
    return PrivacyBudgetLedger(
        url=url,
        orders=json.loads(config.orders),
        conversion=config.conversion,
        chain_key=chain_key,
        admin=admin,
        admin_public_key=admin_pin,
    )


@contextlib.contextmanager
def opened(args: argparse.Namespace) -> Iterator[PrivacyBudgetLedger]:
    target = ledger_target(args)
    ledger = open_ledger(
        target.url, chain_key=target.chain_key, admin=admin_key_of(args), admin_pin=target.admin_pin
    )
    try:
        yield ledger
    finally:
        ledger.close()


def is_initialised(url: str) -> bool:
    engine = database.make_engine(url)
    try:
        with database.transaction(engine, write=False) as connection:
            return not database.is_empty(connection) and database.is_initialised(connection)
    finally:
        engine.dispose()
