"""The persistent privacy budget ledger: a facade over collaborators with one job each.

Every release is a two-phase spend: ``reserve`` (the prospective check, counting
committed spend *and* every open reservation, made in the same transaction as the
reservation under row locks taken in key order), then ``commit`` once the release
happened, or ``release`` if the data was never touched. A refused release writes
nothing. Commits are idempotent per attempt id. A reservation's lease is renewed by its
attempt while it runs (:mod:`~dp_budget_provider.ledger.releases.lease`); reservations
abandoned by dead workers stay counted until ``reap`` charges them, once their lease has
run out; nothing is ever silently refunded.

:class:`PrivacyBudgetLedger` opens the database and builds its collaborators, each with
its own state and a small interface (docs/architecture.md):

- :class:`~.releases.reservations.Reservations`: reserve, commit, release, renew, reap;
- :class:`~.releases.budget_checks.BudgetChecks`: would a release fit (no writes);
- :class:`~.views.reading.Reading`: receipts, accounts, history, open reservations;
- :class:`~.windows.changes.WindowChanges`: windows, reset, rescope, correct;
- :class:`~.windows.policies.Policies`: the caps as set and read;
- :class:`~.audit.auditing.Auditor`: verify, checkpoints, quarantine, keys.

Each public method hands the call to one of them, once.
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import socket
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import numpy as np
from sqlalchemy import Connection

from dp_budget_provider.accounting import DEFAULT_ORDERS, Conversion
from dp_budget_provider.accounting.conversion import check_conversion
from dp_budget_provider.accounting.orders import validate_orders
from dp_budget_provider.ledger.accounts.holdings import Holdings
from dp_budget_provider.ledger.accounts.keys import plain_text
from dp_budget_provider.ledger.accounts.pricing import Pricing
from dp_budget_provider.ledger.audit.auditing import Auditor
from dp_budget_provider.ledger.audit.authority import AdminKey, AdminPublicKey
from dp_budget_provider.ledger.opening import NewLedger, open_ledger
from dp_budget_provider.ledger.releases.budget_checks import BudgetChecks
from dp_budget_provider.ledger.releases.lease import DEFAULT_LEASE, check_lease
from dp_budget_provider.ledger.releases.locks import ChargeLocks
from dp_budget_provider.ledger.releases.reservations import Reservations
from dp_budget_provider.ledger.storage import clock, history
from dp_budget_provider.ledger.storage.journal import Journal
from dp_budget_provider.ledger.storage.transactions import LedgerDatabase
from dp_budget_provider.ledger.views.reading import Reading
from dp_budget_provider.ledger.windows.calendar import WindowCalendar
from dp_budget_provider.ledger.windows.changes import WindowChanges
from dp_budget_provider.ledger.windows.policies import Policies
from dp_budget_provider.ledger.windows.policy import BudgetCap
from dp_budget_provider.ledger.windows.policy_store import PolicyStore

Method = TypeVar("Method", bound=Callable[..., Any])


def _handed_to(collaborator: str, method: Method) -> Method:
    """A facade method: the call goes to the same-named method of one collaborator.

    It carries that method's name, docstring and signature (``help`` and ``inspect`` show
    them), so the facade documents nothing twice.
    """
    name = method.__name__

    @functools.wraps(method)
    def handed(ledger: object, /, *args: Any, **kwargs: Any) -> Any:
        return getattr(getattr(ledger, collaborator), name)(*args, **kwargs)

    return handed  # type: ignore[return-value]


class PrivacyBudgetLedger:
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
    makes or renews stays safe from ``reap`` without a renewal
    (:mod:`~dp_budget_provider.ledger.releases.lease`).
    """

    def __init__(
        self,
        cap: BudgetCap | None = None,
        url: str | None = None,
        orders: Sequence[float] | np.ndarray = DEFAULT_ORDERS,
        conversion: Conversion = "improved",
        *,
        actor: str | None = None,
        if_new: BudgetCap | None = None,
        calendar: WindowCalendar | None = None,
        chain_key: str | bytes | None = None,
        lease: timedelta = DEFAULT_LEASE,
        admin: AdminKey | None = None,
        admin_public_key: str | AdminPublicKey | None = None,
        clock_skew: timedelta = clock.DEFAULT_CLOCK_SKEW,
    ) -> None:
        for name, value in (("cap", cap), ("if_new", if_new)):
            if value is not None and not isinstance(value, BudgetCap):
                raise ValueError(f"{name} must be a BudgetCap, got {value!r}")
        grid = validate_orders(orders)
        conversion = check_conversion(conversion)
        self._lease = check_lease(lease)
        skew = clock.check_clock_skew(clock_skew)
        actor = _default_actor() if actor is None else plain_text("actor", actor)
        key = history.ChainKey(chain_key)
        if admin is not None and not isinstance(admin, AdminKey):
            raise ValueError(f"admin must be an AdminKey, got {type(admin).__name__}")
        self._database = database = LedgerDatabase(url, skew)
        store = PolicyStore(database.reading)
        new = NewLedger(
            grid,
            conversion,
            calendar or WindowCalendar(),
            actor,
            key,
            admin,
            _pin(admin_public_key),
        )
        try:
            settings = open_ledger(
                database.reading, database.migrating, skew, store, new, cap, if_new
            )
        except BaseException:
            database.close()
            raise
        journal = Journal(key, settings.chains, actor)
        self._pricing = pricing = Pricing(grid, settings.delta, conversion)
        locks = ChargeLocks(grid.size, store)
        holdings = Holdings(pricing, store)
        self._policies = Policies(database, journal, store, pricing)
        self._reservations = Reservations(
            database, journal, pricing, locks, holdings, self._policies, store, self._lease
        )
        self._budget_checks = BudgetChecks(database, pricing, locks, self._policies, store)
        self._reading = Reading(database, pricing, holdings, store, self)
        self._windows = WindowChanges(database, journal, pricing, locks, self._policies, store)
        self._auditor = Auditor(database, journal, pricing, store)
        self._journal = journal

    # ------------------------------------------------------------------ the ledger itself

    @property
    def delta(self) -> float:
        """The ledger's fixed delta."""
        return self._pricing.delta

    @property
    def orders(self) -> np.ndarray:
        """The ledger's fixed grid of Rényi orders."""
        return self._pricing.orders

    @property
    def conversion(self) -> Conversion:
        """The RDP to (eps, delta) conversion the ledger reports with."""
        return self._pricing.conversion

    @property
    def pricing(self) -> Pricing:
        """How the ledger prices releases and counts spend against a cap (its grid, delta
        and conversion, fixed for its life)."""
        return self._pricing

    @property
    def url(self) -> str:
        """The database URL without password."""
        return self._database.url

    @property
    def lease(self) -> timedelta:
        """How long a reservation made or renewed here is safe from ``reap`` unrenewed."""
        return self._lease

    @property
    def actor(self) -> str:
        """Who this ledger's history entries name (``user@host`` unless given)."""
        return self._journal.actor

    def reading(self) -> contextlib.AbstractContextManager[Connection]:
        """A read-only transaction on the ledger's tables, for reports and the UI.

        The schema (``ledger.storage.schema``) is the contract; writes must go through
        this class's methods, which keep locks, pending spend and the history chain.
        """
        return self._database.reading()

    def close(self) -> None:
        """Release the database connections."""
        self._database.close()

    # ------------------------------------------------------------------ releases

    reserve = _handed_to("_reservations", Reservations.reserve)
    reserve_admitting = _handed_to("_reservations", Reservations.reserve_admitting)
    commit = _handed_to("_reservations", Reservations.commit)
    reuse = _handed_to("_reservations", Reservations.reuse)
    release = _handed_to("_reservations", Reservations.release)
    renew = _handed_to("_reservations", Reservations.renew)
    keep_alive = _handed_to("_reservations", Reservations.keep_alive)
    reap = _handed_to("_reservations", Reservations.reap)
    cohort = _handed_to("_reservations", Reservations.cohort)
    spend = _handed_to("_reservations", Reservations.spend)

    # ------------------------------------------------------------------ budget checks

    budget_check = _handed_to("_budget_checks", BudgetChecks.budget_check)
    would_exceed = _handed_to("_budget_checks", BudgetChecks.would_exceed)
    fits_an_empty_account = _handed_to("_budget_checks", BudgetChecks.fits_an_empty_account)
    epsilon_alone = _handed_to("_budget_checks", BudgetChecks.epsilon_alone)
    checked_alone = _handed_to("_budget_checks", BudgetChecks.checked_alone)
    prospective_accountants = _handed_to("_budget_checks", BudgetChecks.prospective_accountants)
    prospective_accountant = _handed_to("_budget_checks", BudgetChecks.prospective_accountant)
    prospective_epsilon = _handed_to("_budget_checks", BudgetChecks.prospective_epsilon)

    # ------------------------------------------------------------------ reading

    account_of = _handed_to("_reading", Reading.account_of)
    subject_of = _handed_to("_reading", Reading.subject_of)
    epsilon_of = _handed_to("_reading", Reading.epsilon_of)
    remaining = _handed_to("_reading", Reading.remaining)
    receipt = _handed_to("_reading", Reading.receipt)
    accounts = _handed_to("_reading", Reading.accounts)
    history = _handed_to("_reading", Reading.history)
    open_reservations = _handed_to("_reading", Reading.open_reservations)

    # ------------------------------------------------------------------ windows and policies

    windows_for = _handed_to("_windows", WindowChanges.windows_for)
    reset = _handed_to("_windows", WindowChanges.reset)
    reset_closed = _handed_to("_windows", WindowChanges.reset_closed)
    rescope = _handed_to("_windows", WindowChanges.rescope)
    correct = _handed_to("_windows", WindowChanges.correct)
    set_policy = _handed_to("_policies", Policies.set_policy)
    policies = _handed_to("_policies", Policies.policies)
    policy_for = _handed_to("_policies", Policies.policy_for)
    policy_for_scope = _handed_to("_policies", Policies.policy_for_scope)
    policy_for_release = _handed_to("_policies", Policies.policy_for_release)

    # ------------------------------------------------------------------ audit

    verify = _handed_to("_auditor", Auditor.verify)
    checkpoint = _handed_to("_auditor", Auditor.checkpoint)
    maintenance = _handed_to("_auditor", Auditor.maintenance)
    quarantine_status = _handed_to("_auditor", Auditor.quarantine_status)
    quarantine = _handed_to("_auditor", Auditor.quarantine)
    clear_quarantine = _handed_to("_auditor", Auditor.clear_quarantine)
    record_admin_key = _handed_to("_auditor", Auditor.record_admin_key)
    adopt_chain_key = _handed_to("_auditor", Auditor.adopt_chain_key)

    @property
    def chain_key(self) -> history.ChainKey:
        """The key the history is linked with (unkeyed without one): checkpoints use it."""
        return self._auditor.chain_key

    @property
    def admin_public_key(self) -> AdminPublicKey | None:
        """The administrator key this ledger honours (None: it has none yet)."""
        return self._auditor.admin_public_key


def _default_actor() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _pin(key: str | AdminPublicKey | None) -> AdminPublicKey | None:
    """The administrator key an opener requires (its text, as a connection holds it)."""
    return key if key is None or isinstance(key, AdminPublicKey) else AdminPublicKey(key)
