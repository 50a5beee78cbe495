"""The UI's JSON API on ledgers filled by real releases (SQLite, PostgreSQL), and its security."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import LedgerKey, Policy, key_for
from dp_budget_provider.ledger.windows.policy import ACROSS_QUERY_TYPES, ACROSS_WINDOWS
from tests.plugins.conftest import CLAUSE, WINDOW, XSS

# Over 20 s in all: scheduled before the light files (tests/conftest.py).
pytestmark = pytest.mark.heavy

# The tests seed their ledgers in this process: the ledger's clock is pinned inside WINDOW.
LEDGER_WINDOWS = (WINDOW,)

ROUTES = (
    "/",
    "/accounts",
    "/classes",
    "/classes/members",
    "/account",
    "/release",
    "/policies",
    "/openapi.json",
    "/api/accounts",
    "/api/classes",
    "/api/classes/members",
    "/api/account",
    "/api/account/history",
    "/api/account/reservations",
    "/api/release",
    "/api/policies",
    "/api/report",
    "/api/verification",
)


def key_params(key: LedgerKey) -> dict[str, str]:
    return key.as_dict()


# ---------------------------------------------------------------------- security


# The administrator's routes (tests/plugins/test_admin.py): every other route only reads.
ADMIN_ROUTES = (
    "/api/admin/policy",
    "/api/admin/quarantine/clear",
    "/api/admin/refusal",
    "/admin/policy",
    "/admin/quarantine/clear",
    "/admin/refusal",
)


def test_every_route_is_in_the_list_the_security_tests_cover(client):
    paths = {route.path for route in client.app.routes}
    assert paths == set(ROUTES) | set(ADMIN_ROUTES)


def test_unauthenticated_admin_requests_get_401(anonymous):
    routes = [route for route in anonymous.app.routes if route.path in ADMIN_ROUTES]
    for route in routes:
        for method in route.methods:
            response = anonymous.request(method, route.path, json={"reference": "dpb-ref-1.x"})
            assert response.status_code == 401, (method, route.path)
    assert sum(len(route.methods) for route in routes) == 7


@pytest.mark.parametrize("path", ROUTES)
def test_unauthenticated_requests_get_401_and_no_data(anonymous, seeded, path):
    response = anonymous.get(path, params=key_params(seeded.xss), follow_redirects=False)
    assert response.status_code == 401
    body = response.text
    for secret in ("user-000", "alert(1)", "acme", "epsilon", "heatmap"):
        assert secret not in body


@pytest.mark.parametrize("path", ["/api/accounts", "/accounts"])
def test_bad_credentials_are_refused(
    anonymous, path, roleless_token, expired_token, viewer_token, admin_token
):
    cases = {
        f"Bearer {roleless_token}": 403,  # valid token, no permission on the view
        f"Bearer {expired_token}": 401,
        "Bearer not-a-jwt": 403,
        f"Basic {admin_token}": 401,  # not a bearer credential: no identity at all
    }
    for header, status in cases.items():
        response = anonymous.get(path, headers={"Authorization": header})
        assert response.status_code == status, header
        assert "user-000" not in response.text
    assert anonymous.get(path, headers={"Authorization": f"Bearer {viewer_token}"}).is_success


def test_the_uis_cookie_authenticates(anonymous, admin_token):
    """Inside the Airflow UI the page is an iframe: the UI's _token cookie is the credential."""
    anonymous.cookies.set("_token", admin_token)
    response = anonymous.get("/accounts")
    assert response.status_code == 200
    assert "user-000" in response.text


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
def test_the_ui_is_read_only(client, seeded, method):
    before = seeded.ledger.verify()
    for path in ROUTES:
        response = client.request(method, path, params=key_params(seeded.xss))
        assert response.status_code == 405, (method, path)
    after = seeded.ledger.verify()
    assert (after.entries, after.accounts) == (before.entries, before.accounts)


def test_responses_are_not_cached_and_not_sniffed(client):
    response = client.get("/api/accounts")
    assert response.headers["cache-control"] == "no-store"
    assert response.headers["x-content-type-options"] == "nosniff"


def test_openapi_documents_the_api_and_its_auth(client):
    schema = client.get("/openapi.json").json()
    assert {
        "/api/accounts",
        "/api/account",
        "/api/account/history",
        "/api/account/reservations",
        "/api/policies",
        "/api/report",
        "/api/verification",
    } <= set(schema["paths"])
    assert "OAuth2PasswordBearer" in schema["components"]["securitySchemes"]
    account = schema["components"]["schemas"]["AccountModel"]["properties"]
    assert {"epsilon", "cap_epsilon", "remaining", "fraction", "state"} <= set(account)


# ---------------------------------------------------------------------- accounts


def test_classes_show_a_cohort_once_and_its_members_on_demand(client, seeded):
    body = client.get("/api/classes", params={"tenant": "acme"}).json()
    assert body["total"] == 4
    rows = [
        (c["subjects"], c["account"]["subject"], c["account"]["state"]) for c in body["classes"]
    ]
    assert rows == [
        (10, "user-010", "ok"), (10, "user-020", "ok"), (9, "user-001", "WARNING"),
        (1, "user-000", "EXHAUSTED"),
    ]  # fmt: skip
    warning = body["classes"][2]
    members = client.get(warning["members_url"] + "&limit=4&offset=2")
    assert members.status_code == 200, (warning["members_url"], members.text)
    members = members.json()
    assert members["total"] == 9
    assert [a["subject"] for a in members["accounts"]] == [f"user-00{i}" for i in range(3, 7)]
    assert {a["epsilon"] for a in members["accounts"]} == {warning["account"]["epsilon"]}
    search = client.get("/api/classes", params={"subject": "user-00*", "state": "warning"})
    assert [c["subjects"] for c in search.json()["classes"]] == [9]
    seeded.ledger.spend(seeded.heatmap[5], GaussianMechanism(40.0))  # subject 5 leaves it
    after = client.get(warning["members_url"]).json()
    assert after["total"] == 8 and "user-005" not in {a["subject"] for a in after["accounts"]}
    gone = client.get("/api/classes/members", params={**key_params(seeded.heatmap[0]),
                                                       "class_id": "0" * 16})  # fmt: skip
    assert gone.status_code == 404 and "list the classes again" in gone.json()["detail"]
    bad = client.get("/api/classes", params={"state": "broke"})
    assert bad.status_code == 422 and "state must be one of" in bad.json()["detail"]


def test_accounts_match_the_ledger(client, seeded):
    body = client.get("/api/accounts", params={"limit": 1000}).json()
    expected = {str(a.key): a for a in seeded.ledger.accounts()}
    assert body["total"] == len(expected) == 31
    assert [
        f"{a['tenant']}/{a['subject']}/{a['query_type']}/{a['window']}" for a in body["accounts"]
    ] == list(expected)  # key order, as the ledger lists them
    for row in body["accounts"]:
        status = expected[f"{row['tenant']}/{row['subject']}/{row['query_type']}/{row['window']}"]
        assert row["epsilon"] == pytest.approx(status.epsilon, rel=1e-12)
        assert row["cap_epsilon"] == status.cap_epsilon
        assert row["remaining"] == pytest.approx(status.remaining, rel=1e-12, abs=1e-15)
        assert row["open_reservations"] == status.open_reservations
        assert row["releases"] == status.releases
        assert row["delta"] == 1e-5
        assert row["page_url"].startswith("/account?tenant=")


def test_accounts_pagination_is_server_side(client):
    first = client.get("/api/accounts", params={"limit": 10}).json()
    second = client.get("/api/accounts", params={"limit": 10, "offset": 10}).json()
    last = client.get("/api/accounts", params={"limit": 10, "offset": 30}).json()
    assert (first["total"], second["total"], last["total"]) == (31, 31, 31)
    assert [len(p["accounts"]) for p in (first, second, last)] == [10, 10, 1]
    subjects = [a["subject"] for p in (first, second, last) for a in p["accounts"]]
    assert len(set(subjects)) == 21  # no page repeats a row
    assert client.get("/api/accounts", params={"limit": 0}).status_code == 422
    assert client.get("/api/accounts", params={"limit": 1001}).status_code == 422
    for huge in ({"offset": 10**20}, {"offset": -1}):
        assert client.get("/api/accounts", params={"limit": 10, **huge}).status_code == 422
    assert client.get("/accounts", params={"page": 10**20}).status_code == 422


def test_accounts_filter_by_every_key_field_and_state(client, seeded):
    def subjects(**params):
        body = client.get("/api/accounts", params={"limit": 1000, **params}).json()
        return body["total"], [a["subject"] for a in body["accounts"]]

    assert subjects(tenant="ACME ")[0] == 30  # canonicalised like keys
    assert subjects(tenant="default") == (1, [XSS])
    assert subjects(subject="user-01*")[1] == [f"user-01{i}" for i in range(10)]
    assert subjects(subject="*-02*")[0] == 10
    assert subjects(subject="user_0*") == (0, [])  # _ is literal, not a SQL wildcard
    assert subjects(subject="user%")[0] == 0  # % is literal too (exact match)
    assert subjects(query_type="count") == (1, [XSS])
    assert subjects(window=WINDOW.upper())[0] == 31
    assert subjects(window="2026-w29")[0] == 0
    assert subjects(state="exhausted") == (1, ["user-000"])
    assert subjects(state="WARNING")[1] == [f"user-00{i}" for i in range(1, 10)]
    assert subjects(state="ok")[0] == 21
    assert subjects(state="ok", tenant="acme", subject="user-02*")[0] == 10
    assert client.get("/api/accounts", params={"state": "fine"}).status_code == 422
    assert client.get("/api/accounts", params={"subject": "a\u0000b"}).status_code == 422
    long_filter = client.get("/api/accounts", params={"subject": "x" * 60_000})
    assert long_filter.status_code == 422 and "at most 256" in long_filter.text
    assert ".db" not in long_filter.text  # no database path in an error


def test_accounts_sort(client):
    def order(**params):
        body = client.get("/api/accounts", params={"limit": 1000, **params}).json()
        return [(a["subject"], a["epsilon"]) for a in body["accounts"]]

    by_epsilon = order(sort="epsilon", order="desc")
    assert by_epsilon[0][0] == "user-000"
    assert [e for _, e in by_epsilon] == sorted((e for _, e in by_epsilon), reverse=True)
    # ties are broken by key, so pages are stable
    assert [s for s, _ in by_epsilon[1:10]] == [f"user-00{i}" for i in range(1, 10)]
    by_fraction = [s for s, _ in order(sort="fraction", order="desc")]
    assert by_fraction[:2] == ["user-000", "user-001"]
    assert order(sort="subject")[0][0] == XSS  # '<' sorts before letters
    assert order(sort="subject", order="desc")[0][0] == "user-029"
    assert order(sort="remaining")[0][0] == "user-000"
    assert order(sort="releases", order="desc")[0][0] == XSS
    assert order(sort="open_reservations", order="desc")[0][0] == XSS
    assert order(sort="state", order="desc")[0][0] == "user-000"
    page = client.get(
        "/api/accounts", params={"sort": "epsilon", "order": "desc", "limit": 5, "offset": 5}
    ).json()
    assert [a["subject"] for a in page["accounts"]] == [s for s, _ in by_epsilon[5:10]]
    assert client.get("/api/accounts", params={"sort": "nonsense"}).status_code == 422


# ---------------------------------------------------------------------- one account


def test_account_detail(client, seeded):
    ledger = seeded.ledger
    body = client.get("/api/account", params=key_params(seeded.xss)).json()
    assert body["key"]["subject"] == XSS
    assert body["account"]["epsilon"] == pytest.approx(ledger.epsilon_of(seeded.xss), rel=1e-12)
    assert body["account"]["open_reservations"] == 1
    assert body["policy"]["tenant"] == "*" and body["policy"]["cap_epsilon"] == 3.0
    series = body["series"]
    assert series["events"] == 5
    epsilons = [p["epsilon"] for p in series["points"]]
    assert epsilons == sorted(epsilons)
    assert epsilons[-1] == pytest.approx(ledger.epsilon_of(seeded.xss), rel=1e-9)
    (reservation,) = body["open_reservations"]
    assert reservation["attempt_id"] == "counts/count/run5/-1/1"
    assert reservation["mechanism"] == {"kind": "laplace", "epsilon0": 0.1}


def test_account_detail_of_a_multi_key_account_with_a_correction(client, seeded):
    body = client.get("/api/account", params=key_params(seeded.exhausted)).json()
    assert body["account"]["state"] == "EXHAUSTED" and body["account"]["remaining"] == 0.0
    assert body["policy"]["compliance_clause"] == CLAUSE
    assert [p["action"] for p in body["series"]["points"]] == [
        "commit",
        "commit",
        "commit",
        "correction",
    ]
    assert body["series"]["points"][-1]["epsilon"] == pytest.approx(
        seeded.ledger.epsilon_of(seeded.exhausted), rel=1e-9
    )
    assert body["open_reservations"] == []


def test_account_detail_shows_the_subjects_totals_where_caps_keep_them(client, seeded):
    """beta caps each subject's total across query types and over a horizon of 52 weeks: a
    query type's account names both totals, and a total's own page names the other."""
    ledger = seeded.ledger
    ledger.set_policy(Policy(4.0, tenant="beta", across="query_types"))
    ledger.set_policy(Policy(9.0, tenant="beta", across="windows", horizon_windows=52))
    for query_type in ("heatmap", "count"):
        ledger.spend(key_for("zoe", query_type, WINDOW, tenant="beta"), GaussianMechanism(4.0))
    own = key_for("zoe", "heatmap", WINDOW, tenant="beta")
    body = client.get("/api/account", params=key_params(own)).json()
    totals = {total["query_type"]: total for total in body["totals"]}
    assert set(totals) == {ACROSS_QUERY_TYPES, ACROSS_WINDOWS}
    across_types = key_for("zoe", ACROSS_QUERY_TYPES, WINDOW, tenant="beta")
    assert totals[ACROSS_QUERY_TYPES]["epsilon"] == pytest.approx(
        ledger.epsilon_of(across_types), rel=1e-12
    )
    assert totals[ACROSS_QUERY_TYPES]["cap_epsilon"] == 4.0
    assert totals[ACROSS_WINDOWS]["window"] == "2025-w43+52"
    assert totals[ACROSS_WINDOWS]["epsilon"] > ledger.epsilon_of(own)
    # acme has no such caps: its accounts name no totals.
    assert client.get("/api/account", params=key_params(seeded.exhausted)).json()["totals"] == []
    page = client.get("/account", params=key_params(own)).text
    assert "This subject&#39;s totals" in page or "This subject's totals" in page
    assert "2025-w43+52" in page


def test_account_series_is_sampled_when_long(client, seeded):
    body = client.get("/api/account", params={**key_params(seeded.xss), "max_points": 2}).json()
    assert body["series"]["events"] == 5
    assert [p["seq"] for p in body["series"]["points"]] == sorted(
        p["seq"] for p in body["series"]["points"]
    )
    assert len(body["series"]["points"]) == 2


def test_unknown_and_invalid_keys(client):
    unknown = {"tenant": "acme", "subject": "nobody", "query_type": "heatmap", "window": WINDOW}
    assert client.get("/api/account", params=unknown).status_code == 404
    assert client.get("/account", params=unknown).status_code == 404
    invalid = {**unknown, "subject": "   "}
    assert client.get("/api/account", params=invalid).status_code == 422
    assert client.get("/api/account/history", params=invalid).status_code == 422
    assert client.get("/api/account", params={"tenant": "acme"}).status_code == 422


def test_history_of_a_key_paginated(client, seeded):
    key = seeded.heatmap[0]
    expected = seeded.ledger.history(key)
    body = client.get("/api/account/history", params=key_params(key)).json()
    assert body["total"] == len(expected) == 7  # 3 reserves, 3 commits, 1 correction
    assert [e["seq"] for e in body["entries"]] == [e["seq"] for e in reversed(expected)]
    newest = body["entries"][0]
    assert newest["action"] == "correction" and newest["note"] == "release missed by the ledger"
    commit = next(e for e in body["entries"] if e["action"] == "commit")
    # One release over 10 subjects that every release so far covered together: one class.
    assert commit["key_count"] == 1 and commit["subjects"] == 10
    assert commit["key"]["subject"].startswith("Class-")  # the class, not one subject
    assert commit["attempt_id"].startswith("example_dp_heatmap/release_heatmap/manual__")
    assert commit["mechanism"] == {"kind": "gaussian", "noise_multiplier": 4.0}
    assert commit["cost_epsilon"] == pytest.approx(0.9263415, rel=1e-6)
    oldest = client.get(
        "/api/account/history", params={**key_params(key), "order": "oldest", "limit": 2}
    ).json()
    assert [e["seq"] for e in oldest["entries"]] == [e["seq"] for e in expected[:2]]
    second = client.get(
        "/api/account/history", params={**key_params(key), "limit": 3, "offset": 3}
    ).json()
    assert [e["seq"] for e in second["entries"]] == [e["seq"] for e in reversed(expected)][3:6]


def test_reservations_of_a_key(client, seeded):
    params = key_params(seeded.xss)
    every = client.get("/api/account/reservations", params=params).json()
    assert every["total"] == 6
    assert every["reservations"][0]["state"] == "open"  # newest first
    only_open = client.get("/api/account/reservations", params={**params, "state": "open"}).json()
    assert only_open["total"] == 1
    committed = client.get(
        "/api/account/reservations", params={**params, "state": ["committed"], "limit": 2}
    ).json()
    assert committed["total"] == 5 and len(committed["reservations"]) == 2
    bad = client.get("/api/account/reservations", params={**params, "state": "lost"})
    assert bad.status_code == 422


def test_policies_report_and_verification(client, seeded):
    policies = client.get("/api/policies").json()
    assert [(p["tenant"], p["query_type"]) for p in policies] == [("*", "*"), ("acme", "heatmap")]
    assert policies[1]["compliance_clause"] == CLAUSE
    report = client.get("/api/report", params={"tenant": "acme"}).json()
    assert report["accounts"] == [] and report["verification"]["ok"]  # by class by default
    assert sum(c["subjects"] for c in report["classes"]) == 30
    paged = client.get(
        "/api/report", params={"tenant": "acme", "subjects": "true", "page": 2, "page_size": 20}
    ).json()
    assert len(paged["accounts"]) == 10 and paged["subjects"]["pages"] == 2
    markdown = client.get("/api/report", params={"format": "md"})
    assert markdown.headers["content-type"].startswith("text/markdown")
    assert markdown.text.startswith("# Privacy report")
    verification = client.get("/api/verification").json()
    assert verification["ok"] and verification["problems"] == []
    assert verification["head_seq"] == seeded.ledger.history()[-1]["seq"]


def test_verification_reports_tampering(client, seeded, monkeypatch):
    assert client.get("/api/verification").json()["ok"]
    with seeded.ledger._database.engine.begin() as connection:
        connection.execute(
            text("UPDATE dp_history SET actor = 'mallory' WHERE seq = 3")
        )  # an edit that leaves the chain head as it was
    from dp_budget_provider.plugins import app as app_module

    monkeypatch.setattr(app_module, "VERIFY_TTL_SECONDS", 0.0)
    verification = client.get("/api/verification").json()
    assert not verification["ok"]
    assert any("entry 3" in problem for problem in verification["problems"])


def test_a_ledger_that_cannot_be_opened_is_a_503(admin_token, tmp_path):
    from fastapi.testclient import TestClient

    from dp_budget_provider.ledger import PrivacyBudgetLedger
    from dp_budget_provider.plugins.app import create_app

    def missing() -> PrivacyBudgetLedger:  # a new database: the UI never creates a ledger
        return PrivacyBudgetLedger(url=f"sqlite:///{tmp_path / 'none.db'}")

    with TestClient(create_app(missing)) as client:
        client.headers["Authorization"] = f"Bearer {admin_token}"
        response = client.get("/api/accounts")
        assert response.status_code == 503
        assert "BudgetCap" in response.json()["detail"]
        assert client.get("/accounts").status_code == 503


def test_accounts_show_held_spend_and_exhaustion_by_the_next_release(client, seeded):
    """user-001 is at 85% of its cap, and one more open heatmap reservation leaves no
    room for another: it reads EXHAUSTED with its held spend, in the list and in detail."""
    ledger, key = seeded.ledger, seeded.heatmap[1]
    ledger.reserve([key], GaussianMechanism(4.0), attempt="heatmap/held/-1/1")
    held = ledger.prospective_accountant(key).epsilon_bound(1e-5).epsilon
    body = client.get("/api/accounts", params={"state": "exhausted"}).json()
    assert [a["subject"] for a in body["accounts"]] == ["user-000", "user-001"]
    row = body["accounts"][1]
    assert row["fraction"] < 0.9 and row["state"] == "EXHAUSTED" and row["exhausted"]
    assert row["held_epsilon"] == pytest.approx(held, rel=1e-12)
    assert row["remaining_after_held"] == pytest.approx(2.0 - held, rel=1e-12)
    detail = client.get("/api/account", params=key_params(key)).json()["account"]
    assert detail["held_epsilon"] == row["held_epsilon"] and detail["open_reservations"] == 1
    by_remaining = client.get("/api/accounts", params={"sort": "remaining", "limit": 2}).json()
    assert [a["subject"] for a in by_remaining["accounts"]] == ["user-000", "user-001"]


def test_openapi_documents_the_held_fields(client):
    account = client.get("/openapi.json").json()["components"]["schemas"]["AccountModel"]
    assert {"held_epsilon", "remaining_after_held"} <= set(account["required"])
    assert "cheapest release" in account["properties"]["state"]["description"]
