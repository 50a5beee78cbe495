"""Reservation leases: how the ledger tells a running attempt from an abandoned one.

Every reservation holds a lease (``dp_reservations.lease_expires_at``) that ``reserve``
sets to the ledger's clock plus the ledger's lease length. The attempt renews it while it
works on the data (:class:`LeaseKeeper`, a daemon thread renewing every third of the
lease); ``reap`` charges every open reservation whose lease has run out. A worker that
dies (killed, its machine lost) stops renewing, so its reservation is charged within one
lease plus the interval between two reaps, not after a fixed day.

A lease only decides *when* an open reservation is charged, never *whether*: reaping
charges (it never refunds), and an attempt that outlives its lease and then commits is
charged nothing more. So renewals are not history entries (the charge is the fact that
matters, and the reap entry names the lease that ran out), and a lease that cannot be
renewed is fail-closed: the task goes on with a warning in its log and its reservation
is charged by the next reap.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from types import TracebackType
from typing import Protocol

from dp_budget_provider.ledger.errors import ReservationStateError

DEFAULT_LEASE = timedelta(seconds=300)
# At least a second (renewals every third of it); at most a day, the default hard bound
# ``reap_after`` on a reservation's age, beyond which a lease would mean nothing.
MIN_LEASE = timedelta(seconds=1)
MAX_LEASE = timedelta(days=1)

_log = logging.getLogger(__name__)


class WarningLog(Protocol):
    """Where failed renewals are told: a logger (the task's own, in Airflow)."""

    def warning(self, msg: str, *args: object) -> object: ...


def check_lease(lease: object, name: str = "lease") -> timedelta:
    """``lease`` if it is a timedelta between :data:`MIN_LEASE` and :data:`MAX_LEASE`."""
    if not isinstance(lease, timedelta) or not MIN_LEASE <= lease <= MAX_LEASE:
        raise ValueError(
            f"{name} must be a timedelta from {MIN_LEASE} to {MAX_LEASE}, got {lease!r}"
        )
    return lease


def lease_of_seconds(text: str, name: str) -> timedelta:
    """A lease given in seconds as text (a configuration option named ``name``)."""
    try:
        seconds = float(text)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not MIN_LEASE.total_seconds() <= seconds <= MAX_LEASE.total_seconds():
        raise ValueError(
            f"{name} must be a number of seconds from {MIN_LEASE.total_seconds():g} to "
            f"{MAX_LEASE.total_seconds():g}, got {text!r}"
        )
    return timedelta(seconds=seconds)


class LeaseKeeper:
    """Renews one reservation's lease every third of ``lease`` while its block runs.

    ``renew`` is the ledger's renewal of that reservation. The thread is a daemon and
    stops when the block ends, however it ends; leaving the block never raises, so the
    block's own exception (a failed query) is what the caller sees. A failed renewal is
    logged as a warning and tried again at the next beat; a reservation that is no
    longer open (reaped meanwhile: charged) ends the renewals. ``failures`` counts the
    failed renewals and ``closed`` holds the refusal that ended them, if one did.
    """

    def __init__(
        self,
        renew: Callable[[], datetime],
        lease: timedelta,
        reservation_id: str,
        log: WarningLog | None = None,
    ) -> None:
        self._renew = renew
        self.interval = check_lease(lease).total_seconds() / 3
        self.reservation_id = reservation_id
        self._log: WarningLog = log or _log
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"dp-budget-lease-{reservation_id}", daemon=True
        )
        self.renewals = 0
        self.failures = 0
        self.closed: ReservationStateError | None = None

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop.set()
        # A renewal under way finishes first (it holds the reservation's row lock, which
        # the commit after this block needs anyway); one stuck longer than a beat is
        # left to die with the process.
        self._thread.join(self.interval)
        if self._thread.is_alive():
            self._log.warning(
                "the lease renewal of reservation %s did not finish within %.3g s",
                self.reservation_id,
                self.interval,
            )

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._renew()
            except ReservationStateError as refusal:
                self.closed = refusal
                self._log.warning(
                    "the lease of reservation %s is no longer renewed: %s",
                    self.reservation_id,
                    refusal,
                )
                return
            except Exception as error:  # noqa: BLE001 - logged; the next beat tries again
                self.failures += 1
                self._log.warning(
                    "could not renew the lease of reservation %s (%s: %s); if it runs out, "
                    "the next reap charges the reservation",
                    self.reservation_id,
                    type(error).__name__,
                    error,
                )
            else:
                self.renewals += 1
