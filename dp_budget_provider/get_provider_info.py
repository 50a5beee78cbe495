"""Provider metadata Airflow reads through the ``apache_airflow_provider`` entry point."""

from __future__ import annotations

from typing import Any

from dp_budget_provider import __version__

INTEGRATION = "DP Budget"


def _option(
    description: str, kind: str, default: str | None, example: str | None
) -> dict[str, Any]:
    return {
        "description": description,
        "version_added": "0.1.0",
        "type": kind,
        "example": example,
        "default": default,
    }


def _connection_type(connection_type: str, hook_class: str, hook_name: str) -> dict[str, Any]:
    """A connection type of the ledger: ``dpbudget``, and ``dp_budget`` of earlier versions
    (same fields and form, so existing connections keep working; see ``DPBudgetHook``)."""
    return {
        "connection-type": connection_type,
        "hook-class-name": f"dp_budget_provider.hooks.dp_budget.{hook_class}",
        "hook-name": hook_name,
        "conn-fields": {
            "url": {
                "label": "Ledger URL",
                "description": "SQLAlchemy URL of the ledger database "
                "(sqlite:///path or postgresql+psycopg2://...). Overrides host/schema.",
                "schema": {"type": ["string", "null"]},
            },
            "chain_key_secret": {
                "label": "Chain key",
                "description": "Secret key (16+ bytes; 32 random ones recommended) the "
                "ledger's history is linked with (HMAC-SHA256). Keep it out of the "
                "ledger database: here (encrypted by Airflow) or in a secrets backend.",
                "schema": {"type": ["string", "null"]},
            },
        },
        "ui-field-behaviour": {
            "hidden-fields": ["extra"],
            "relabeling": {"schema": "Database"},
            "placeholders": {
                "host": "ledger PostgreSQL host",
                "schema": "ledger database name",
                "port": "5432",
            },
        },
    }


def get_provider_info() -> dict[str, Any]:
    """The dict described by ``airflow/provider_info.schema.json``.

    The UI plugin is registered through the ``airflow.plugins`` entry point, not under
    ``plugins`` here: Airflow 3.3 loads provider-listed plugins only with
    ``[core] lazy_discover_providers = False`` (not the default), and with both it would
    register the plugin twice and report the second as an import error.
    """
    return {
        "package-name": "dp-budget-provider",
        "name": "DP Budget",
        "description": "Differential-privacy budgets as a gate in Airflow pipelines: a "
        "persistent Rényi-DP ledger, a release operator, a budget-window sensor.",
        "versions": [__version__],
        "integrations": [{"integration-name": INTEGRATION, "tags": ["privacy"]}],
        "hooks": [
            {
                "integration-name": INTEGRATION,
                "python-modules": ["dp_budget_provider.hooks.dp_budget"],
            }
        ],
        "operators": [
            {
                "integration-name": INTEGRATION,
                "python-modules": [
                    "dp_budget_provider.operators.release",
                    "dp_budget_provider.operators.aggregate",
                ],
            }
        ],
        "sensors": [
            {
                "integration-name": INTEGRATION,
                "python-modules": ["dp_budget_provider.sensors.budget"],
            }
        ],
        "triggers": [
            {
                "integration-name": INTEGRATION,
                "python-modules": ["dp_budget_provider.triggers.budget_window"],
            }
        ],
        "connection-types": [
            _connection_type("dpbudget", "DPBudgetHook", "DP Budget Ledger"),
            _connection_type(
                "dp_budget",
                "LegacyDPBudgetHook",
                "DP Budget Ledger (old type dp_budget: change it to dpbudget)",
            ),
        ],
        "extra-links": ["dp_budget_provider.plugins.links.DPBudgetAccountLink"],
        "asset-uris": [
            {
                "schemes": ["dp-release"],
                "handler": "dp_budget_provider.assets.dp_release.sanitize_uri",
                "to_openlineage_converter": (
                    "dp_budget_provider.assets.dp_release.convert_asset_to_openlineage"
                ),
            }
        ],
        "task-decorators": [
            {
                "name": "dp_release",
                "class-name": "dp_budget_provider.decorators.release.dp_release_task",
            },
            {
                "name": "dp_aggregate",
                "class-name": "dp_budget_provider.decorators.aggregate.dp_aggregate_task",
            },
        ],
        "config": {
            "dp_budget": {
                "description": "Defaults of the differential-privacy budget ledger. They apply "
                "when the hook creates a new ledger; an existing ledger keeps what it stores.",
                "options": {
                    "default_cap_epsilon": _option(
                        "Cap on cumulative epsilon per account for a new ledger.",
                        "float",
                        "3.0",
                        "1.0",
                    ),
                    "delta": _option(
                        "The ledger-wide delta, fixed when the ledger is created.",
                        "float",
                        "1e-05",
                        "1e-06",
                    ),
                    "warn_fraction": _option(
                        "Fraction of the cap at which releases warn.", "float", "0.8", "0.9"
                    ),
                    "window_calendar": _option(
                        "Budget windows of a new ledger's default policy: iso_week, month or day.",
                        "string",
                        "iso_week",
                        "month",
                    ),
                    "embedded_ledger_path": _option(
                        "SQLite ledger file used when no dp_budget_default connection exists "
                        "(default: $AIRFLOW_HOME/dp_budget_ledger.db).",
                        "string",
                        None,
                        "/var/lib/airflow/dp_budget_ledger.db",
                    ),
                    "reset_schedule": _option(
                        "Schedule of the dp_budget_window_reset maintenance DAG (cron), which "
                        "seals windows past their grace period and verifies the ledger. The "
                        "CLI's status, the UI and the release tasks warn when its reset or "
                        "verify has not run within twice its longest gap between runs.",
                        "string",
                        "@daily",
                        "0 3 * * *",
                    ),
                    "lease_seconds": _option(
                        "Lease of a release's reservation, in seconds (1 to 86400): the task "
                        "renews it every third of that while its query runs; once it has run "
                        "out (the worker died), the next reap charges the reservation.",
                        "float",
                        "300",
                        "120",
                    ),
                    "reap_schedule": _option(
                        "Schedule of the dp_budget_reap maintenance DAG, which charges "
                        "reservations whose lease ran out. A crashed attempt is charged at "
                        "most lease_seconds plus one interval of it after its last renewal. "
                        "status, the UI and the release tasks warn when no reap has run "
                        "within twice its interval.",
                        "string",
                        "*/5 * * * *",
                        "*/2 * * * *",
                    ),
                    "reap_after": _option(
                        "Seconds after which a reservation is charged by the reap even while "
                        "its lease is renewed (a hard bound on how long budget is held).",
                        "integer",
                        "86400",
                        "43200",
                    ),
                    "checkpoint_path": _option(
                        "File the maintenance DAG appends the ledger's verified chain heads to "
                        "(default: the Airflow Variable dp_budget_checkpoint.<conn id>, in "
                        "Airflow's metadata database). Keep it out of the ledger database "
                        "users' reach.",
                        "string",
                        None,
                        "/var/lib/airflow/dp_budget_checkpoints.jsonl",
                    ),
                    "admin_public_key": _option(
                        "The administrator key the ledger must have (dpb-admin-1:..., printed "
                        "by `dp-budget admin init`); the connection's extra admin_public_key "
                        "takes precedence. Without one no task opens the ledger.",
                        "string",
                        None,
                        "dpb-admin-1:...",
                    ),
                    "admin_key_file": _option(
                        "The administrator's key file (`dp-budget admin keygen`), on the "
                        "api-server only: the UI's administrators set policies, clear a "
                        "quarantine and open refusal references with it, audited with their "
                        "Airflow user name. Readable by its owner only; never on a worker "
                        "(tasks could then do whatever an administrator may). Unset: the UI "
                        "offers no administrator's acts.",
                        "string",
                        None,
                        "/etc/airflow/dp-budget-admin.key",
                    ),
                    "allow_unpinned": _option(
                        "Let tasks open a ledger whose administrator key no connection pins "
                        "(and create one without an administrator): any task could then make "
                        "itself administrator. Only for a one-user development machine.",
                        "boolean",
                        "False",
                        "True",
                    ),
                    "expose_budget_state": _option(
                        "Tasks see the budget state of the accounts their releases touch "
                        "(refusals name the account and its eps, receipts carry each "
                        "account's eps after the release, warnings reach notifiers): this "
                        "tells one DAG who is in another DAG's data. Only where every DAG "
                        "author may see all budget state.",
                        "boolean",
                        "False",
                        "True",
                    ),
                },
            }
        },
    }
