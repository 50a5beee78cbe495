"""The ledger's exceptions. Every failure is fail-closed: no release happens."""

from __future__ import annotations


class LedgerError(RuntimeError):
    """Base class: the ledger refused or could not complete an operation."""


class BudgetExhausted(LedgerError):
    """A release would push an account past its cap; nothing was written."""

    def __init__(self, key: object, would_be_epsilon: float, cap_epsilon: float) -> None:
        self.key = key
        self.would_be_epsilon = would_be_epsilon
        self.cap_epsilon = cap_epsilon
        super().__init__(
            f"budget exhausted for {key}: the release would bring eps to "
            f"{would_be_epsilon:.6g}, above the cap {cap_epsilon:.6g}"
        )


class LedgerConfigMismatch(LedgerError):
    """The ledger was opened with a delta, order grid, conversion or cap it was not created with."""


class LedgerSchemaError(LedgerError):
    """The database's schema is missing, newer or older than this package expects."""


class ClockSkew(LedgerError):
    """This worker's clock disagrees with the ledger database server's by more than the
    ledger allows: its writes are refused (the server's clock decides, but a machine with
    a wrong clock is not trusted to write)."""


class LedgerUnavailable(LedgerError):
    """The database could not be reached or the connection broke mid-transaction."""


class LedgerCorrupt(LedgerError):
    """Stored state failed validation (NaN curve, broken hash chain, ...)."""


class ReservationStateError(LedgerError):
    """A reservation was used in a state that does not allow it (e.g. commit after release)."""


class AttemptReused(ReservationStateError):
    """An attempt that has already reserved asked to reserve again: an attempt releases at
    most once, whatever became of its reservation (open, committed, released, reaped)."""

    def __init__(self, attempt_id: str, reservation_id: str, state: str) -> None:
        self.attempt_id = attempt_id
        self.reservation_id = reservation_id
        self.state = state
        super().__init__(
            f"attempt {attempt_id!r} has already reserved ({reservation_id}, {state}): an "
            "attempt releases at most once, and a new try of a task needs a new attempt id"
        )


class ReservationClosed(ReservationStateError):
    """A lease renewal named a reservation that is no longer open (committed, released, or
    reaped: charged); nothing was changed."""


class WindowSealed(LedgerError):
    """A release or correction named a window (or a re-scoped key) that can never be charged
    again: its accounts were dropped, so charging it would start from zero."""


class WindowClosed(LedgerError):
    """A new release named a window that ended more than its policy's grace period ago.

    Late and backfilled runs may still charge a window within its grace period; after it,
    only what already holds a reservation there (commits, renewals, reaps) and the
    administrator's corrections reach it, so the reset can seal it instead of waiting
    behind releases that keep arriving."""


class LedgerQuarantined(LedgerError):
    """A verify found the ledger inconsistent: nothing is released until an operator clears
    the quarantine (an audited act naming the reason)."""


class WindowBusy(LedgerError):
    """A closed window still holds open reservations: it is reset once they are
    committed, released or reaped (resetting it now would drop the spend they hold)."""


class AdminAuthorityError(LedgerError):
    """An administrator's act (a policy, a clearing, a new chain key) without the ledger's
    administrator key, or with another one; nothing was written."""
