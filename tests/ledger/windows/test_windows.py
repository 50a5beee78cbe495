"""Window calendars: labels, bounds, closure."""

from datetime import datetime, timedelta, timezone

import pytest

from dp_budget_provider.ledger import WindowCalendar, is_closed, window_bounds
from dp_budget_provider.ledger.accounts.keys import canonical_part
from dp_budget_provider.ledger.windows.calendar import display_window
from dp_budget_provider.ledger.windows.policy import Policy

UTC = timezone.utc
MOMENT = datetime(2026, 7, 14, 15, 30, tzinfo=UTC)


@pytest.mark.parametrize(
    ("calendar", "label", "start", "end"),
    [
        (WindowCalendar("iso_week"), "2026-w29", datetime(2026, 7, 13), datetime(2026, 7, 20)),
        (WindowCalendar("month"), "2026-07", datetime(2026, 7, 1), datetime(2026, 8, 1)),
        (WindowCalendar("day"), "2026-07-14", datetime(2026, 7, 14), datetime(2026, 7, 15)),
        (
            WindowCalendar("fixed", 3 * 86400),
            "2026-07-12t00:00:00z+259200s",
            datetime(2026, 7, 12),
            datetime(2026, 7, 15),
        ),
    ],
)
def test_labels_and_bounds(calendar, label, start, end):
    assert calendar.window_of(MOMENT) == label
    assert window_bounds(label) == (start.replace(tzinfo=UTC), end.replace(tzinfo=UTC))
    assert calendar.next_window_start(MOMENT) == end.replace(tzinfo=UTC)
    assert not is_closed(label, MOMENT)
    assert not is_closed(label, end.replace(tzinfo=UTC) - timedelta(microseconds=1))
    assert is_closed(label, end.replace(tzinfo=UTC))


def test_iso_week_and_month_across_year_end():
    moment = datetime(2026, 12, 31, 23, 0, tzinfo=UTC)
    assert WindowCalendar("iso_week").window_of(moment) == "2026-w53"
    assert WindowCalendar("iso_week").next_window_start(moment) == datetime(2027, 1, 4, tzinfo=UTC)
    assert WindowCalendar("month").next_window_start(moment) == datetime(2027, 1, 1, tzinfo=UTC)


def test_non_utc_moments_are_converted():
    plus_two = timezone(timedelta(hours=2))
    assert (
        WindowCalendar("day").window_of(datetime(2026, 7, 15, 1, 0, tzinfo=plus_two))
        == "2026-07-14"
    )


def test_naive_datetimes_and_bad_calendars_are_refused():
    with pytest.raises(ValueError, match="timezone-aware"):
        WindowCalendar("day").window_of(datetime(2026, 7, 14))
    with pytest.raises(ValueError, match="calendar kind"):
        WindowCalendar("fortnight")
    with pytest.raises(ValueError, match="length_seconds"):
        WindowCalendar("fixed")
    with pytest.raises(ValueError, match="length_seconds"):
        WindowCalendar("day", 10)


def test_custom_labels_are_never_closed():
    assert not is_closed("q3-campaign", datetime(2100, 1, 1, tzinfo=UTC))
    with pytest.raises(ValueError, match="not a calendar window"):
        window_bounds("q3-campaign")


def test_policy_refuses_windows_shorter_than_its_minimum():
    with pytest.raises(ValueError, match="correlation horizon"):
        Policy(1.0, calendar=WindowCalendar("day"), min_window=timedelta(days=7))
    Policy(1.0, calendar=WindowCalendar("month"), min_window=timedelta(days=7))


def test_a_fixed_window_is_shown_with_iso_8601_letters_and_read_in_either_case():
    calendar = WindowCalendar("fixed", 60)
    stored = calendar.window_of(datetime(2026, 12, 3, 1, 12, 30, tzinfo=timezone.utc))
    assert stored == "2026-12-03t01:12:00z+60s"  # canonical: casefolded like every key part
    assert display_window(stored) == "2026-12-03T01:12:00Z+60s"
    assert canonical_part("window", display_window(stored)) == stored
    for label in ("2026-w49", "2026-12", "2026-12-03"):
        assert display_window(label) == label
