"""The administrator's acts through the UI app (FastAPI's TestClient, Airflow's simple auth
manager, a real PostgreSQL ledger): who may act, CSRF, the key file, and the refusal
references. The same acts against the real api-server and its SQLite ledger:
``test_api_server.py``."""

from __future__ import annotations

import re

import pytest

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import PrivacyBudgetLedger
from dp_budget_provider.ledger.gate import ReleaseGate, ReleaseRefused
from dp_budget_provider.plugins import csrf
from tests.admin import ADMIN, admin_key_file
from tests.plugins.conftest import CHAIN_KEY, WINDOW

# The tests seed their ledgers in this process: the ledger's clock is pinned inside WINDOW.
LEDGER_WINDOWS = (WINDOW,)

KEY_ENV = "AIRFLOW__DP_BUDGET__ADMIN_KEY_FILE"
ADMIN_ROUTES = (
    ("PUT", "/api/admin/policy", {"tenant": "acme", "query_type": "count", "cap_epsilon": 9}),
    ("POST", "/api/admin/quarantine/clear", {"reason": "checked"}),
    ("POST", "/api/admin/refusal", {"reference": "dpb-ref-1.AAAA"}),
)
CSRF_META = re.compile(r'<meta name="dp-budget-csrf" content="([^"]+)">')


@pytest.fixture
def ledger_url(postgres_url):
    """PostgreSQL only: the acts are the ledger's (tested on both backends there), and the
    real api-server's tests run them on SQLite."""
    return postgres_url


@pytest.fixture
def app(seeded, ledger_url, monkeypatch):
    """The UI app on the seeded ledger, acting with the tests' administrator key."""
    from dp_budget_provider.plugins.app import create_app

    monkeypatch.setenv(KEY_ENV, str(admin_key_file()))

    def administered(key, actor):
        return PrivacyBudgetLedger(
            url=ledger_url, chain_key=CHAIN_KEY, admin=key, admin_public_key=ADMIN.public,
            actor=actor,
        )  # fmt: skip

    return create_app(lambda: seeded.ledger, administered)


@pytest.fixture
def browser(app):
    """A client with no credential of its own (the tests give it a cookie or a header)."""
    from fastapi.testclient import TestClient

    with TestClient(app, base_url="http://airflow.test") as test_client:
        yield test_client


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def state(ledger: PrivacyBudgetLedger) -> tuple:
    report = ledger.verify()
    return report.entries, [p.as_record() for p in ledger.policies()], ledger.quarantine_status()


def test_an_admin_sets_caps_across_scopes_and_a_filter_order(browser, seeded, admin_token):
    for change, checked in (
        ({"tenant": "beta", "across": "query_types", "cap_epsilon": 1.0, "filter_order": "auto"},
         {"query_type": "*across query types", "calendar_span": 1, "filter_order": 18.0}),
        ({"tenant": "beta", "across": "windows", "horizon_windows": 52, "cap_epsilon": 3.0},
         {"query_type": "*across windows", "calendar_span": 52, "filter_order": 7.5}),
        ({"tenant": "gamma", "across": "windows", "horizon_windows": 52, "cap_epsilon": 3.0,
          "filter_order": "reported"},
         {"query_type": "*across windows", "calendar_span": 52, "filter_order": None}),
    ):  # fmt: skip
        response = browser.put("/api/admin/policy", json=change, headers=bearer(admin_token))
        assert response.status_code == 200, response.text
        policy = response.json()["policy"]
        assert {name: policy[name] for name in checked} == checked
    refused = browser.put(
        "/api/admin/policy",
        json={"tenant": "beta", "across": "windows", "cap_epsilon": 3.0, "query_type": "count"},
        headers=bearer(admin_token),
    )
    assert refused.status_code in (400, 422) and "query_type" in refused.text


def test_an_admin_divides_a_cap_among_principals(browser, seeded, admin_token):
    change = {
        "tenant": "beta", "across": "query_types", "cap_epsilon": 2.0,
        "shares": [{"principal": "analytics", "fraction": 0.5, "dags": ["etl_a"]}],
    }  # fmt: skip
    response = browser.put("/api/admin/policy", json=change, headers=bearer(admin_token))
    assert response.status_code == 200, response.text
    (share,) = response.json()["policy"]["shares"]
    assert share["principal"] == "analytics" and 0 < share["cap_epsilon"] < 2.0
    page = browser.get("/policies", headers=bearer(admin_token))
    assert "analytics 50%" in page.text
    # The form's text: shares separated by ';', or none.
    browser.cookies.set("_token", admin_token)
    token = CSRF_META.search(browser.get("/policies").text).group(1)
    form = browser.post(
        "/admin/policy",
        data={"tenant": "beta", "across": "query_types", "csrf_token": token,
              "shares": "analytics=0.4:etl_a; growth=0.6:etl_g,etl_h"},
    )  # fmt: skip
    assert form.status_code == 200, form.text
    policy = {p.scope: p for p in seeded.ledger.policies()}[("beta", "*across query types")]
    assert [(s.principal, s.dags) for s in policy.shares] == [
        ("analytics", ("etl_a",)),
        ("growth", ("etl_g", "etl_h")),
    ]
    bad = browser.post(
        "/admin/policy",
        data={"tenant": "beta", "across": "query_types", "csrf_token": token,
              "shares": "analytics=0.7:etl_a; growth=0.6:etl_g"},
    )  # fmt: skip
    assert bad.status_code in (400, 422) and "at most 1" in bad.text
    undivided = browser.post(
        "/admin/policy",
        data={"tenant": "beta", "across": "query_types", "csrf_token": token, "shares": "none"},
    )
    assert undivided.status_code == 200, undivided.text
    policy = {p.scope: p for p in seeded.ledger.policies()}[("beta", "*across query types")]
    assert policy.shares == ()


def test_an_admin_sets_a_policy_audited_with_their_name(browser, seeded, admin_token):
    response = browser.put(
        "/api/admin/policy",
        json={"tenant": "acme", "query_type": "count", "cap_epsilon": 1.5,
              "compliance_clause": "Art. 5"},
        headers=bearer(admin_token),
    )  # fmt: skip
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["created"] and body["actor"] == "admin (Airflow UI)"
    assert body["policy"]["cap_epsilon"] == 1.5 and body["policy"]["calendar"] == "iso_week"
    # Only the warning fraction given: the cap and clause are kept (as `dp-budget policy set`)
    again = browser.put(
        "/api/admin/policy",
        json={"tenant": "acme", "query_type": "count", "warn_fraction": 0.5},
        headers=bearer(admin_token),
    ).json()
    assert not again["created"]
    assert (again["policy"]["cap_epsilon"], again["policy"]["compliance_clause"]) == (1.5, "Art. 5")
    policy = {p.scope: p for p in seeded.ledger.policies()}[("acme", "count")]
    assert (policy.cap_epsilon, policy.warn_fraction) == (1.5, 0.5)
    entries = [e for e in seeded.ledger.history() if e["action"] == "policy"][-2:]
    assert [e["actor"] for e in entries] == ["admin (Airflow UI)"] * 2
    assert seeded.ledger.verify().ok


def test_a_viewer_is_refused_every_act_and_sees_no_controls(
    browser, seeded, viewer_token, admin_token
):
    """The simple auth manager answers custom views as reads: the UI lets only its ADMIN
    role act, or every viewer could raise a cap."""
    seeded.ledger.quarantine("a test")
    before = state(seeded.ledger)
    for method, path, body in ADMIN_ROUTES:
        response = browser.request(method, path, json=body, headers=bearer(viewer_token))
        assert response.status_code == 403, (path, response.text)
        assert "can_edit" in response.json()["detail"]
    assert browser.get("/admin/refusal", headers=bearer(viewer_token)).status_code == 403
    assert state(seeded.ledger) == before
    for page in ("/policies", "/accounts"):
        html = browser.get(page, headers=bearer(viewer_token)).text
        assert "set-policy" not in html and "clear-quarantine" not in html
        assert "dp-budget-csrf" not in html and "/admin/refusal" not in html
    html = browser.get("/policies", headers=bearer(admin_token)).text
    assert 'id="set-policy"' in html and 'id="clear-quarantine"' in html


def test_without_the_key_file_nothing_is_offered_or_changed(
    browser, seeded, admin_token, monkeypatch
):
    seeded.ledger.quarantine("a test")
    before = state(seeded.ledger)
    monkeypatch.delenv(KEY_ENV)
    for method, path, body in ADMIN_ROUTES:
        response = browser.request(method, path, json=body, headers=bearer(admin_token))
        assert response.status_code == 503, path
        assert "holds no administrator key ([dp_budget] admin_key_file" in response.json()["detail"]
    html = browser.get("/policies", headers=bearer(admin_token)).text
    assert 'id="set-policy"' not in html and 'id="clear-quarantine"' not in html
    assert 'id="no-admin-key"' in html
    monkeypatch.setenv(KEY_ENV, str(admin_key_file().parent / "missing.key"))
    response = browser.request(*ADMIN_ROUTES[0][:2], json=ADMIN_ROUTES[0][2],
                               headers=bearer(admin_token))  # fmt: skip
    assert response.status_code == 503 and "cannot read the admin key file" in response.text
    assert state(seeded.ledger) == before


def test_an_admin_clears_a_quarantine(browser, seeded, admin_token):
    headers = bearer(admin_token)
    not_quarantined = browser.post("/api/admin/quarantine/clear", json={"reason": "x"},
                                   headers=headers)  # fmt: skip
    assert not_quarantined.status_code == 409
    assert "not quarantined" in not_quarantined.json()["detail"]
    seeded.ledger.quarantine("checkpoint mismatch")
    response = browser.post(
        "/api/admin/quarantine/clear", json={"reason": "restored the backup"}, headers=headers
    )
    assert response.status_code == 200, response.text
    assert response.json()["quarantine_reason"] == "checkpoint mismatch"
    assert seeded.ledger.quarantine_status() is None
    cleared = [e for e in seeded.ledger.history() if e["action"] == "unquarantine"][-1]
    assert cleared["actor"] == "admin (Airflow UI)"
    assert cleared["payload"]["reason"] == "restored the backup"
    # the banner's form, inside the Airflow UI (the cookie, and the page's token)
    seeded.ledger.quarantine("second drill")
    browser.cookies.set("_token", admin_token)
    page = browser.get("/accounts")
    assert 'id="clear-quarantine"' in page.text
    token = CSRF_META.search(page.text).group(1)
    form = browser.post("/admin/quarantine/clear", data={"reason": "drill", "csrf_token": token})
    assert form.status_code == 200 and "cleared by admin (Airflow UI): drill" in form.text
    assert seeded.ledger.quarantine_status() is None


def test_refusal_references_open_for_the_admin_only(browser, seeded, admin_token):
    try:
        ReleaseGate(seeded.ledger).reserve(
            [seeded.exhausted], GaussianMechanism(1.0), attempt="d/t/r/-1/1"
        )
    except ReleaseRefused as refused:
        reference = refused.reference
    else:
        pytest.fail("the exhausted account granted a release")
    opened = browser.post("/api/admin/refusal", json={"reference": reference},
                          headers=bearer(admin_token))  # fmt: skip
    assert opened.status_code == 200, opened.text
    facts = opened.json()["facts"]
    assert facts["refusal"] == "BudgetExhausted" and facts["account"]["subject"] == "user-000"
    assert facts["epsilon"] > facts["cap_epsilon"] == 2.0
    assert "/account?" in opened.json()["account_url"]
    browser.cookies.set("_token", admin_token)
    token = CSRF_META.search(browser.get("/admin/refusal").text).group(1)
    shown = browser.post("/admin/refusal", data={"reference": reference, "csrf_token": token})
    assert shown.status_code == 200 and 'id="refusal-account"' in shown.text
    assert "BudgetExhausted" in shown.text and "user-000" in shown.text
    garbled = reference[:40] + ("A" if reference[40] != "A" else "B") + reference[41:]
    for bad in (garbled, "dpb-ref-1.not-base64!", "no reference at all"):
        response = browser.post("/api/admin/refusal", json={"reference": bad},
                                headers=bearer(admin_token))  # fmt: skip
        assert response.status_code == 422, bad
        detail = response.json()["detail"]
        assert "not sealed to this admin key, or is damaged" in detail or "starts with" in detail


def test_cookie_requests_need_the_pages_csrf_token(browser, seeded, admin_token):
    """Inside the Airflow UI the cookie authenticates, and a browser sends it with a form
    another site posts: such a request needs the token of one of our pages."""
    browser.cookies.set("_token", admin_token)
    change = {"tenant": "acme", "query_type": "count", "cap_epsilon": 7}
    before = state(seeded.ledger)
    assert browser.put("/api/admin/policy", json=change).status_code == 403
    forged = browser.post("/admin/policy", data={**change, "csrf_token": "1.forged"})
    assert forged.status_code == 403 and "cross-site" in forged.text
    page = browser.get("/policies")
    token = CSRF_META.search(page.text).group(1)
    for origin in ({"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
        cross_site = browser.put(
            "/api/admin/policy", json=change, headers={csrf.HEADER: token, **origin}
        )
        assert cross_site.status_code == 403, origin
    assert state(seeded.ledger) == before
    same_site = browser.put(
        "/api/admin/policy", json=change, headers={csrf.HEADER: token, "Origin": "http://airflow.test"}
    )  # fmt: skip
    assert same_site.status_code == 200, same_site.text
    form = browser.post(
        "/admin/policy",
        data={"tenant": "acme", "query_type": "count", "cap_epsilon": "", "warn_fraction": "0.6",
              "csrf_token": token},
    )  # fmt: skip
    assert form.status_code == 200, form.text
    assert "policy acme/count updated by admin (Airflow UI): cap 7" in form.text
    assert form.headers["content-security-policy"].startswith("default-src 'none'")
    invalid = browser.post("/admin/policy", data={"tenant": "acme", "cap_epsilon": "lots",
                                                   "csrf_token": token})  # fmt: skip
    assert invalid.status_code == 422 and "cap_epsilon" in invalid.text
