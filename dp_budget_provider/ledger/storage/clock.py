"""The ledger's clock: every part of the ledger reads the time here, so tests move it once.

Every decision the ledger takes with a moment (a window has begun, is past its grace
period and may be sealed, a lease has run out, what a history entry is stamped) is taken
inside a write transaction with :func:`now`. On PostgreSQL that is the database server's
clock, read once at the start of the transaction (:mod:`database`), so that every worker
decides with the same clock and none can move a window, a seal or a lease by having (or
being given) a wrong one; the transaction also refuses a worker whose own clock disagrees
with the server's by more than the ledger's bound (:class:`ClockSkew`), as a sign of a
machine that cannot be trusted with time. SQLite is embedded: the database runs on the
worker's machine, so this process's clock is the database's.

Tests move the ledger's time, on both backends, by patching :func:`now`; they give a
worker a wrong clock (and nothing else) by patching :func:`process_now`. Nothing else
moves either: no setting, flag or argument of the ledger does.

Stamps are fixed-width UTC text that sorts as time does (the year zero-padded too, which
``strftime`` does not do below the year 1000).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import datetime, timedelta, timezone

from dp_budget_provider.ledger.errors import ClockSkew

# How far a worker's clock may be from the database server's before its writes are refused.
DEFAULT_CLOCK_SKEW = timedelta(seconds=5)
# A bound beyond an hour would accept a machine whose clock is plainly wrong.
MAX_CLOCK_SKEW = timedelta(hours=1)

# The server's time read by the write transaction under way in this thread (or task).
_server_time: ContextVar[datetime | None] = ContextVar("dp_budget_server_time", default=None)


def process_now() -> datetime:
    """This process's clock (the worker's), in UTC."""
    return datetime.now(timezone.utc)


def now() -> datetime:
    """The ledger's time: in a PostgreSQL write transaction the server's clock as that
    transaction read it; elsewhere this process's clock."""
    server = _server_time.get()
    return process_now() if server is None else server


@contextlib.contextmanager
def server_time(
    server: datetime, before: datetime, after: datetime, bound: timedelta
) -> Iterator[None]:
    """Within the block, :func:`now` is ``server``: the database server's clock, read
    between this process's readings ``before`` and ``after``.

    Refuses (:class:`ClockSkew`) when this process's clock disagrees with the server's by
    more than ``bound``: ``server`` must lie between the two readings, widened by the
    bound (the readings bracket the round trip and any lock wait it held, so a slow
    answer is never taken for a wrong clock).
    """
    if not before - bound <= server <= after + bound:
        raise ClockSkew(
            f"this worker's clock reads {stamp(after)} but the ledger database's server "
            f"reads {stamp(server)}: they disagree by more than {bound.total_seconds():g} s, "
            "so this worker may not write to the ledger (nothing was written); set its "
            "clock right (NTP)"
        )
    token = _server_time.set(server.astimezone(timezone.utc))
    try:
        yield
    finally:
        _server_time.reset(token)


def check_clock_skew(bound: object) -> timedelta:
    """``bound`` if it is a timedelta above zero and at most :data:`MAX_CLOCK_SKEW`."""
    if not isinstance(bound, timedelta) or not timedelta(0) < bound <= MAX_CLOCK_SKEW:
        raise ValueError(
            f"clock_skew must be a timedelta above 0 and at most {MAX_CLOCK_SKEW}, got {bound!r}"
        )
    return bound


def stamp(moment: datetime) -> str:
    """``moment`` as the ledger stores times: ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` in UTC."""
    utc = moment.astimezone(timezone.utc)
    return f"{utc.year:04d}" + utc.strftime("-%m-%dT%H:%M:%S.%fZ")
