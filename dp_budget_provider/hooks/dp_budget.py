"""DPBudgetHook: how Airflow tasks reach the budget ledger.

Tasks have no metadata-database access in Airflow 3, so the ledger is its own
database behind an Airflow connection (type ``dpbudget``). Its ``extra`` may carry
``{"url": "<SQLAlchemy URL>"}``; otherwise host/port/schema/login/password describe a
PostgreSQL ledger. ``extra.chain_key_secret`` (or ``$DP_BUDGET_CHAIN_KEY`` in the workers'
environment) is the secret the history is linked with, kept out of the ledger database.
Its name ends in ``secret`` so that Airflow masks it wherever it shows a connection (the
connections API and UI, ``airflow connections``); the hook also masks the key in task logs
once it has read it. The earlier name ``extra.chain_key`` is still read, with a warning.
Without the default connection, the embedded SQLite ledger under ``$AIRFLOW_HOME`` is
used, said once in the log.

Checkpoints of the verified chain heads go to ``[dp_budget] checkpoint_path`` if set,
else to the Airflow Variable ``dp_budget_checkpoint.<conn id>``: Airflow's own metadata
database, which the ledger database's users cannot write.

Tasks get a :class:`~dp_budget_provider.ledger.gate.ReleaseGate` (:meth:`DPBudgetHook.get_ledger`):
it releases within the caps and tells a task nothing about anyone else's releases
(``[dp_budget] expose_budget_state = True`` lets every task see all budget state). What
only an administrator may do needs the administrator's key, which no worker holds;
``extra.admin_public_key`` (or ``[dp_budget] admin_public_key``) pins the key the ledger
must have, so one swapped in its database is refused.

Reservations made through the hook hold a lease of ``[dp_budget] lease_seconds`` (default
300), which the release task renews while it runs; :meth:`DPBudgetHook.reap` charges the
open reservations whose lease ran out, and those older than ``[dp_budget] reap_after``.
"""

from __future__ import annotations

import os
from datetime import timedelta
from functools import cached_property
from pathlib import Path
from typing import Any

from airflow.sdk import BaseHook, Variable
from airflow.sdk.configuration import conf
from airflow.sdk.exceptions import AirflowNotFoundException
from airflow.sdk.log import mask_secret
from sqlalchemy.engine import URL

from dp_budget_provider.ledger import (
    CHAIN_KEY_ENV,
    POSTGRES_DRIVER,
    BudgetCap,
    ChainKey,
    Checkpoint,
    CheckpointFile,
    CheckpointStore,
    LedgerConfigMismatch,
    PrivacyBudgetLedger,
    ReleaseGate,
    VerifyReport,
    WindowCalendar,
    lease_of_seconds,
    verify_and_checkpoint,
)

_announced_embedded: set[str] = set()
_announced_unkeyed: set[str] = set()
_announced_unadministered: set[str] = set()
# The connection extra holding the chain key: a name Airflow deems sensitive (it contains
# "secret", see DEFAULT_SENSITIVE_FIELDS), so the connections API and CLI show it as ***.
CHAIN_KEY_FIELD = "chain_key_secret"
# The name before it, which Airflow showed in clear text: still read, with a warning.
LEGACY_CHAIN_KEY_FIELD = "chain_key"


def _setting(option: str, fallback: str) -> str:
    return conf.get("dp_budget", option, fallback=fallback) or fallback


def embedded_ledger_url() -> str:
    """The SQLite ledger used when no ``dp_budget_default`` connection exists."""
    configured = conf.get("dp_budget", "embedded_ledger_path", fallback=None)
    home = os.environ.get("AIRFLOW_HOME") or str(Path.home() / "airflow")
    path = Path(configured) if configured else Path(home) / "dp_budget_ledger.db"
    return f"sqlite:///{path}"


def default_cap() -> BudgetCap:
    """The default policy of a ledger the hook creates, from the ``dp_budget`` config section."""
    return BudgetCap(
        epsilon=float(_setting("default_cap_epsilon", "3.0")),
        delta=float(_setting("delta", "1e-05")),
        warn_fraction=float(_setting("warn_fraction", "0.8")),
    )


def lease_length() -> timedelta:
    """How long a reservation stays safe from reaping unrenewed: ``[dp_budget] lease_seconds``."""
    return lease_of_seconds(_setting("lease_seconds", "300"), "[dp_budget] lease_seconds")


def reap_after() -> timedelta:
    """The hard bound on a reservation's age, renewed or not: ``[dp_budget] reap_after``."""
    text = _setting("reap_after", "86400")
    try:
        bound = timedelta(seconds=int(text))
    except (ValueError, OverflowError):
        bound = timedelta(-1)
    if bound < timedelta(0):
        raise ValueError(f"[dp_budget] reap_after must be a whole number of seconds, got {text!r}")
    return bound


class VariableCheckpoints:
    """The latest checkpoint in an Airflow Variable (Airflow's metadata database)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def last(self, key: ChainKey) -> Checkpoint | None:
        """The checkpoint the Variable holds, None before the first."""
        text = Variable.get(self.name, default=None)
        return None if not text else Checkpoint.from_json(str(text), key)

    def append(self, checkpoint: Checkpoint, key: ChainKey) -> None:
        """Replace the Variable's checkpoint by ``checkpoint``."""
        Variable.set(
            self.name,
            checkpoint.to_json(key),
            description="dp-budget: the ledger's chain heads at its last passing verify",
        )


class DPBudgetHook(BaseHook):
    """Opens the privacy budget ledger named by a ``dpbudget`` connection.

    The type has no ``_``: Airflow writes a connection it reads from the metadata database
    as a URI whose scheme is the type, and warns on every lookup (on stdout, before the
    output of ``dp-budget --conn-id``) that a scheme with ``_`` breaks RFC 3986. The hook
    reads its connection by id, whatever its type, so connections of the earlier type
    ``dp_budget`` keep working (:class:`LegacyDPBudgetHook` keeps their form and test).
    """

    conn_name_attr = "dp_budget_conn_id"
    default_conn_name = "dp_budget_default"
    conn_type = "dpbudget"
    hook_name = "DP Budget Ledger"

    def __init__(self, dp_budget_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dp_budget_conn_id = dp_budget_conn_id

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        """Connection form: the ledger URL lives in a field of its own."""
        return {
            "hidden_fields": ["extra"],
            "relabeling": {"schema": "Database"},
            "placeholders": {"host": "ledger PostgreSQL host", "port": "5432"},
        }

    @cached_property
    def _connection(self) -> Any:
        """The hook's Airflow connection, looked up once; None for the embedded default."""
        try:
            return self.get_connection(self.dp_budget_conn_id)
        except AirflowNotFoundException:
            if self.dp_budget_conn_id != self.default_conn_name:
                raise  # a named connection that does not exist is a mistake, not a default
            return None

    def ledger_url(self) -> str:
        """The SQLAlchemy URL of the ledger this hook points at."""
        connection = self._connection
        if connection is None:
            url = embedded_ledger_url()
            if url not in _announced_embedded:
                _announced_embedded.add(url)
                self.log.info(
                    "No %r connection: using the embedded SQLite budget ledger at %s",
                    self.default_conn_name,
                    url,
                )
            return url
        extra = connection.extra_dejson
        url = self._extra_field(extra, "url")
        if url:
            return str(url)
        if not connection.host:
            raise ValueError(
                f"connection {self.dp_budget_conn_id!r} has neither extra.url nor a host"
            )
        return URL.create(
            POSTGRES_DRIVER,
            username=connection.login or None,
            password=connection.password or None,
            host=connection.host,
            port=connection.port or None,
            database=connection.schema or None,
        ).render_as_string(hide_password=False)

    def _extra_field(self, extra: dict[str, Any], name: str) -> Any:
        """``extra[name]``, or its ``extra__<conn type>__<name>`` form older forms wrote."""
        return extra.get(name) or extra.get(f"extra__{self._connection.conn_type}__{name}")

    def chain_key(self) -> str | None:
        """The history's chain key: the connection's ``extra.chain_key_secret`` (or the older
        ``extra.chain_key``), else the workers' ``$DP_BUDGET_CHAIN_KEY``; None when none is
        set (an unkeyed history). Masked in the logs from then on: whoever reads it in a
        task log could forge the history's links."""
        key = None
        if self._connection is not None:
            extra = self._connection.extra_dejson
            key = self._extra_field(extra, CHAIN_KEY_FIELD)
            legacy = self._extra_field(extra, LEGACY_CHAIN_KEY_FIELD)
            if legacy and not key:
                self.log.warning(
                    "Connection %r keeps the chain key in extra.%s, which Airflow shows in "
                    "clear text (connections API and UI, `airflow connections`): rename the "
                    "field to %s, a name Airflow masks.",
                    self.dp_budget_conn_id,
                    LEGACY_CHAIN_KEY_FIELD,
                    CHAIN_KEY_FIELD,
                )
            key = key or legacy
        key = str(key) if key else os.environ.get(CHAIN_KEY_ENV) or None
        if key is not None:
            mask_secret(key)
        return key

    def admin_public_key(self) -> str | None:
        """The administrator key the ledger must have: the connection's
        ``extra.admin_public_key``, else ``[dp_budget] admin_public_key``; None: not pinned."""
        connection = self._connection
        extra = connection.extra_dejson if connection is not None else {}
        pin = extra.get("admin_public_key") or conf.get(
            "dp_budget", "admin_public_key", fallback=None
        )
        return str(pin) if pin else None

    def checkpoint_store(self) -> CheckpointStore:
        """Where this ledger's checkpoints are kept, outside the ledger database."""
        path = conf.get("dp_budget", "checkpoint_path", fallback=None)
        if path:
            return CheckpointFile(path)
        return VariableCheckpoints(f"dp_budget_checkpoint.{self.dp_budget_conn_id}")

    def reap(self) -> int:
        """Charge the reservations abandoned by dead workers (their lease ran out, or they
        are older than ``[dp_budget] reap_after``); how many (a task's XCom: not whose)."""
        return self.get_ledger().reap(reap_after())

    def verify(self) -> VerifyReport:
        """Verify the ledger against its last checkpoint and checkpoint it if it passes; a
        failed verify quarantines the ledger."""
        return verify_and_checkpoint(self.ledger, self.checkpoint_store())

    @cached_property
    def ledger(self) -> PrivacyBudgetLedger:
        """The ledger, opened once per hook (created from config defaults if new), for the
        hook's own maintenance (reap, verify); tasks use :meth:`get_ledger`."""
        calendar = WindowCalendar(_setting("window_calendar", "iso_week"))  # type: ignore[arg-type]
        key, url = self.chain_key(), self.ledger_url()
        if key is None and url not in _announced_unkeyed:
            _announced_unkeyed.add(url)
            self.log.warning(
                "The budget ledger's history is not keyed: whoever can write its database can "
                "rewrite it unnoticed after the last checkpoint. Set the connection's extra "
                "%s (or $%s).",
                CHAIN_KEY_FIELD,
                CHAIN_KEY_ENV,
            )
        cap = default_cap()
        pin = self.admin_public_key()
        if pin is None and not conf.getboolean("dp_budget", "allow_unpinned", fallback=False):
            # Fail closed: unpinned, a task could record its own administrator key on a ledger
            # that has none, or be handed one an insider swapped in, and raise the caps.
            raise LedgerConfigMismatch(
                f"connection {self.dp_budget_conn_id!r} pins no administrator key (extra "
                "admin_public_key, or [dp_budget] admin_public_key): any task could make "
                "itself the ledger's administrator and raise its caps. Create the ledger and "
                "record the key with `dp-budget init --admin-key FILE` (or `dp-budget admin "
                "init`), then pin the public key it prints; [dp_budget] allow_unpinned = True "
                "accepts an unpinned ledger on a one-user development machine"
            )
        try:
            ledger = PrivacyBudgetLedger(
                url=url,
                if_new=cap,
                calendar=calendar,
                actor="airflow",
                chain_key=key,
                lease=lease_length(),
                admin_public_key=pin,
            )
        except LedgerConfigMismatch as error:
            raise LedgerConfigMismatch(
                f"connection {self.dp_budget_conn_id!r}: {error} (Airflow opens it with "
                f"[dp_budget] delta = {cap.delta!r}, the connection's {CHAIN_KEY_FIELD} and "
                "admin_public_key)"
            ) from error
        if pin is None and url not in _announced_unadministered:  # allow_unpinned
            _announced_unadministered.add(url)
            self.log.warning(
                "The budget ledger's administrator key is not pinned (connection extra "
                "admin_public_key): %s",
                "the ledger has none, so any task could record one and make itself its "
                "administrator (run `dp-budget admin init`)"
                if ledger.admin_public_key is None
                else "an insider who swaps the key in the ledger database would be trusted",
            )
        return ledger

    def get_ledger(self) -> ReleaseGate:
        """The ledger as a task may use it: releases within the caps, and nothing about
        other releases (unless ``[dp_budget] expose_budget_state``)."""
        exposed = conf.getboolean("dp_budget", "expose_budget_state", fallback=False)
        return ReleaseGate(self.ledger, exposed=exposed, dag=_running_dag())

    def test_connection(self) -> tuple[bool, str]:
        """Used by the UI's "Test" button: open the ledger and verify its history chain."""
        try:
            report = self.ledger.verify()
        except Exception as error:  # noqa: BLE001 - the UI wants the message, whatever it is
            return False, str(error)
        if report.ok:
            return True, f"ledger OK: {report.accounts} accounts, {report.entries} history entries"
        return False, "; ".join(report.problems[:5])


def _running_dag() -> str | None:
    """The DAG id of the task this process runs, from Airflow's task context (not from any
    argument its author wrote); None outside a task. Where a cap is divided among
    principals, a gate answers about this DAG's share only."""
    from airflow.sdk import get_current_context

    try:
        return get_current_context()["ti"].dag_id
    except RuntimeError:  # no task is running
        return None


class LegacyDPBudgetHook(DPBudgetHook):
    """The connection type ``dp_budget`` of earlier versions, still registered so that such
    connections keep their form and "Test" button in the UI. Airflow warns about the ``_``
    on every lookup of one: change its type to ``dpbudget`` (nothing else changes)."""

    conn_type = "dp_budget"
    hook_name = "DP Budget Ledger (old type dp_budget: change it to dpbudget)"
