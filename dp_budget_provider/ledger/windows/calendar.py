"""Budget windows: which epoch a moment belongs to, and when an epoch is closed.

A window label describes its own bounds ("2026-w28", "2026-07", "2026-07-14",
"2026-07-14t00:00:00z+259200s", and a horizon of 52 ISO weeks "2026-w27+52"), so the
ledger can prove a window is closed before it drops its accounts, whatever policy
produced the label. Windows belong to the ledger: a release is charged to the windows
its data interval overlaps under its scope's calendar
(:meth:`WindowCalendar.windows_overlapping`), and a label that is not the calendar's own
form for its period (:meth:`WindowCalendar.is_canonical`) is refused, so one period of
data can never be charged under two names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Literal

CalendarKind = Literal["iso_week", "month", "day", "fixed"]
CALENDAR_KINDS: tuple[CalendarKind, ...] = ("iso_week", "month", "day", "fixed")
UTC = timezone.utc
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# The end of a window that would end after the last moment datetime can hold.
NEVER = datetime.max.replace(tzinfo=UTC)
# The longest fixed window: what a timedelta holds, in whole days.
MAX_FIXED_LENGTH_SECONDS = timedelta.max.days * 86400
# A data interval may span at most this many windows (a year of days, with room).
MAX_WINDOWS_PER_INTERVAL = 1000
_FORMS = {
    "iso_week": "an ISO week such as 2026-w49",
    "month": "a month such as 2026-12",
    "day": "a day such as 2026-12-01",
}

_ISO_WEEK = re.compile(r"^(\d{4})-w(\d{2})$")
_MONTH = re.compile(r"^(\d{4})-(\d{2})$")
_DAY = re.compile(r"^(\d{4})-(\d{2})-(\d{2})$")
_FIXED = re.compile(r"^(\d{4})-(\d{2})-(\d{2})t(\d{2}):(\d{2}):(\d{2})z\+(\d+)s$")
# A span of windows: the first window's label, "+", how many windows ("2026-w27+52").
_SPAN = re.compile(r"^(.+)\+(\d+)$")
# The Monday of ISO week 1970-w01: week indexes count from it.
_FIRST_MONDAY = datetime(1969, 12, 29, tzinfo=UTC)


def _utc(moment: datetime) -> datetime:
    if not isinstance(moment, datetime) or moment.tzinfo is None:
        raise ValueError(f"moment must be a timezone-aware datetime, got {moment!r}")
    try:
        return moment.astimezone(UTC)
    except OverflowError:  # 0001-01-01 at +14:00 is before the first moment in UTC
        raise ValueError(f"moment {moment!r} is outside the range of datetime in UTC") from None


def _month_start(year: int, month: int) -> datetime:
    return datetime(year, month, 1, tzinfo=UTC)


def _next_month(start: datetime) -> datetime:
    return _month_start(start.year + start.month // 12, start.month % 12 + 1)


@dataclass(frozen=True)
class WindowCalendar:
    """How time is cut into budget windows: ISO weeks, calendar months, days, or fixed lengths.

    ``span`` > 1 makes each period ``span`` consecutive windows of that kind, counted from
    the kind's first window since 1970 (ISO week 1970-w01, January 1970, 1970-01-01, or
    the fixed window starting then): the horizon of a cap across windows. Its periods
    are made of whole windows, so each window lies in exactly one, and twelve months
    from January are a calendar year.
    """

    kind: CalendarKind = "iso_week"
    length_seconds: int | None = None
    span: int = 1

    def __post_init__(self) -> None:
        span = self.span
        if (
            isinstance(span, bool)
            or not isinstance(span, int)
            or not (1 <= span <= MAX_WINDOWS_PER_INTERVAL)
        ):
            raise ValueError(
                f"a calendar's span is a number of windows in [1, {MAX_WINDOWS_PER_INTERVAL}], "
                f"got {span!r}"
            )
        if self.kind not in CALENDAR_KINDS:
            raise ValueError(f"calendar kind must be one of {CALENDAR_KINDS}, got {self.kind!r}")
        if self.kind == "fixed":
            length = self.length_seconds
            if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
                raise ValueError(f"a fixed calendar needs length_seconds > 0, got {length!r}")
            if length > MAX_FIXED_LENGTH_SECONDS:
                raise ValueError(
                    f"a fixed calendar's length_seconds is at most {MAX_FIXED_LENGTH_SECONDS} "
                    f"(what a timedelta holds), got {length!r}"
                )
        elif self.length_seconds is not None:
            raise ValueError(f"length_seconds is only for fixed calendars, not {self.kind!r}")

    @property
    def shortest_window(self) -> timedelta:
        """The shortest window this calendar produces (for the minimum-length policy)."""
        if self.kind == "fixed":
            return timedelta(seconds=self.length_seconds or 0) * self.span
        one = {"iso_week": timedelta(days=7), "month": timedelta(days=28)}.get(
            self.kind, timedelta(days=1)
        )
        return one * self.span

    @property
    def label(self) -> str:
        """The calendar as people read it: ``iso_week``, ``fixed (3600s)``,
        ``iso_week, 52 per period`` (:func:`calendar_label`)."""
        return calendar_label(self.kind, self.length_seconds, self.span)

    @property
    def windows(self) -> WindowCalendar:
        """The calendar of the windows a period of this one is made of (itself at span 1)."""
        return WindowCalendar(self.kind, self.length_seconds) if self.span > 1 else self

    def window_of(self, moment: datetime) -> str:
        """The label of the window containing ``moment``."""
        if self.span == 1:
            return self._one_window_of(moment)
        base = self.windows
        first = _start_of(
            self.kind, self.length_seconds, _index_of(base, moment) // self.span * self.span
        )
        return f"{base._one_window_of(first)}+{self.span}"

    def _one_window_of(self, moment: datetime) -> str:
        moment = _utc(moment)
        if self.kind == "iso_week":
            year, week, _ = moment.isocalendar()
            return f"{year:04d}-w{week:02d}"
        if self.kind == "month":
            return f"{moment.year:04d}-{moment.month:02d}"
        if self.kind == "day":
            return f"{moment.year:04d}-{moment.month:02d}-{moment.day:02d}"
        length = self.length_seconds or 0
        index = _whole_seconds(moment) // length
        start = _EPOCH + timedelta(seconds=index * length)
        return f"{start:%Y-%m-%d}t{start:%H:%M:%S}z+{length}s"

    def next_window_start(self, moment: datetime) -> datetime:
        """When the window after the one containing ``moment`` opens."""
        return window_bounds(self.window_of(moment))[1]

    def windows_overlapping(self, start: datetime, end: datetime) -> list[str]:
        """Every window the half-open data interval [start, end) overlaps, in time order.

        A release reads the data of its interval, so it is charged to each of these
        windows: a weekly interval from Sunday to Sunday reads a day of one ISO week and
        six of the next. An empty interval (start == end) is the moment ``start``.
        """
        start, end = _utc(start), _utc(end)
        if end < start:
            raise ValueError(f"data interval ends ({end}) before it starts ({start})")
        labels = [self.window_of(start)]
        while True:
            following = window_bounds(labels[-1])[1]
            if following >= end or following == NEVER:
                return labels
            if len(labels) >= MAX_WINDOWS_PER_INTERVAL:
                raise ValueError(
                    f"data interval {start} to {end} spans more than "
                    f"{MAX_WINDOWS_PER_INTERVAL} {self.kind} windows"
                )
            labels.append(self.window_of(following))

    def is_canonical(self, label: str) -> bool:
        """True when ``label`` is exactly this calendar's name for a period it produces."""
        try:
            start, _ = window_bounds(label)
        except ValueError:
            return False
        return self.window_of(start) == label

    @property
    def expected_form(self) -> str:
        """How this calendar writes a window, for error messages."""
        if self.span > 1:
            example = self.window_of(datetime(2026, 12, 1, tzinfo=UTC))
            return (
                f"{self.span} consecutive windows of {self.windows.expected_form}, counted "
                f"from the first since 1970, named by the first: such as {example}"
            )
        if self.kind == "fixed":
            return (
                f"a {self.length_seconds}-second window starting at a multiple of "
                f"{self.length_seconds} s since 1970-01-01, such as "
                f"{self.window_of(datetime(2026, 12, 1, tzinfo=UTC))}"
            )
        return _FORMS[self.kind]

    def to_spec(self) -> dict[str, object]:
        """JSON form stored with the policy (``span`` only when it is not 1, so a policy
        written before spans existed reads and signs as it did)."""
        spec: dict[str, object] = {"kind": self.kind, "length_seconds": self.length_seconds}
        if self.span > 1:
            spec["span"] = self.span
        return spec


def calendar_label(kind: str, length_seconds: int | None, span: int | None = 1) -> str:
    """A calendar as people read it, from its parts (a policy's record holds them)."""
    text = kind + (f" ({length_seconds}s)" if length_seconds else "")
    return text + (f", {span} per period" if span and span > 1 else "")


def _index_of(calendar: WindowCalendar, moment: datetime) -> int:
    """Which window of ``calendar`` (span 1) ``moment`` lies in, counted from 1970's first."""
    moment = _utc(moment)
    if calendar.kind == "iso_week":
        return (moment - _FIRST_MONDAY).days // 7
    if calendar.kind == "month":
        return (moment.year - 1970) * 12 + moment.month - 1
    if calendar.kind == "day":
        return (moment - _EPOCH).days
    return _whole_seconds(moment) // (calendar.length_seconds or 1)


def _whole_seconds(moment: datetime) -> int:
    """Whole seconds since 1970 at ``moment``, rounded down (before 1970 too: a moment a
    fraction of a second before a window's start lies in the window before it)."""
    since = moment - _EPOCH
    return since.days * 86400 + since.seconds


def _start_of(kind: str, length_seconds: int | None, index: int) -> datetime:
    """When window ``index`` (see :func:`_index_of`) of a calendar kind starts; OverflowError
    past what a datetime holds."""
    if kind == "iso_week":
        return _FIRST_MONDAY + timedelta(days=7 * index)
    if kind == "month":
        year, month = divmod(index, 12)
        if not 1 <= 1970 + year <= 9999:
            raise OverflowError(f"month {index} since 1970 is outside the years datetime holds")
        return _month_start(1970 + year, month + 1)
    if kind == "day":
        return _EPOCH + timedelta(days=index)
    return _EPOCH + timedelta(seconds=index * (length_seconds or 1))


def _kind_of(label: str) -> tuple[CalendarKind, int | None]:
    """The calendar kind (and fixed length) of a one-window label."""
    if _ISO_WEEK.match(label):
        return "iso_week", None
    if _MONTH.match(label):
        return "month", None
    if _DAY.match(label):
        return "day", None
    if match := _FIXED.match(label):
        return "fixed", int(match[7])
    raise ValueError(label)


def display_window(label: str) -> str:
    """A window label as people read it: a fixed window's start in ISO 8601's own letters
    (``2026-12-03T01:12:00Z+60s``). Labels are stored casefolded like every key part, and
    input in either case is accepted; everything shown to people goes through here."""
    span = _SPAN.match(label)
    if span and not _FIXED.match(label):
        return f"{display_window(span[1])}+{span[2]}"
    return f"{label[:10]}T{label[11:19]}Z{label[20:]}" if _FIXED.match(label) else label


def window_bounds(label: str) -> tuple[datetime, datetime]:
    """[start, end) of a calendar window label; ValueError for labels that are not calendar ones.

    A window that would end past the year 9999 ends at :data:`NEVER`: it is never closed,
    and nothing that reads it overflows.
    """
    if not isinstance(label, str):
        raise ValueError(f"window must be a string, got {label!r}")
    try:
        start, end = _bounds(label)
    except (ValueError, OverflowError) as error:
        raise ValueError(f"window {label!r} is not a calendar window label") from error
    return start, end


def _bounds(label: str) -> tuple[datetime, datetime]:
    if (match := _SPAN.match(label)) and not _FIXED.match(label):
        first, span = match[1], int(match[2])
        if not 2 <= span <= MAX_WINDOWS_PER_INTERVAL or match[2] != str(span):
            raise ValueError(label)
        start, _ = _bounds(first)
        kind, length = _kind_of(first)
        try:
            end = _start_of(kind, length, _index_of(WindowCalendar(kind, length), start) + span)
        except OverflowError:
            end = NEVER
        return start, end
    if match := _ISO_WEEK.match(label):
        start = datetime.fromisocalendar(int(match[1]), int(match[2]), 1).replace(tzinfo=UTC)
        return start, _later(start, timedelta(days=7))
    if match := _MONTH.match(label):
        start = _month_start(int(match[1]), int(match[2]))
        return start, NEVER if start.year == 9999 and start.month == 12 else _next_month(start)
    if match := _DAY.match(label):
        start = datetime(int(match[1]), int(match[2]), int(match[3]), tzinfo=UTC)
        return start, _later(start, timedelta(days=1))
    if match := _FIXED.match(label):
        year, month, day, hour, minute, second, length = (int(part) for part in match.groups())
        start = datetime(year, month, day, hour, minute, second, tzinfo=UTC)
        return start, _later(start, timedelta(seconds=length))
    raise ValueError(label)


def _later(start: datetime, length: timedelta) -> datetime:
    try:
        return start + length
    except OverflowError:
        return NEVER


def is_closed(label: str, now: datetime, grace: timedelta = timedelta(0)) -> bool:
    """True only when ``label`` is a calendar window that ended ``grace`` or more before ``now``."""
    try:
        _, end = window_bounds(label)
    except ValueError:
        return False
    now = _utc(now)
    return end != NEVER and now - grace >= end
