"""Fuzzing the budget UI's HTTP surface from its own OpenAPI schema (schemathesis is not a
dependency; this is the same idea in a few lines of hypothesis).

For every GET operation the schema lists, hypothesis fills its query parameters, each valid
but one (now and then two) drawn from edges of the parameter's schema (integers just out of
range, 10^20, '1e30', 'nan') or a shared list of nasty texts (60,000 characters, control and
invisible characters, undecodable percent-escapes), and sends them through the test client.
Issue 15: never a 5xx, and no 4xx body carries a filesystem path or a traceback. The app
runs on a seeded SQLite ledger with authentication overridden (what is fuzzed is the
parameters, not the auth manager; tests/plugins/test_api.py covers that).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dp_budget_provider.ledger import BudgetCap, PrivacyBudgetLedger
from tests.admin import ADMIN
from tests.plugins.conftest import CHAIN_KEY, WINDOW, XSS, seed
from tests.plugins.test_api import ROUTES

# The ledger is seeded (and read) in this process: the ledger's clock is pinned inside WINDOW.
LEDGER_WINDOWS = (WINDOW,)

NASTY_TEXT = [
    "",
    " ",
    "*",
    "**",
    "%",
    "_",
    "\\",
    "'",
    '"',
    "<script>",
    "\x00",
    "a\x00b",
    "\n",
    "\x1b[2J",
    "\u200b",
    "a\u034fb",
    "\ufe0f",
    "\u202e",
    "аlice",
    "x" * 257,
    "*" * 2000,
    "y" * 60_000,
    "1e30",
    "nan",
    "-1",
    str(10**20),
    "9999-w99",
    "../../etc/passwd",
]
# Already percent-encoded: bytes that are not UTF-8, a lone escape, an encoded NUL.
RAW = ["%ff%fe", "%c0%af", "%ed%a0%80", "%", "%zz", "%00", "a%0d%0ab"]
KEY = {"tenant": "acme", "subject": "user-000", "query_type": "heatmap", "window": WINDOW}
GOOD_TEXT = {**KEY, "state": "warning", "sort": "epsilon"}

_PATHY = re.compile(r"(/tmp/|/home/|/root/|/usr/|site-packages|\.db\b|\.py\b)")
_TRACE = re.compile(r"Traceback|File \"|line \d+, in ")

# Every GET route with parameters a user sends (the index and the schema take none).
FUZZED = tuple(route for route in ROUTES if route not in ("/", "/openapi.json"))


def _schema_of(parameter: dict[str, Any]) -> dict[str, Any]:
    schema = parameter.get("schema", {})
    for option in schema.get("anyOf", []):  # Optional[...]: the non-null branch
        if option.get("type") != "null":
            return option
    return schema


def _good(name: str, schema: dict[str, Any]) -> st.SearchStrategy[str]:
    if "enum" in schema:
        return st.sampled_from([str(v) for v in schema["enum"]])
    if schema.get("type") == "integer":
        low = schema.get("minimum", 0)
        high = min(schema.get("maximum", low + 100), low + 100)
        return st.integers(low, high).map(str)
    if schema.get("type") == "array":
        return st.sampled_from(["open", "committed"])
    if name in GOOD_TEXT:
        return st.sampled_from([GOOD_TEXT[name], XSS if name == "subject" else "*"])
    return st.sampled_from(["acme", "*"])


def _edges(schema: dict[str, Any]) -> list[str]:
    if schema.get("type") == "integer":
        low, high = schema.get("minimum", 0), schema.get("maximum", 2**63 - 1)
        return [str(v) for v in (low - 1, high + 1, 10**20, -(10**20), 2**63, 2**64)] + [
            "1e30",
            "nan",
            "1.5",
            "0x10",
            "\u0661",
            "",
        ]
    if "enum" in schema:
        return ["", "ASC", "newest ", str(schema["enum"][0]) * 100]
    return []


@st.composite
def queries(draw: st.DrawFn, parameters: list[dict[str, Any]]) -> str:
    """A raw query string for one operation: its parameters valid but one or two."""
    if not parameters:
        return draw(st.sampled_from(["", "x=%ff", "limit=" + "9" * 100]))
    bad = {draw(st.integers(0, len(parameters) - 1))}
    if draw(st.integers(0, 3)) == 0:
        bad.add(draw(st.integers(0, len(parameters) - 1)))
    parts = []
    for index, parameter in enumerate(parameters):
        name, schema = parameter["name"], _schema_of(parameter)
        if index in bad:
            kind = draw(st.integers(0, 4))
            if kind == 0:
                continue  # a required one left out
            if kind == 1:
                parts.append(f"{name}={draw(st.sampled_from(RAW))}")
                continue
            edges = _edges(schema)
            pool = st.sampled_from(NASTY_TEXT) if not edges else st.sampled_from(edges)
            value = draw(st.one_of(pool, st.sampled_from(NASTY_TEXT), st.text(max_size=8)))
        elif not parameter.get("required") and draw(st.booleans()):
            continue
        else:
            value = draw(_good(name, schema))
        parts.append(f"{name}={quote(value, safe='')}")
        if schema.get("type") == "array" and draw(st.booleans()):
            parts.append(f"{name}={quote(value, safe='')}")  # repeated
    return "&".join(parts)


@pytest.fixture(scope="module")
def app_client(tmp_path_factory):
    from fastapi.testclient import TestClient

    from dp_budget_provider.plugins.app import create_app
    from dp_budget_provider.plugins.auth import budget_reader

    path = tmp_path_factory.mktemp("ui-fuzz") / "ledger.db"
    ledger = PrivacyBudgetLedger(
        BudgetCap(3.0, 1e-5), url=f"sqlite:///{path}", chain_key=CHAIN_KEY, admin=ADMIN
    )
    seed(ledger)
    app = create_app(lambda: ledger)
    app.dependency_overrides[budget_reader] = lambda: None  # authenticated, as anyone
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            yield client, path
    finally:
        ledger.close()


def _get_operations(client) -> list[tuple[str, list[dict[str, Any]]]]:
    schema = client.app.openapi()
    return [
        (path, [p for p in item["get"].get("parameters", []) if p.get("in") == "query"])
        for path, item in sorted(schema["paths"].items())
        if "get" in item
    ]


def check_response(url: str, response: Any, ledger_path: Path) -> None:
    body = response.text
    shown = f"GET {url[:300]} -> {response.status_code}: {body[:600]!r}"
    assert response.status_code < 500, shown
    if response.status_code >= 400:
        assert not _TRACE.search(body), shown
        assert str(ledger_path.parent) not in body and not _PATHY.search(body), shown


def test_the_schema_lists_every_get_operation(app_client):
    client, _ = app_client
    paths = {path for path, _ in _get_operations(client)}
    assert {"/api/accounts", "/api/account", "/api/account/history", "/accounts"} <= paths
    assert {"/api/account/reservations", "/api/report", "/account", "/policies"} <= paths


@pytest.mark.parametrize("path", FUZZED)
def test_get_operations_never_fail_with_5xx_nor_leak(path, app_client):
    client, ledger_path = app_client
    operations = dict(_get_operations(client))
    assert path in operations, sorted(operations)
    parameters = operations[path]

    @settings(
        max_examples=10 + 6 * len(parameters),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(query=queries(parameters))
    def run(query):
        url = f"{path}?{query}" if query else path
        check_response(url, client.get(url), ledger_path)

    run()


def test_every_get_operation_is_fuzzed(app_client):
    client, _ = app_client
    assert {path for path, _ in _get_operations(client)} == set(FUZZED)
