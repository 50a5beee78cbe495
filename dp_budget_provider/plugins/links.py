"""The "DP budget release" button on every DPReleaseOperator task instance.

In Airflow 3 the task runner calls :meth:`get_link` when the task finishes and stores
the URL as an XCom (``_link_DPBudgetAccountLink``); the UI reads that XCom. So the link
is built on the task side, from the receipt the operator pushed: it opens the release's
page (its reservation: mechanism, cost, windows, and every account it held, each a
subject's or a spend class's), whether it was granted or refused after reserving. A task
that never reserved (bad arguments, ledger unreachable, refused) links to its tenant's
and query type's accounts: the link names nothing the task may not know.

The link opens the page inside the Airflow UI, not bare: Airflow 3.3's UI routes
``/plugin/<url_route>/*`` to the external view with that ``url_route`` and, when the
splat is not empty, loads ``/<splat>?<query>`` (same origin) in the view's iframe
instead of its ``href`` (and keeps the outer URL in step as the iframe navigates).
So ``/plugin/dp-budget/dp-budget/release?reservation=...`` is the release page, framed by
Airflow's navigation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode, urlsplit

from airflow.sdk import BaseOperatorLink
from airflow.sdk.configuration import conf

from dp_budget_provider.ledger.accounts.keys import canonical_part

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator
    from airflow.sdk.types import TaskInstanceKey

URL_PREFIX = "/dp-budget"  # where the plugin's FastAPI app is mounted
URL_ROUTE = "dp-budget"  # the external view's route in the Airflow UI: /plugin/dp-budget
RECEIPT_XCOM_KEY = "dp_budget_receipt"  # what DPReleaseOperator pushes


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


def release_url(reservation_id: str) -> str:
    """The release page of a reservation id."""
    return ui_url("/release", {"reservation": reservation_id})


def _read_receipt(ti_key: TaskInstanceKey) -> Any:
    from airflow.sdk.execution_time.xcom import XCom

    return XCom.get_value(ti_key=ti_key, key=RECEIPT_XCOM_KEY)


class DPBudgetAccountLink(BaseOperatorLink):
    """Links a release task instance to the budget account it charged."""

    name = "DP budget release"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        receipt = _read_receipt(ti_key)
        reservation = receipt.get("reservation_id") if isinstance(receipt, dict) else None
        if isinstance(reservation, str) and reservation:
            return release_url(reservation)
        query = {}
        for name in ("tenant", "query_type"):
            value = getattr(operator, name, None)
            try:
                query[name] = canonical_part(name, value)
            except ValueError:
                continue
        return ui_url("/accounts", query)
