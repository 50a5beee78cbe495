"""The "DP budget account" button on every DPReleaseOperator task instance.

In Airflow 3 the task runner calls :meth:`get_link` when the task finishes and stores
the URL as an XCom (``_link_DPBudgetAccountLink``); the UI reads that XCom. So the link
is built on the task side, from the receipt the operator pushed: it opens the account
page of the release's most-spent key, or for a refused release the key that refused it.
A task that never got that far (bad arguments, ledger unreachable) links to its
tenant's and query type's accounts.

The link opens the page inside the Airflow UI, not bare: Airflow 3.3's UI routes
``/plugin/<url_route>/*`` to the external view with that ``url_route`` and, when the
splat is not empty, loads ``/<splat>?<query>`` (same origin) in the view's iframe
instead of its ``href`` (and keeps the outer URL in step as the iframe navigates).
So ``/plugin/dp-budget/dp-budget/account?tenant=...`` is the account page, framed by
Airflow's navigation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode, urlsplit

from airflow.sdk import BaseOperatorLink
from airflow.sdk.configuration import conf

from dp_budget_provider.ledger.keys import canonical_part

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator
    from airflow.sdk.types import TaskInstanceKey

URL_PREFIX = "/dp-budget"  # where the plugin's FastAPI app is mounted
URL_ROUTE = "dp-budget"  # the external view's route in the Airflow UI: /plugin/dp-budget
RECEIPT_XCOM_KEY = "dp_budget_receipt"  # what DPReleaseOperator pushes
KEY_FIELDS = ("tenant", "subject", "query_type", "window")


def ui_url(path: str, query: dict[str, str]) -> str:
    """The Airflow UI's plugin page showing ``/dp-budget`` + path + query in its iframe.

    ``[api] base_url`` + ``/plugin/dp-budget`` + the page's own path, which carries the
    base URL's path too (the iframe loads it from the origin); root-relative without a
    base URL.
    """
    base = (conf.get("api", "base_url", fallback="") or "").rstrip("/")
    root = urlsplit(base).path
    suffix = f"?{urlencode(query)}" if query else ""
    return f"{base}/plugin/{URL_ROUTE}{root}{URL_PREFIX}{path}{suffix}"


def account_url(key: dict[str, Any]) -> str:
    """The account page of a key given as its four parts."""
    return ui_url("/account", {name: str(key[name]) for name in KEY_FIELDS})


def _read_receipt(ti_key: TaskInstanceKey) -> Any:
    from airflow.sdk.execution_time.xcom import XCom

    return XCom.get_value(ti_key=ti_key, key=RECEIPT_XCOM_KEY)


class DPBudgetAccountLink(BaseOperatorLink):
    """Links a release task instance to the budget account it charged."""

    name = "DP budget account"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        receipt = _read_receipt(ti_key)
        key = receipt.get("key") if isinstance(receipt, dict) else None
        if isinstance(key, dict) and all(isinstance(key.get(n), str) for n in KEY_FIELDS):
            return account_url(key)
        query = {}
        for name in ("tenant", "query_type"):
            value = getattr(operator, name, None)
            try:
                query[name] = canonical_part(name, value)
            except ValueError:
                continue
        return ui_url("/accounts", query)
