"""The real `airflow api-server` with a keyed ledger, as docs/deploying.md deploys it, without a
browser: what the connections API shows of the chain key, the plugin's pages, and the
administrator's acts (the api-server holds the administrator's key, the users are the
simple auth manager's ``admin`` and ``viewer``)."""

from __future__ import annotations

import json

import httpx
import pytest

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import PrivacyBudgetLedger, key_for
from dp_budget_provider.ledger.gate import ReleaseGate, ReleaseRefused
from tests.admin import ADMIN
from tests.plugins.airflow_server import CHAIN_KEY, airflow_api_server

# Over 20 s in all: scheduled before the light files (tests/conftest.py).
pytestmark = pytest.mark.heavy

ACTOR = "admin (Airflow UI)"  # what the history names: the acting Airflow user


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with airflow_api_server(tmp_path_factory.mktemp("airflow-api")) as running:
        yield running


def test_the_connections_api_and_cli_never_show_the_chain_key(server):
    """Anyone who reads connections could forge the history with the key: the API (GET
    /api/v2/connections/dp_budget_default) and `airflow connections add` show it masked,
    while the UI, keyed with it, serves its pages (it was a 503 on a keyed ledger)."""
    headers = {"Authorization": f"Bearer {server.token()}"}
    shown = httpx.get(f"{server.url}/api/v2/connections/dp_budget_default", headers=headers)
    assert shown.status_code == 200
    assert json.loads(shown.json()["extra"])["chain_key_secret"] == "***"
    assert CHAIN_KEY not in shown.text and CHAIN_KEY not in server.added
    page = httpx.get(f"{server.url}/dp-budget/accounts", headers=headers)
    assert page.status_code == 200 and "user-007" in page.text
    assert "history keyed" in page.text  # the ledger the tasks keyed, opened with its key
    audit = httpx.get(f"{server.url}/dp-budget/api/verification", headers=headers).json()
    assert audit["ok"], audit


@pytest.fixture(scope="module")
def ledger(server):
    """The server's ledger as a worker opens it (no administrator's key)."""
    opened = PrivacyBudgetLedger(
        url=server.ledger_url, chain_key=CHAIN_KEY, admin_public_key=ADMIN.public
    )
    try:
        yield opened
    finally:
        opened.close()


def _state(ledger: PrivacyBudgetLedger) -> tuple:
    return (
        ledger.verify().entries,
        [p.as_record() for p in ledger.policies()],
        ledger.quarantine_status(),
    )


def _act(server, user: str, method: str, path: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {server.token(user)}"}
    return httpx.request(method, f"{server.url}/dp-budget{path}", json=body, headers=headers)


POLICY = {"tenant": "acme", "query_type": "count", "cap_epsilon": 1.25, "grace_seconds": 3600}


def test_a_viewer_cannot_act_and_the_ledger_is_unchanged(server, ledger):
    ledger.quarantine("viewer test")
    before = _state(ledger)
    for method, path, body in (
        ("PUT", "/api/admin/policy", POLICY),
        ("POST", "/api/admin/quarantine/clear", {"reason": "I may not"}),
        ("POST", "/api/admin/refusal", {"reference": "dpb-ref-1.AAAA"}),
    ):
        response = _act(server, "viewer", method, path, body)
        assert response.status_code == 403, (path, response.text)
    page = httpx.get(
        f"{server.url}/dp-budget/policies",
        headers={"Authorization": f"Bearer {server.token('viewer')}"},
    )
    assert page.status_code == 200 and "set-policy" not in page.text
    assert _state(ledger) == before


def test_an_admin_sets_a_policy_and_clears_the_quarantine(server, ledger):
    """Signed with the api-server's key, audited with the Airflow user's name; a worker's
    ledger honours both (it refuses a policy or a clearing its administrator did not sign)."""
    ledger.quarantine("a drill")  # (in force already after the viewer's test)
    assert ledger.quarantine_status() is not None
    cleared = _act(server, "admin", "POST", "/api/admin/quarantine/clear",
                   {"reason": "investigated: a drill"})  # fmt: skip
    assert cleared.status_code == 200, cleared.text
    assert cleared.json()["actor"] == ACTOR
    assert ledger.quarantine_status() is None
    response = _act(server, "admin", "PUT", "/api/admin/policy", POLICY)
    assert response.status_code == 200, response.text
    assert response.json()["created"] and response.json()["actor"] == ACTOR
    policy = {p.scope: p for p in ledger.policies()}[("acme", "count")]
    assert (policy.cap_epsilon, policy.grace.total_seconds()) == (1.25, 3600)
    acts = {e["action"]: e["actor"] for e in ledger.history() if e["action"] in
            ("policy", "unquarantine")}  # fmt: skip
    assert acts == {"policy": ACTOR, "unquarantine": ACTOR}
    listed = httpx.get(
        f"{server.url}/dp-budget/api/policies",
        headers={"Authorization": f"Bearer {server.token()}"},
    ).json()
    assert {"tenant": "acme", "query_type": "count"}.items() <= listed[-1].items()
    assert ledger.verify().ok


def test_without_the_key_file_nothing_changes(server, ledger):
    before = _state(ledger)
    hidden = server.key_file.with_name("moved-away")
    server.key_file.rename(hidden)
    try:
        response = _act(server, "admin", "PUT", "/api/admin/policy", {**POLICY, "cap_epsilon": 9})
    finally:
        hidden.rename(server.key_file)
    assert response.status_code == 503
    assert "admin_key_file: cannot read the admin key file" in response.json()["detail"]
    assert _state(ledger) == before


def test_an_admin_opens_a_refusal_reference(server, ledger):
    """A task's refusal tells it only a reference; the UI's administrator opens it."""
    user = key_for("user-007", "heatmap", server.window, tenant="acme")  # EXHAUSTED
    with pytest.raises(ReleaseRefused) as refused:
        ReleaseGate(ledger).reserve([user], GaussianMechanism(1.0), attempt="d/t/r/-1/1")
    opened = _act(server, "admin", "POST", "/api/admin/refusal",
                  {"reference": refused.value.reference})  # fmt: skip
    assert opened.status_code == 200, opened.text
    facts = opened.json()["facts"]
    assert facts["refusal"] == "BudgetExhausted"
    assert (facts["account"]["subject"], facts["cap_epsilon"]) == ("user-007", 2.0)
    forged = refused.value.reference[:-8] + "AAAAAAAA"
    bad = _act(server, "admin", "POST", "/api/admin/refusal", {"reference": forged})
    assert bad.status_code == 422
    assert "not sealed to this admin key, or is damaged" in bad.json()["detail"]
