"""The persistent privacy budget ledger.

Every release is a two-phase spend: ``reserve`` (the prospective check, counting
committed spend *and* every open reservation, made in the same transaction as the
reservation under row locks taken in key order), then ``commit`` once the release
happened, or ``release`` if the data was never touched. A refused release writes
nothing. Commits are idempotent per attempt id. A reservation's lease is renewed by its
attempt while it runs (:mod:`lease`); reservations abandoned by dead workers stay counted
until ``reap`` charges them, once their lease has run out; nothing is ever silently
refunded.
"""

from __future__ import annotations

from dp_budget_provider.ledger.audit.auditing import AuditRoom
from dp_budget_provider.ledger.releases.budget_checks import BudgetCheckRoom
from dp_budget_provider.ledger.releases.reservations import ReservationRoom
from dp_budget_provider.ledger.views.reading import ReadingRoom
from dp_budget_provider.ledger.windows.changes import WindowRoom


class PrivacyBudgetLedger(ReservationRoom, BudgetCheckRoom, ReadingRoom, WindowRoom, AuditRoom):
    """Cumulative privacy spend per (tenant, subject, query_type, window), with caps.

    ``url=None`` is a private in-memory SQLite ledger, ``sqlite:///path`` the embedded
    file, ``postgresql+psycopg2://...`` production. A new database is created with
    ``cap`` as its default policy and with the given delta, grid and conversion; an
    existing one must be opened with the same (``cap`` may be omitted to take what is
    stored), otherwise :class:`LedgerConfigMismatch`. ``if_new``'s default cap (and
    ``calendar``) only apply when the database is new: open what exists, else create with
    these; its delta must match an existing ledger's all the same.

    ``chain_key`` (at least 16 bytes, kept outside the ledger database) makes every
    history link an HMAC under it: a ledger created with a key can only be opened with
    it, and nobody who can only write the database can forge its history.

    ``lease`` (1 s to 1 day, default 5 minutes) is how long a reservation this ledger
    makes or renews stays safe from ``reap`` without a renewal (:mod:`lease`).
    """
