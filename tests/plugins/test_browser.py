"""End to end: `airflow api-server` with the provider, a seeded ledger, headless Chromium.

Needs Debian's ``/usr/bin/chromium`` (``apt-get install chromium``); the tests fail, not
skip, without it. Screenshots go to the test's directory; with
``DP_BUDGET_UPDATE_SCREENSHOTS=1`` they also replace ``docs/ui-*.png``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

import httpx
import pytest

from tests.plugins.airflow_server import ROOT, airflow_api_server

# Over 20 s in all: scheduled before the light files (tests/conftest.py).
pytestmark = pytest.mark.heavy

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
TIMEOUT_MS = 30_000
XSS = "<script>alert(1)</script>"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (the UI tests need it)")
    with airflow_api_server(tmp_path_factory.mktemp("airflow-ui")) as running:
        yield running


@pytest.fixture(scope="module")
def browser(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, timeout=TIMEOUT_MS
        )
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(TIMEOUT_MS)
    opened = context.new_page()
    dialogs: list[str] = []
    opened.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    opened.dialogs = dialogs
    try:
        yield opened
    finally:
        context.close()


def screenshot(page, tmp_path, name: str, **options) -> None:
    path = tmp_path / name
    page.screenshot(path=str(path), **options)
    if os.environ.get("DP_BUDGET_UPDATE_SCREENSHOTS") == "1":
        shutil.copy(path, ROOT / "docs" / name)


def log_in(page, server) -> None:
    page.goto(f"{server.url}/")
    page.wait_for_url("**/auth/login**")  # the UI sends a visitor without a session there
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", server.password)
    page.click("button[type=submit]")
    page.wait_for_url(f"{server.url}/", wait_until="networkidle")


def test_the_seed_ran_real_releases(server):
    assert [r["state"] for r in server.runs] == ["success"] * 4
    assert [r["tenant"] for r in server.runs] == ["acme", "acme", "acme", "globex"]


def test_unauthenticated_requests_are_refused(server):
    for path in ("/dp-budget/accounts", "/dp-budget/api/accounts", "/dp-budget/openapi.json"):
        response = httpx.get(server.url + path, timeout=30)
        assert response.status_code == 401, path
        assert "user-000" not in response.text
    forged = httpx.get(
        f"{server.url}/dp-budget/api/accounts",
        headers={"Authorization": "Bearer forged.token.value"},
        timeout=30,
    )
    assert forged.status_code == 403 and "user-000" not in forged.text


def test_token_api_openapi_and_the_task_link(server):
    headers = {"Authorization": f"Bearer {server.token()}"}
    accounts = httpx.get(
        f"{server.url}/dp-budget/api/accounts", params={"tenant": "acme"}, headers=headers
    ).json()
    assert accounts["total"] == 50
    states = {a["subject"]: a["state"] for a in accounts["accounts"]}
    # 3 releases, cap 2: WARNING; user-007's release in flight leaves no room for another of
    # the cheapest (z = 8) the scope has made: EXHAUSTED
    assert {subject for subject, state in states.items() if state != "WARNING"} == {"user-007"}
    assert states["user-007"] == "EXHAUSTED"
    everything = httpx.get(f"{server.url}/dp-budget/api/accounts", headers=headers).json()
    assert everything["total"] == 101
    schema = httpx.get(f"{server.url}/dp-budget/openapi.json", headers=headers).json()
    assert "/api/accounts" in schema["paths"]
    run_id = server.runs[0]["run_id"]
    links = httpx.get(
        f"{server.url}/api/v2/dags/example_dp_heatmap/dagRuns/{quote(run_id, safe='')}"
        "/taskInstances/release_heatmap/links",
        headers=headers,
    ).json()["extra_links"]
    url = links["DP budget release"]
    # The receipt names its own reservation only: the link opens that release's page.
    assert url.startswith(f"{server.url}/plugin/dp-budget/dp-budget/release?reservation=")
    framed = url.replace("/plugin/dp-budget", "", 1)  # the page the UI's iframe loads
    assert httpx.get(framed, headers=headers).status_code == 200


def test_the_task_link_opens_its_release_inside_the_airflow_ui(page, server):
    headers = {"Authorization": f"Bearer {server.token()}"}
    run_id = quote(server.runs[0]["run_id"], safe="")
    url = httpx.get(
        f"{server.url}/api/v2/dags/example_dp_heatmap/dagRuns/{run_id}"
        "/taskInstances/release_heatmap/links",
        headers=headers,
    ).json()["extra_links"]["DP budget release"]
    assert list(parse_qs(urlsplit(url).query)) == ["reservation"]
    log_in(page, server)
    page.goto(url)
    page.get_by_role("button", name="Browse").wait_for()  # Airflow's own navigation
    frame = page.frame_locator("iframe")
    frame.locator("table#release").wait_for()
    frame.locator("table#accounts tbody tr a").first.wait_for()  # to the class's account
    assert page.url == url  # the UI keeps the page in its address


def test_the_browser_without_a_session_gets_no_data(page, server):
    response = page.goto(f"{server.url}/dp-budget/accounts")
    assert response.status == 401
    assert page.locator("text=Sign-in required").is_visible()
    assert page.locator("table#accounts").count() == 0
    assert "user-000" not in page.content()


def test_accounts_page_in_the_airflow_ui(page, server, tmp_path):
    log_in(page, server)
    page.get_by_role("button", name="Browse").click()
    page.get_by_role("menuitem", name="DP Budget").click()
    # The plugin's page; the address may already follow the frame to its accounts page.
    page.wait_for_url(f"{server.url}/plugin/dp-budget**")
    frame = page.frame_locator("iframe")
    frame.locator("table#accounts tbody tr").first.wait_for()
    assert frame.locator("table#accounts tbody tr").count() == 50  # first page of 101
    assert frame.get_by_text("101 accounts, page 1 of 3").first.is_visible()
    screenshot(page, tmp_path, "ui-airflow.png")

    page.goto(
        f"{server.url}/dp-budget/accounts?subject=user-00*&sort=epsilon&order=desc",
        wait_until="networkidle",
    )
    rows = page.locator("table#accounts tbody tr")
    assert rows.count() == 20  # user-000..009 of acme and of globex
    assert rows.nth(19).locator("td").nth(0).inner_text() == "globex"
    assert rows.nth(19).locator("td").nth(9).inner_text() == "ok"  # after the eps held column
    first = rows.first.locator("td")
    assert first.nth(0).inner_text() == "acme"
    assert first.nth(9).inner_text() == "WARNING"
    assert "1 open" in page.locator("table#accounts").inner_text()  # the in-flight release
    screenshot(page, tmp_path, "ui-accounts.png")

    page.goto(f"{server.url}/dp-budget/accounts?tenant=globex", wait_until="networkidle")
    assert page.locator("table#accounts tbody tr").count() == 50  # 51 globex accounts
    assert page.locator("table#accounts tbody tr").first.locator("td").nth(1).inner_text() == XSS
    assert page.dialogs == []  # the tenant named like a script tag never ran


def test_spend_classes_inside_the_airflow_ui(page, server):
    """The three acme releases covered the same 50 subjects: one class of 49 and user-007,
    set apart by its release in flight; drill down to the members, then to one account."""
    log_in(page, server)
    page.goto(f"{server.url}/plugin/dp-budget/dp-budget/classes?tenant=acme")
    page.get_by_role("button", name="Browse").wait_for()  # inside Airflow's navigation
    frame = page.frame_locator("iframe")
    rows = frame.locator("table#classes tbody tr")
    rows.first.wait_for()
    assert rows.count() == 2
    assert rows.first.locator("td.subjects").inner_text() == "49 subjects"
    assert "WARNING" in rows.first.inner_text()
    assert rows.nth(1).locator("td.subjects").inner_text() == "1 subject"
    assert "user-007" in rows.nth(1).inner_text() and "EXHAUSTED" in rows.nth(1).inner_text()
    rows.first.locator("a.members").click()
    members = frame.locator("table#members tbody tr")
    members.first.wait_for()
    assert members.count() == 49
    assert "49 subjects" in frame.locator("#class-summary").inner_text()
    assert "user-007" not in frame.locator("table#members").inner_text()
    member = members.nth(1).locator("td a")
    subject = member.inner_text()
    member.click()
    frame.locator("svg#spend-chart").wait_for()
    assert subject in frame.locator("#account-key").inner_text()
    page.wait_for_url("**/plugin/dp-budget/dp-budget/account?*")  # the address follows
    assert page.dialogs == []


def test_account_page_shows_the_chart_history_and_audit(page, server, tmp_path):
    log_in(page, server)
    page.goto(
        f"{server.url}/dp-budget/accounts?tenant=acme&subject=user-007",
        wait_until="networkidle",
    )
    page.locator("table#accounts tbody tr td a").first.click()
    page.wait_for_url("**/dp-budget/account?*")
    chart = page.locator("svg#spend-chart")
    chart.wait_for()
    # As rendered: the warning label ends above the line's highest point, never on it.
    label = chart.locator("text.warn-label").bounding_box()
    line = chart.locator("path.spend").bounding_box()
    assert label["y"] + label["height"] <= line["y"]
    assert chart.locator("path.spend").count() == 1
    assert chart.locator("circle.dot").count() == 3  # three committed releases
    assert chart.locator("line.cap").count() == 1 and chart.locator("line.warn").count() == 1
    page.locator("#verification.ok").wait_for()  # fetched by the page after load
    assert "Verified: " in page.locator("#verification").inner_text()
    history = page.locator("table#history tbody tr")
    assert history.count() == 7  # 3 x (reserve, commit) + the open reservation
    assert "example_dp_heatmap/release_heatmap/manual__" in history.nth(1).inner_text()
    assert "GDPR Art. 25" in page.locator("table#policy").inner_text()
    reservations = page.locator("table#reservations").inner_text()
    assert "open" in reservations and "in_flight" in reservations
    screenshot(page, tmp_path, "ui-account.png", full_page=True)
    assert page.dialogs == []

    task = history.nth(1).locator("td a").first  # the attempt links to its task instance
    run_id = task.inner_text().split("/")[2]
    assert task.get_attribute("href").startswith("/dags/example_dp_heatmap/runs/manual__")
    task.click()
    page.wait_for_url("**/dags/example_dp_heatmap/runs/**/tasks/release_heatmap")
    page.get_by_text(run_id).first.wait_for()


def test_an_admin_sets_a_policy_through_the_form_inside_the_airflow_ui(page, server):
    """Inside the Airflow UI the frame's cookie authenticates the form, its CSRF token
    proves it is ours; the history names the Airflow user."""
    log_in(page, server)
    page.goto(f"{server.url}/plugin/dp-budget/dp-budget/policies")
    page.get_by_role("button", name="Browse").wait_for()  # inside Airflow's navigation
    frame = page.frame_locator("iframe")
    form = frame.locator("form#set-policy")
    form.locator("input[name=tenant]").fill("initech")
    form.locator("input[name=query_type]").fill("count")
    form.locator("input[name=cap_epsilon]").fill("1.75")
    form.locator("input[name=compliance_clause]").fill("DPA s.4 <i>minimisation</i>")
    form.locator("button[type=submit]").click()
    notice = frame.locator("#notice")
    notice.wait_for()
    assert notice.inner_text() == "policy initech/count created by admin (Airflow UI): cap 1.75"
    row = frame.locator("table#policies tbody tr", has_text="initech")
    assert "DPA s.4 <i>minimisation</i>" in row.inner_text()  # text, not markup
    headers = {"Authorization": f"Bearer {server.token()}"}
    policies = httpx.get(f"{server.url}/dp-budget/api/policies", headers=headers).json()
    assert {"tenant": "initech", "query_type": "count", "cap_epsilon": 1.75}.items() <= next(
        p for p in policies if p["tenant"] == "initech"
    ).items()
    assert page.dialogs == []
