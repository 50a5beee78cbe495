"""The Airflow plugin: the budget UI's FastAPI app at ``/dp-budget`` and its navigation entry.

Listed under ``plugins`` in the provider info. The external view puts "DP Budget" in the
UI's Browse menu; with ``url_route`` the page is shown inside the Airflow UI (an iframe
of ``href``, same origin, so the UI's session cookie authenticates it).
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from dp_budget_provider.plugins.app import create_app
from dp_budget_provider.plugins.links import URL_PREFIX, URL_ROUTE

PLUGIN_NAME = "dp_budget"
APP_NAME = "DP Budget"

app = create_app()


class DPBudgetPlugin(AirflowPlugin):
    """Budget state in the Airflow UI: accounts, account pages, JSON API."""

    name = PLUGIN_NAME
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": APP_NAME}]
    external_views = [
        {
            "name": APP_NAME,
            "href": f"{URL_PREFIX}/accounts",
            "destination": "nav",
            "category": "browse",
            "url_route": URL_ROUTE,
        }
    ]
