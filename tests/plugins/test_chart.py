"""The account chart as emitted: a reset ends the line level at its history row, and the
cap and warning labels never cover the line (checked on the parsed SVG)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ElementTree
from datetime import timedelta

import pytest

from dp_budget_provider.accounting import LaplaceMechanism
from dp_budget_provider.ledger import Policy, key_for
from dp_budget_provider.ledger.windows.calendar import window_bounds
from dp_budget_provider.ledger.windows.policy import DEFAULT_GRACE
from tests.ledger_time import ledger_time_at, ledger_time_in
from tests.plugins.conftest import WINDOW

# The tests seed their ledgers in this process: the ledger's clock is pinned inside WINDOW.
LEDGER_WINDOWS = (WINDOW,)
CLOSED_WINDOW = "2026-w30"  # ended in July 2026, long past its grace period
# globex's count runs may arrive later than acme's: a grace period of their own.
LATE_GRACE = timedelta(days=14)
FONT = 14  # the page's font size, which the SVG text inherits (user units: 1 px each)
SVG_NS = "{http://www.w3.org/2000/svg}"


def chart_of(html: str) -> ElementTree.Element:
    """The page's chart, parsed as XML (the template emits well-formed SVG)."""
    match = re.search(r'<svg id="spend-chart".*?</svg>', html, re.S)
    assert match, "no chart on the page"
    svg = match.group(0).replace("<svg ", f'<svg xmlns="{SVG_NS[1:-1]}" ', 1)
    return ElementTree.fromstring(svg)


def polyline(chart: ElementTree.Element) -> list[tuple[float, float]]:
    (path,) = chart.iter(f"{SVG_NS}path")
    return [(float(x), float(y)) for x, y in re.findall(r"[ML]([\d.]+),([\d.]+)", path.get("d"))]


def label_box(chart: ElementTree.Element, css_class: str) -> tuple[float, float, float, float]:
    """(left, top, right, bottom) of a start-anchored label, generously: every glyph as wide
    as 0.7 em, ascent a full em above the baseline, descent a third of one below it."""
    (text,) = [t for t in chart.iter(f"{SVG_NS}text") if t.get("class") == css_class]
    assert text.get("text-anchor") in (None, "start")
    x, y = float(text.get("x")), float(text.get("y"))
    return x, y - FONT, x + 0.7 * FONT * len(text.text.strip()), y + FONT / 3


def crosses(box: tuple[float, float, float, float], a, b) -> bool:
    """Whether the axis-aligned segment a-b (the step line has no other kind) meets box."""
    left, top, right, bottom = box
    x0, x1 = sorted((a[0], b[0]))
    y0, y1 = sorted((a[1], b[1]))
    return x0 <= right and x1 >= left and y0 <= bottom and y1 >= top


def reset_key(seeded, monkeypatch):
    """A key charged twice in a week, then reset once the week is past its grace period; a
    later reset of the same week for another scope (a late globex run, within the longer
    grace period of its own) does not concern it."""
    ledger = seeded.ledger
    ledger.set_policy(Policy(3.0, tenant="globex", query_type="count", grace=LATE_GRACE))
    end = window_bounds(CLOSED_WINDOW)[1]
    ledger_time_in(monkeypatch, CLOSED_WINDOW)
    key = key_for("user-reset", "count", CLOSED_WINDOW, tenant="acme")
    for run in range(2):
        ledger.spend(key, LaplaceMechanism(0.4), attempt=f"counts/count/late{run}/-1/1")
    ledger_time_at(monkeypatch, end + DEFAULT_GRACE + timedelta(hours=1))
    assert ledger.reset(CLOSED_WINDOW) == 1
    late = key_for("user-late", "count", CLOSED_WINDOW, tenant="globex")
    ledger.spend(late, LaplaceMechanism(0.4), attempt="counts/count/late2/-1/1")
    ledger_time_at(monkeypatch, end + LATE_GRACE + timedelta(hours=1))
    assert ledger.reset(CLOSED_WINDOW) == 1
    return key


def test_across_a_reset_the_series_stays_level_at_the_reset_row(client, seeded, monkeypatch):
    key = reset_key(seeded, monkeypatch)
    series = client.get("/api/account", params=key.as_dict()).json()["series"]
    history = client.get("/api/account/history", params={**key.as_dict(), "order": "oldest"})
    entries = history.json()["entries"]
    resets = [e for e in entries if e["action"] == "reset"]
    assert len(resets) == 1 and resets[0]["note"] == f"window {CLOSED_WINDOW} reset"
    points = series["points"]
    assert [p["action"] for p in points] == ["commit", "commit", "reset"]
    assert points[-1]["seq"] == resets[0]["seq"]  # the chart's reset is the table's row
    assert points[-1]["epsilon"] == points[-2]["epsilon"] > points[0]["epsilon"] > 0  # no refund
    charged = {e["seq"] for e in entries if e["action"] == "commit"}
    assert {p["seq"] for p in points} == charged | {resets[0]["seq"]}


def test_the_page_rings_the_reset_and_never_draws_a_drop(client, seeded, monkeypatch):
    key = reset_key(seeded, monkeypatch)
    html = client.get("/account", params=key.as_dict()).text
    chart = chart_of(html)
    line = polyline(chart)
    heights = [y for _, y in line[1:]]
    assert heights == sorted(heights, reverse=True)  # SVG y grows downwards: never falls
    (ring,) = [c for c in chart.iter(f"{SVG_NS}circle") if c.get("class") == "closing"]
    assert (float(ring.get("cx")), float(ring.get("cy"))) == line[-1]
    seq = client.get("/api/account", params=key.as_dict()).json()["series"]["points"][-1]["seq"]
    assert f"#{seq} reset" in ring.find(f"{SVG_NS}title").text
    assert re.search(rf"The account ended at #{seq} \(reset", html)


@pytest.mark.parametrize("which", ["exhausted", "near_warning", "xss"])
def test_the_cap_and_warning_labels_never_cover_the_line(client, seeded, which):
    key = {"exhausted": seeded.exhausted, "near_warning": seeded.heatmap[5], "xss": seeded.xss}
    chart = chart_of(client.get("/account", params=key[which].as_dict()).text)
    line = polyline(chart)
    (y_axis,) = [
        axis
        for axis in chart.iter(f"{SVG_NS}line")
        if axis.get("class") == "axis" and axis.get("x1") == axis.get("x2")
    ]
    for css_class in ("cap-label", "warn-label"):
        box = label_box(chart, css_class)
        assert not any(crosses(box, a, b) for a, b in zip(line, line[1:], strict=False))
        assert box[3] <= float(y_axis.get("y1"))  # above the plot area, where no line runs


def test_a_rescope_away_stays_level_at_its_row_in_the_old_keys_history(client, seeded, monkeypatch):
    old = key_for("user-moved", "snapshot", "2026-w31", tenant="acme")
    new = key_for("user-moved", "trajectory", "2026-w31", tenant="acme")
    ledger_time_in(monkeypatch, old.window)
    for run in range(2):
        seeded.ledger.spend(old, LaplaceMechanism(0.3), attempt=f"snap/snap/r{run}/-1/1")
    seeded.ledger.rescope(old, new, reason="reclassified")
    points = client.get("/api/account", params=old.as_dict()).json()["series"]["points"]
    history = client.get("/api/account/history", params=old.as_dict()).json()["entries"]
    assert [p["action"] for p in points] == ["commit", "commit", "rescope-away"]
    assert points[-1]["epsilon"] == points[-2]["epsilon"]
    assert history[0]["action"] == "rescope" and history[0]["seq"] == points[-1]["seq"]
