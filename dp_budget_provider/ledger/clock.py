"""The ledger's clock: every room reads the time here, so tests can move it in one place.

Stamps are fixed-width UTC text that sorts as time does (the year zero-padded too, which
``strftime`` does not do below the year 1000).
"""

from __future__ import annotations

from datetime import datetime, timezone


def now() -> datetime:
    """The ledger's time: this process's clock, in UTC."""
    return datetime.now(timezone.utc)


def stamp(moment: datetime) -> str:
    """``moment`` as the ledger stores times: ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` in UTC."""
    utc = moment.astimezone(timezone.utc)
    return f"{utc.year:04d}" + utc.strftime("-%m-%dT%H:%M:%S.%fZ")
