"""DPBudgetHook: how Airflow tasks reach the budget ledger.

Tasks have no metadata-database access in Airflow 3, so the ledger is its own
database behind an Airflow connection (type ``dp_budget``). Its ``extra`` may carry
``{"url": "<SQLAlchemy URL>"}``; otherwise host/port/schema/login/password describe a
PostgreSQL ledger. Without the default connection, the embedded SQLite ledger under
``$AIRFLOW_HOME`` is used, said once in the log.
"""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import Any

from airflow.sdk import BaseHook
from airflow.sdk.configuration import conf
from airflow.sdk.exceptions import AirflowNotFoundException
from sqlalchemy.engine import URL

from dp_budget_provider.ledger import BudgetCap, PrivacyBudgetLedger, WindowCalendar

_announced_embedded: set[str] = set()


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


class DPBudgetHook(BaseHook):
    """Opens the privacy budget ledger named by a ``dp_budget`` connection."""

    conn_name_attr = "dp_budget_conn_id"
    default_conn_name = "dp_budget_default"
    conn_type = "dp_budget"
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

    def ledger_url(self) -> str:
        """The SQLAlchemy URL of the ledger this hook points at."""
        try:
            connection = self.get_connection(self.dp_budget_conn_id)
        except AirflowNotFoundException:
            if self.dp_budget_conn_id != self.default_conn_name:
                raise  # a named connection that does not exist is a mistake, not a default
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
        url = extra.get("url") or extra.get(f"extra__{self.conn_type}__url")
        if url:
            return str(url)
        if not connection.host:
            raise ValueError(
                f"connection {self.dp_budget_conn_id!r} has neither extra.url nor a host"
            )
        return URL.create(
            "postgresql+psycopg2",
            username=connection.login or None,
            password=connection.password or None,
            host=connection.host,
            port=connection.port or None,
            database=connection.schema or None,
        ).render_as_string(hide_password=False)

    @cached_property
    def ledger(self) -> PrivacyBudgetLedger:
        """The ledger, opened once per hook (created from config defaults if new)."""
        calendar = WindowCalendar(_setting("window_calendar", "iso_week"))  # type: ignore[arg-type]
        return PrivacyBudgetLedger(
            url=self.ledger_url(), if_new=default_cap(), calendar=calendar, actor="airflow"
        )

    def get_ledger(self) -> PrivacyBudgetLedger:
        """The ledger this hook points at."""
        return self.ledger

    def test_connection(self) -> tuple[bool, str]:
        """Used by the UI's "Test" button: open the ledger and verify its history chain."""
        try:
            report = self.get_ledger().verify()
        except Exception as error:  # noqa: BLE001 - the UI wants the message, whatever it is
            return False, str(error)
        if report.ok:
            return True, f"ledger OK: {report.accounts} accounts, {report.entries} history entries"
        return False, "; ".join(report.problems[:5])
