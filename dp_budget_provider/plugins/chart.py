"""Geometry of the account page's chart: cumulative epsilon over time as an SVG step line.

The cap and warning labels sit in a legend band above the plot area, never beside their
lines: the spend line can run anywhere inside the plot (along the warning line too), and
only outside it can a label never cover it. A closing (reset, rescope away) is drawn as a
ring at the level reached, since it refunds nothing (see ``account_history.spend_series``).

Only numbers come out of here (coordinates, tick values, time labels derived from the
ledger's fixed-format timestamps); the template escapes everything it prints anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timezone

from dp_budget_provider.ledger.views.account_history import CLOSINGS, SeriesPoint
from dp_budget_provider.ledger.windows.policy import Policy

WIDTH, HEIGHT = 760, 300
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 36, 40
LEGEND_Y = 18  # the legend's baseline: its text (14 px) ends above TOP, outside the plot
SWATCH = 24  # length of a legend entry's line sample; its label starts 6 units after it


@dataclass(frozen=True)
class Tick:
    position: float
    label: str


@dataclass(frozen=True)
class Dot:
    x: float
    y: float
    seq: int
    at: str
    action: str
    epsilon: float
    closing: bool  # a reset or rescope away: ends the account, refunds nothing


@dataclass(frozen=True)
class LegendEntry:
    """A line sample from ``x`` to ``x + SWATCH`` and its label after it, baseline ``y``."""

    x: float
    label_x: float
    y: int


@dataclass(frozen=True)
class Chart:
    """Everything the template draws, in SVG user units."""

    width: int
    height: int
    left: int
    right: float
    top: int
    bottom: float
    path: str
    dots: list[Dot]
    cap_y: float
    warn_y: float
    cap: float
    warn: float
    cap_legend: LegendEntry
    warn_legend: LegendEntry
    y_ticks: list[Tick]
    x_ticks: list[Tick]


def _moment(stamp: str) -> datetime:
    moment = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def _nice_step(span: float, count: int = 5) -> float:
    raw = span / count
    magnitude = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 2.5, 5, 10):
        if raw <= factor * magnitude:
            return factor * magnitude
    return 10 * magnitude


def _time_label(moment: datetime, span_seconds: float) -> str:
    if span_seconds < 10:
        return moment.strftime("%H:%M:%S.%f")[:-3]
    if span_seconds < 120:
        return moment.strftime("%H:%M:%S")
    if span_seconds < 2 * 86400:
        return moment.strftime("%m-%d %H:%M")
    return moment.strftime("%Y-%m-%d")


def _legend_entry(x: float) -> LegendEntry:
    """Fixed slots (left edge, middle) rather than measured text: the cap's label is at
    most ~20 characters, far less than half the plot's width."""
    return LegendEntry(x, x + SWATCH + 6, LEGEND_Y)


def build_chart(points: list[SeriesPoint], policy: Policy) -> Chart | None:
    """The chart of ``points`` against ``policy``'s cap and warning line; None if empty."""
    if not points:
        return None
    right, bottom = WIDTH - RIGHT, HEIGHT - BOTTOM
    cap = policy.cap_epsilon
    warn = policy.warn_fraction * cap
    top_value = max(cap, max(p.epsilon for p in points)) * 1.08
    moments = [_moment(p.at) for p in points]
    start, end = moments[0], moments[-1]
    span = (end - start).total_seconds()

    def x_of(moment: datetime) -> float:
        if span <= 0:  # everything in one instant: a vertical step at the left edge
            return float(LEFT)
        return round(LEFT + (right - LEFT) * (moment - start).total_seconds() / span, 2)

    def y_of(value: float) -> float:
        return round(bottom - (bottom - TOP) * value / top_value, 2)

    dots = [
        Dot(x_of(m), y_of(p.epsilon), p.seq, p.at, p.action, p.epsilon, p.action in CLOSINGS)
        for m, p in zip(moments, points, strict=True)
    ]
    segments = [f"M{dots[0].x},{y_of(0.0)} L{dots[0].x},{dots[0].y}"]
    for previous, dot in zip(dots, dots[1:], strict=False):
        segments.append(f"L{dot.x},{previous.y} L{dot.x},{dot.y}")
    step = _nice_step(top_value)
    y_ticks = [Tick(y_of(i * step), f"{i * step:g}") for i in range(int(top_value / step) + 1)]
    x_ticks = [Tick(x_of(start), _time_label(start, span))]
    if end > start:
        middle = start + (end - start) / 2
        x_ticks += [
            Tick(x_of(middle), _time_label(middle, span)),
            Tick(x_of(end), _time_label(end, span)),
        ]
    return Chart(
        width=WIDTH,
        height=HEIGHT,
        left=LEFT,
        right=right,
        top=TOP,
        bottom=bottom,
        path=" ".join(segments),
        dots=dots,
        cap_y=y_of(cap),
        warn_y=y_of(warn),
        cap=cap,
        warn=warn,
        cap_legend=_legend_entry(LEFT),
        warn_legend=_legend_entry(LEFT + (right - LEFT) / 2),
        y_ticks=y_ticks,
        x_ticks=x_ticks,
    )
