"""The UI's HTML pages: content from the ledger, escaping, pagination, the chart."""

from __future__ import annotations

import re
from datetime import timedelta
from html.parser import HTMLParser

import pytest

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import Policy, WindowCalendar, key_for
from tests.ledger_time import ledger_time_in
from tests.plugins.conftest import CLAUSE, WINDOW, XSS

# Over 20 s in all: scheduled before the light files (tests/conftest.py).
pytestmark = pytest.mark.heavy

# The tests seed their ledgers in this process: the ledger's clock is pinned inside WINDOW.
LEDGER_WINDOWS = (WINDOW,)


class Page(HTMLParser):
    """Tags, attributes and text of a page, parsed like a browser tokenises it."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)

    def all(self, tag: str) -> list[dict[str, str | None]]:
        return [attrs for name, attrs in self.tags if name == tag]

    @property
    def plain(self) -> str:
        return " ".join(" ".join(self.text).split())


def nonce_of(response) -> str:
    match = re.search(r"script-src 'nonce-([^']+)'", response.headers["content-security-policy"])
    assert match
    return match.group(1)


def assert_no_injected_markup(response) -> None:
    """Only our own (nonce-carrying) script and style elements; no markup from the data."""
    page = Page(response.text)
    nonce = nonce_of(response)
    assert all(attrs.get("nonce") == nonce for attrs in page.all("script"))
    assert all(attrs.get("nonce") == nonce for attrs in page.all("style"))
    assert len(page.all("script")) <= 1
    assert page.all("b") == []  # the compliance clause's <b> is text
    assert "<script>alert" not in response.text


def test_accounts_page_lists_the_ledger(client, seeded):
    response = client.get("/accounts", params={"per_page": 100})
    assert response.status_code == 200
    page = Page(response.text)
    rows = [attrs for attrs in page.all("tr")]
    assert len(rows) == 1 + 31  # header + every account
    text = page.plain
    for key in seeded.heatmap:
        assert key.subject in text
    assert "31 accounts" in text
    assert "EXHAUSTED" in text and "WARNING" in text and "1 open" in text
    account_links = [a["href"] for a in page.all("a") if a["href"].startswith("/account?")]
    assert "/account?tenant=acme&subject=user-000&query_type=heatmap&window=2026-w28" in (
        account_links
    )
    assert_no_injected_markup(response)


def test_the_script_subject_renders_as_text(client, seeded):
    response = client.get("/accounts", params={"tenant": "default"})
    page = Page(response.text)
    assert XSS in page.plain  # shown, as text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in response.text
    assert_no_injected_markup(response)
    detail = client.get("/account", params=seeded.xss.as_dict())
    assert XSS in Page(detail.text).plain
    assert_no_injected_markup(detail)


def test_reflected_filter_values_are_escaped(client):
    attack = '"><script>alert(2)</script>'
    response = client.get("/accounts", params={"subject": attack, "tenant": "<img src=x>"})
    assert response.status_code == 200
    page = Page(response.text)
    values = [attrs.get("value") for attrs in page.all("input")]
    assert attack in values and "<img src=x>" in values  # round-trips, as attribute text
    assert page.all("img") == []
    assert_no_injected_markup(response)
    bad = client.get("/accounts", params={"state": "<i>x</i>"})
    assert bad.status_code == 422 and Page(bad.text).all("i") == []


def test_accounts_page_pagination_and_sorting(client):
    first = Page(client.get("/accounts", params={"per_page": 25}).text)
    assert "page 1 of 2" in first.plain
    nexts = [a["href"] for a in first.all("a") if a.get("rel") == "next"]
    assert nexts and "page=2" in nexts[0]
    second = Page(client.get(nexts[0]).text)
    assert "page 2 of 2" in second.plain
    assert len(second.all("tr")) == 1 + 6
    by_epsilon = Page(client.get("/accounts", params={"sort": "epsilon", "order": "desc"}).text)
    first_subject = next(
        a for a in by_epsilon.all("a") if (a.get("href") or "").startswith("/account?")
    )
    assert "subject=user-000" in first_subject["href"]
    headers = [a["href"] for a in by_epsilon.all("a") if "sort=epsilon" in (a.get("href") or "")]
    assert any("order=asc" in h for h in headers)  # clicking the sorted column flips it


def test_filter_by_state_on_the_page(client):
    page = Page(client.get("/accounts", params={"state": "EXHAUSTED"}).text)
    assert "1 accounts" in page.plain and "user-000" in page.plain
    assert "user-001" not in page.plain


def test_account_page(client, seeded):
    response = client.get("/account", params=seeded.exhausted.as_dict())
    assert response.status_code == 200
    page = Page(response.text)
    text = page.plain
    assert "EXHAUSTED" in text
    assert CLAUSE in text  # the policy's compliance clause, as text
    (svg,) = [attrs for attrs in page.all("svg") if attrs.get("id") == "spend-chart"]
    assert svg["viewbox"].startswith("0 0 ")
    (path,) = [attrs for attrs in page.all("path") if attrs.get("class") == "spend"]
    assert path["d"].startswith("M") and path["d"].count("L") == 1 + 2 * 3
    assert len([a for a in page.all("line") if a.get("class") == "cap"]) == 1
    assert len([a for a in page.all("line") if a.get("class") == "warn"]) == 1
    assert "cap ε = 2" in text and "warning at ε = 1.6" in text
    assert "4 charge event(s)" in text
    history_rows = len(page.all("tr")) - 1 - 5 - 1 - 3  # minus headers and policy/reservations
    assert history_rows == 7
    assert "example_dp_heatmap/release_heatmap/manual__2026-07-10/-1/1" in text
    assert "gaussian(noise_multiplier=4)" in text
    assert "release missed by the ledger" in text
    assert "Verifying the ledger" in text  # not verified yet: the page fetches it
    assert "1 subject at this spend" in text  # the correction split it off its class
    shared = Page(client.get("/account", params=seeded.heatmap[15].as_dict()).text).plain
    assert "10 subjects at this spend" in shared  # 10-19: the same two releases, one class


def test_account_page_shows_verification_once_known(client, seeded):
    assert client.get("/api/verification").json()["ok"]
    text = Page(client.get("/account", params=seeded.xss.as_dict()).text).plain
    assert "Verified: " in text
    assert "1 open" not in text and "open reservations 1" in text


def test_policies_page(client):
    response = client.get("/policies")
    text = Page(response.text).plain
    assert "acme heatmap 2" in text and CLAUSE in text
    assert_no_injected_markup(response)


def test_index_redirects_to_the_accounts(client):
    response = client.get("/", follow_redirects=False)
    assert response.status_code == 307 and response.headers["location"] == "/accounts"


def test_unauthenticated_page_offers_the_login_and_nothing_else(anonymous):
    response = anonymous.get("/accounts")
    assert response.status_code == 401
    page = Page(response.text)
    assert "Sign-in required" in page.plain
    assert any(a["href"].endswith("/login") for a in page.all("a") if "login" in a["href"])
    assert page.all("table") == []


def test_a_quarantined_ledger_says_so_on_every_page(client, seeded):
    assert "QUARANTINED" not in client.get("/accounts").text
    seeded.ledger.quarantine("test: an operator stopped releases")
    for path in ("/accounts", "/classes", "/policies"):
        text = Page(client.get(path).text).plain
        assert "QUARANTINED since" in text and "test: an operator stopped releases" in text
    assert "history keyed" in Page(client.get("/accounts").text).plain  # the key is held


def test_pages_show_what_open_reservations_hold(client, seeded):
    """The script-tag subject keeps one reservation open: its held eps and the budget left
    after it are on its page and in its row of the list."""
    status = next(a for a in seeded.ledger.accounts() if a.key == seeded.xss)
    assert status.held_epsilon > status.epsilon
    page = Page(client.get("/account", params=seeded.xss.as_dict()).text)
    assert f"{status.held_epsilon:.4f}" in page.plain
    assert f"{status.remaining_after_held:.4f}" in page.plain
    listing = client.get("/accounts", params={"tenant": "default"}).text
    assert f'<td class="num held">{status.held_epsilon:.4f}</td>' in listing
    assert f'<td class="num remaining">{status.remaining_after_held:.4f}</td>' in listing


# ---------------------------------------------------------------------- spend classes


def links(page: Page, prefix: str) -> list[str]:
    return [a["href"] for a in page.all("a") if (a.get("href") or "").startswith(prefix)]


def test_the_classes_page_shows_a_cohort_once_and_links_the_accounts_both_ways(client):
    accounts = Page(client.get("/accounts", params={"tenant": "acme", "state": "warning"}).text)
    (by_class,) = [a["href"] for a in accounts.all("a") if a.get("id") == "by-class"]
    assert by_class == "/classes?tenant=acme&state=warning&per_page=50"  # the filters kept
    response = client.get(by_class)
    assert response.status_code == 200
    page = Page(response.text)
    assert len(page.all("tr")) == 1 + 1 and "1 classes" in page.plain
    assert "9 subjects" in page.plain and "user-001" in page.plain and "WARNING" in page.plain
    (per_subject,) = [a["href"] for a in page.all("a") if a.get("id") == "per-subject"]
    assert per_subject == "/accounts?tenant=acme&state=warning&per_page=50"
    every = Page(client.get("/classes", params={"tenant": "acme"}).text)
    rows = [text for text in every.text if re.fullmatch(r"[\d,]+ subjects?", text)]
    assert rows == ["10 subjects", "10 subjects", "9 subjects", "1 subject"]
    assert len(links(every, "/classes/members?tenant=acme&query_type=heatmap&window=2026-w28")) == 4
    assert links(every, "/account?")[0].startswith("/account?tenant=acme&subject=user-010&")
    search = Page(client.get("/classes", params={"subject": "user-005"}).text)
    assert "1 classes" in search.plain and "1 subject" in search.plain  # the person's class
    assert "WARNING" in search.plain and "user-005" in search.plain
    bad = client.get("/classes", params={"state": "broke"})
    assert bad.status_code == 422 and "state must be one of" in Page(bad.text).plain


def test_class_members_page_lists_the_accounts_by_subject_with_paging(client, seeded):
    cohort = [key_for(f"member-{i:04d}", "survey", WINDOW, tenant="acme") for i in range(1234)]
    seeded.ledger.commit(seeded.ledger.reserve(cohort, GaussianMechanism(8.0)))
    classes = Page(client.get("/classes", params={"query_type": "survey"}).text)
    assert "1,234 subjects" in classes.plain
    (members_link,) = links(classes, "/classes/members?")
    first = Page(client.get(members_link).text)
    assert "1,234 subjects, page 1 of 25" in first.plain
    assert "acme / survey / 2026-w28" in first.plain
    member_links = links(first, "/account?")
    assert len(member_links) == 50 and "subject=member-0000" in member_links[0]
    next_page = {a["href"] for a in first.all("a") if a.get("rel") == "next"}
    assert len(next_page) == 1  # the pagers above and below the table agree
    second = Page(client.get(next_page.pop()).text)
    assert "page 2 of 25" in second.plain
    assert "subject=member-0050" in links(second, "/account?")[0]
    account = client.get(member_links[1])
    assert account.status_code == 200 and "member-0001" in Page(account.text).plain
    back = [a["href"] for a in first.all("a") if a["href"].startswith("/classes?")]
    assert back == ["/classes?tenant=acme&query_type=survey&window=2026-w28"]


def test_a_changed_class_is_a_clear_404(client, seeded):
    classes = Page(client.get("/classes", params={"state": "exhausted"}).text)
    (members_link,) = links(classes, "/classes/members?")
    assert client.get(members_link).status_code == 200
    # its one member moves on (a correction: the account is past its cap already)
    seeded.ledger.correct(seeded.exhausted, GaussianMechanism(40.0), reason="late release")
    response = client.get(members_link)
    assert response.status_code == 404
    page = Page(response.text)
    assert "Spend class not found" in page.plain and "list the classes again" in page.plain
    assert page.all("table") == []
    (back,) = [a["href"] for a in page.all("a") if a.get("id") == "back"]
    assert back == "/classes?tenant=acme&query_type=heatmap&window=2026-w28"
    assert "content-security-policy" in response.headers
    assert response.headers["cache-control"] == "no-store"
    bad = client.get("/classes/members", params={**seeded.xss.as_dict(), "class_id": "x" * 65})
    assert bad.status_code == 422


def test_class_pages_render_the_script_subject_as_text(client, seeded):
    response = client.get("/classes", params={"tenant": "default"})
    page = Page(response.text)
    assert XSS in page.plain and "1 subject" in page.plain
    assert_no_injected_markup(response)
    (members_link,) = links(page, "/classes/members?")
    members = client.get(members_link)
    assert XSS in Page(members.text).plain
    assert_no_injected_markup(members)
    attack = '"><script>alert(2)</script>'
    reflected = client.get("/classes", params={"subject": attack, "tenant": "<img src=x>"})
    assert attack in [attrs.get("value") for attrs in Page(reflected.text).all("input")]
    assert Page(reflected.text).all("img") == []
    assert_no_injected_markup(reflected)
    stale = client.get(
        "/classes/members",
        params={
            "tenant": attack,
            "query_type": "<img src=x>",
            "window": WINDOW,
            "class_id": attack,
        },
    )
    assert stale.status_code == 404 and Page(stale.text).all("img") == []
    assert_no_injected_markup(stale)


def test_a_reservation_shows_the_subjects_it_covers_not_its_accounts(client, seeded):
    """A release over 100,000 new subjects holds one account (their class): "keys 1" said
    nothing of what it holds. The page and the API count subjects."""
    cohort = seeded.ledger.cohort([f"member-{i:06d}" for i in range(100_000)], tenant="big")
    seeded.ledger.reserve(
        cohort.in_window("heatmap", WINDOW), GaussianMechanism(8.0), attempt="big/release/1/-1/1"
    )
    member = key_for("member-004242", "heatmap", WINDOW, tenant="big")
    (row,) = client.get("/api/account/reservations", params=member.as_dict()).json()["reservations"]
    assert (row["key_count"], row["subjects"]) == (1, 100_000)
    page = Page(client.get("/account", params=member.as_dict()).text)
    assert "subjects" in page.plain and "100,000" in page.plain


def test_pages_show_a_fixed_window_with_iso_8601_letters(client, seeded, monkeypatch):
    seeded.ledger.set_policy(
        Policy(
            3.0,
            query_type="stream",
            calendar=WindowCalendar("fixed", 60),
            min_window=timedelta(seconds=60),
        )
    )
    key = key_for("alice", "stream", "2026-12-03T01:12:00Z+60s")
    ledger_time_in(monkeypatch, key.window)  # charged while it was open
    seeded.ledger.spend(key, GaussianMechanism(4.0), attempt="stream/s/1/-1/1")
    for page in (
        client.get("/accounts", params={"query_type": "stream"}).text,
        client.get("/classes", params={"query_type": "stream"}).text,
        client.get("/account", params=key.as_dict()).text,
    ):
        assert "2026-12-03T01:12:00Z+60s" in page and "2026-12-03t01:12:00z" not in page


def test_overdue_maintenance_is_a_banner_on_every_page(client, seeded, monkeypatch):
    from dp_budget_provider.ledger.storage import clock

    banner = {"id": "maintenance", "class": "warning"}
    for path in ("/accounts", "/classes", "/policies"):
        assert banner not in Page(client.get(path).text).all("p")
    later = clock.now() + timedelta(days=3)
    monkeypatch.setattr(clock, "now", lambda: later)
    for path in ("/accounts", "/classes", "/policies"):
        page = Page(client.get(path).text)
        assert banner in page.all("p"), path
        assert "ledger maintenance overdue: reap has never run" in page.plain
        assert "reset has never run" in page.plain and "dp_budget_window_reset DAG" in page.plain
    seeded.ledger.reap()
    page = Page(client.get("/accounts").text)
    assert "reap has never run" not in page.plain and "reset has never run" in page.plain
