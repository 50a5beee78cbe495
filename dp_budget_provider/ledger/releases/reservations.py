"""Reservations: reserve, commit, release, renew, reap, one-step spend.

Every release is a two-phase spend: ``reserve`` (the prospective check, counting
committed spend *and* every open reservation, made in the same transaction as the
reservation under row locks taken in key order), then ``commit`` once the release
happened, or ``release`` if the data was never touched; ``reap`` charges what dead
workers left open once its lease has run out. Nothing is ever silently refunded.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import math
import secrets
import uuid
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import Connection, or_, select, update

from dp_budget_provider.accounting import EpsilonBound, Mechanism
from dp_budget_provider.accounting import validation as check
from dp_budget_provider.ledger.accounts import classes
from dp_budget_provider.ledger.accounts.classes import Cohort, CohortKeys
from dp_budget_provider.ledger.accounts.covered import Covered, covered, mechanism_of, one_key
from dp_budget_provider.ledger.accounts.holdings import Holdings
from dp_budget_provider.ledger.accounts.keys import (
    LedgerKey,
    canonical_part,
    free_text,
    sorted_subject_ids,
)
from dp_budget_provider.ledger.accounts.pricing import Pricing
from dp_budget_provider.ledger.accounts.spend import Pending, Spend
from dp_budget_provider.ledger.errors import (
    AttemptReused,
    BudgetExhausted,
    LedgerQuarantined,
    ReservationClosed,
    ReservationStateError,
)
from dp_budget_provider.ledger.records import (
    COMMITTED,
    OPEN,
    REAPED,
    RELEASED,
    Reservation,
    SpendReceipt,
)
from dp_budget_provider.ledger.releases import filtering, reservation_rows, stored
from dp_budget_provider.ledger.releases.identity import ReleaseIdentity
from dp_budget_provider.ledger.releases.lease import LeaseKeeper, WarningLog
from dp_budget_provider.ledger.releases.locks import ChargeLocks, charged_once_more_if_stale
from dp_budget_provider.ledger.releases.stored import Keep, StoredAnswer
from dp_budget_provider.ledger.storage import clock, history, pipeline, statements
from dp_budget_provider.ledger.storage.entries import (
    CommitEntry,
    ReapEntry,
    ReleaseEntry,
    ReserveEntry,
    ReuseEntry,
)
from dp_budget_provider.ledger.storage.journal import Journal
from dp_budget_provider.ledger.storage.schema import Reservation as ReservationRow
from dp_budget_provider.ledger.storage.transactions import LedgerDatabase
from dp_budget_provider.ledger.windows import maintenance
from dp_budget_provider.ledger.windows.policies import Policies
from dp_budget_provider.ledger.windows.policy_store import PolicyStore, policy_lookup

_R = TypeVar("_R")


class Reservations:
    """Reservations: reserve, commit, release, renew, reap, one-step spend."""

    def __init__(
        self,
        database: LedgerDatabase,
        journal: Journal,
        pricing: Pricing,
        locks: ChargeLocks,
        holdings: Holdings,
        policies: Policies,
        store: PolicyStore,
        lease: timedelta,
    ) -> None:
        self._database = database
        self._journal = journal
        self._pricing = pricing
        self._locks = locks
        self._holdings = holdings
        self._policies = policies
        self._store = store
        self._lease = lease
        self._filter = filtering.Filter(pricing, locks, store)

    # ------------------------------------------------------------------ two-phase spend

    def reserve(
        self,
        keys: Covered,
        mechanism: Mechanism | Mapping[str, Any],
        count: int = 1,
        attempt: str | None = None,
    ) -> Reservation:
        """Check and hold the cost of a release on every key, all or nothing.

        Raises :class:`BudgetExhausted` (writing nothing) when any key would pass its
        cap counting its committed spend and all open reservations. ``attempt`` names
        the task attempt: an attempt reserves once, ever. Reserving again with an attempt
        that already reserved (open, committed, released or reaped) is refused with
        :class:`ReservationStateError`, so one attempt never authorises two releases.
        The returned reservation carries a secret token: only its holder can commit,
        release or renew it. Its lease runs for :attr:`lease` from now: keep it alive
        with :meth:`keep_alive` (or :meth:`renew`) while the release works on the data.
        """
        ordered, cohorts = covered(keys)
        mechanism, count, attempt_id, cost = self._release(mechanism, count, attempt)
        if not cost.finite:  # beyond every cap (a noise multiplier of 1e-200): no row touched
            first = ordered[0] if ordered else cohorts[0]
            cap = self._policies.policy_for_scope(first.tenant, first.query_type).cap_epsilon
            raise BudgetExhausted(first, math.inf, cap)

        def reserved() -> Reservation:
            with self._database.pipelined() as pipe:
                return self._reserve(pipe, ordered, cohorts, mechanism, count, attempt_id, cost)

        return self._once(reserved, attempt_id)

    def reserve_admitting(
        self,
        keys: Covered,
        mechanism: Mechanism | Mapping[str, Any],
        count: int = 1,
        attempt: str | None = None,
    ) -> tuple[Reservation, frozenset[str]]:
        """Reserve the release on the subjects of its cohort that can afford it, leaving
        out the others (individual filtering: :mod:`filtering`); the reservation and the
        canonical ids left out.

        ``keys`` is one registered cohort in each of the release's windows. No subject's
        budget refuses it: a subject whose accounts at any scope that applies cannot take
        the cost is left out and charged nothing. It is refused as any release is for what
        is no subject's budget (a quarantine, a sealed window), and a ValueError when the
        release alone passes a cap on an account with nothing spent. When every subject
        is left out the reservation holds no account, and is committed all the same.
        """
        ordered, cohorts = covered(keys)
        filtering.filtered_cohort([*ordered, *cohorts])  # one cohort, or the ValueError
        mechanism, count, attempt_id, cost = self._release(mechanism, count, attempt)
        if not cost.finite:
            raise ValueError(
                "the release alone costs more than any cap: no subject could afford it"
            )

        def reserved() -> tuple[Reservation, frozenset[str]]:
            with self._database.pipelined() as pipe:
                moment = clock.now()
                admitted = self._filter.admitted(pipe, cohorts, cost, attempt_id, moment)
                reservation = self._reserve(
                    pipe, [], admitted.cohorts, mechanism, count, attempt_id, cost, moment=moment
                )
                return reservation, admitted.left_out

        return self._once(reserved, attempt_id)

    def _once(self, reserved: Callable[[], _R], attempt_id: str) -> _R:
        """``reserved()``, made once more if the policies changed under it; an attempt that
        has reserved before is refused (:class:`AttemptReused`)."""
        try:
            return charged_once_more_if_stale(reserved)
        except pipeline.UniqueViolation as error:
            # Decided by the stored fact, not by the driver's message: the attempt has a
            # reservation (another transaction's, committed before ours), or the
            # violation was something else and is raised as it is.
            with self._database.reading() as connection:
                existing = reservation_rows.by_attempt(connection, attempt_id)
            if existing is None:
                raise
            raise AttemptReused(attempt_id, existing.id, existing.state) from error

    def _release(
        self, mechanism: Mechanism | Mapping[str, Any], count: int, attempt: str | None
    ) -> tuple[Mechanism, int, str, Spend]:
        """Validate a release's arguments (before any database work) and price it."""
        mechanism = mechanism_of(mechanism)
        count = check.count("count", count)
        return mechanism, count, self._attempt(attempt), self._pricing.cost(mechanism, count)

    @staticmethod
    def _attempt(attempt: str | None) -> str:
        if attempt is None:
            return f"anonymous:{uuid.uuid4()}"
        if not isinstance(attempt, str) or not attempt.strip() or len(attempt) > 1024:
            raise ValueError(
                f"attempt must be a non-empty string of <= 1024 chars, got {attempt!r}"
            )
        return free_text("attempt", attempt)

    def _reserve(
        self,
        pipe: pipeline.Pipeline,
        keys: list[LedgerKey],
        cohorts: list[CohortKeys],
        mechanism: Mechanism,
        count: int,
        attempt_id: str,
        cost: Spend,
        *,
        moment: datetime | None = None,
    ) -> Reservation:
        """Lock, check and reserve ``cost`` on what ``keys`` and ``cohorts`` charge; with
        neither (a filtered release that left every subject out, its windows locked by
        the filter) a reservation holding no account."""
        moment = moment or clock.now()
        now = clock.stamp(moment)
        lease_expires_at = clock.stamp(moment + self._lease)
        if keys or cohorts:
            locked, policies, charge = self._locks.lock_chargeable(
                pipe, keys, moment, reserving=cost, cohorts=cohorts, wider=True, attempt=attempt_id
            )
        else:
            locked, policies, charge = {}, {}, classes.Charge(keys=[])
        accounts = charge.keys
        # The pending spend read back includes this cost but for its residual curve.
        residual = Spend(0.0, cost.residual, 0.0)
        # Accounts holding equal values share their Spend objects: convert each once.
        totals: dict[tuple[int, int], tuple[Spend, EpsilonBound]] = {}
        worst = 0.0
        policy_of = policy_lookup(policies)
        for key in accounts:
            held = locked[key]
            marker = (id(held.spend), id(held.pending))
            found = totals.get(marker)
            if found is None:
                total = held.spend.plus(held.pending.as_spend()).plus(residual)
                found = totals[marker] = (total, self._pricing.bounds([total])[0])
            policy = policy_of(key)
            checked = self._pricing.checked_epsilon(found[0], policy)
            if not policy.admits(checked):
                example = classes.example_subject(pipe.core(), key)
                raise BudgetExhausted(example, checked, policy.cap_epsilon)
            worst = max(worst, found[1].epsilon)
        if cost.residual is not None:
            self._locks.add_pending_residual(pipe, accounts, locked, cost.residual)
        reservation_id = str(uuid.uuid4())
        token = secrets.token_urlsafe(32)
        token_hash = token_digest(token)
        digest = history.keys_digest(accounts)
        spec = mechanism.to_spec()
        pipe.send(
            statements.INSERT_RESERVATION,
            {
                "id": reservation_id,
                "attempt_id": attempt_id,
                "token_hash": token_hash,
                "state": OPEN,
                "mechanism": history.canonical_json(spec),
                "count": count,
                "cost_rho": cost.rho,
                "cost_residual": cost.residual_json(),
                "cost_gaussian_mu2": cost.gaussian_mu2,
                "key_count": len(accounts),
                "keys_digest": digest,
                "prospective_epsilon": worst,
                "actor": self._journal.actor,
                "created_at": now,
                "lease_expires_at": lease_expires_at,
            },
        )
        if accounts:
            pipe.dialect.insert_reservation_keys(pipe, reservation_id, accounts)
        seq = self._journal.append_piped(
            pipe,
            ReserveEntry(
                attempt_id=attempt_id,
                mechanism=spec,
                count=count,
                cost=cost,
                key_count=len(accounts),
                keys_digest=digest,
                prospective_epsilon=worst,
                token_hash=token_hash,
                cohorts=charge.recorded(),
            ),
            at=now,
            keys=accounts,
            reservation_id=reservation_id,
        )
        charge.link(pipe, seq)
        return Reservation(
            id=reservation_id,
            attempt_id=attempt_id,
            keys=tuple(accounts),
            mechanism=mechanism,
            count=count,
            state=OPEN,
            prospective_epsilon=worst,
            created_at=now,
            token=token,
            lease_expires_at=lease_expires_at,
        )

    def _charge(
        self,
        connection: Connection,
        row: Any,
        *,
        state: str,
        reaped: tuple[str, str | None] | None = None,
        keep: Keep | None = None,
    ) -> list[SpendReceipt]:
        """Turn an open reservation into committed spend on each of its keys (general path):
        a commit, or with ``reaped`` (why, and the lease it held) a reap. ``keep``: the
        commit's answer, kept for re-runs of its release (:mod:`stored`)."""
        now = clock.stamp(clock.now())
        cost = Spend.from_columns(
            row.cost_rho, row.cost_residual, row.cost_gaussian_mu2, self._pricing.orders.size
        )
        # Read before the locks: they are held as briefly as possible.
        policies = self._store.read(connection)
        keys, accounts = self._locks.lock_reservation(connection, row.id)
        after = self._close_reservation(connection, keys, accounts, cost, now, charge=row.count)
        connection.execute(
            update(ReservationRow)
            .where(ReservationRow.id == row.id)
            .values(state=state, resolved_at=now)
        )
        stored = keep.store(connection, row.id, now) if keep is not None else None
        charged = {
            "attempt_id": row.attempt_id,
            "cost": cost,
            "count": row.count,
            "key_count": len(keys),
            "keys_digest": history.keys_digest(keys),
        }
        entry = (
            CommitEntry(**charged, stored=stored)
            if reaped is None
            else ReapEntry(**charged, reason=reaped[0], lease_expires_at=reaped[1])
        )
        self._journal.append(connection, entry, at=now, keys=keys, reservation_id=row.id)
        return self._pricing.receipts(keys, after, policies, [accounts[key].size for key in keys])

    def _close_reservation(
        self,
        connection: Connection,
        keys: list[LedgerKey],
        locked: Mapping[LedgerKey, statements.LockedAccount],
        cost: Spend,
        now: str,
        *,
        charge: int | None,
    ) -> list[Spend]:
        """Close one open reservation of ``cost`` on every locked account.

        The cost leaves the accounts' pending spend (exactly zero once nothing is open);
        with ``charge`` (its release count) it is added to their committed spend, as a
        commit or reap does, while a release adds nothing. Returns the committed spends
        in key order.
        """
        after = [locked[key].spend.plus(cost) if charge else locked[key].spend for key in keys]
        if cost.residual is None:
            statement = statements.close_accounts(
                gaussian=cost.gaussian_mu2 is not None, charge=bool(charge)
            )
            params = {
                "cost_rho": cost.rho,
                "cost_mu2": cost.gaussian_mu2,
                "count": charge or 0,
                "now": now,
            }
            for chunk in statements.chunks([locked[key].id for key in keys]):
                connection.execute(statement, {**params, "ids": list(chunk)})
            return after
        for key, spend in zip(keys, after, strict=True):
            held = locked[key]
            pending = Pending() if held.open_reservations <= 1 else held.pending.remove(cost)
            statements.store_spend(connection, held.id, spend, charge or 0, now, pending=pending)
        return after

    @staticmethod
    def _open_row(connection: Connection, reservation_id: str) -> Any:
        """The reservation row, locked for the rest of the transaction."""
        row = connection.execute(
            statements.reservation_for_update(), {"rid": reservation_id}
        ).one_or_none()
        if row is None:
            raise ReservationStateError(f"no reservation {reservation_id!r} in this ledger")
        return row

    def _owned_row(self, connection: Connection, reservation: Reservation, what: str) -> Any:
        """The reservation row, locked, if ``reservation`` is its holder's (token matches).

        Reservation ids and attempt ids are visible in the UI, XCom and the history, so
        neither proves that the caller is the attempt that reserved: only the token that
        ``reserve`` handed to that attempt does (the ledger keeps its digest only).
        """
        if (
            not isinstance(reservation, Reservation)
            or not isinstance(reservation.id, str)
            or not isinstance(reservation.token, str)
            or not (reservation.id + reservation.token).isprintable()
        ):
            raise ValueError(
                f"{what} takes the Reservation that reserve() returned, got {_shown(reservation)}"
            )
        row = self._open_row(connection, reservation.id)
        if row.token_hash is None or not hmac.compare_digest(
            row.token_hash, token_digest(reservation.token)
        ):
            raise ReservationStateError(
                f"reservation {row.id} belongs to attempt {row.attempt_id!r}; only the attempt "
                f"that reserved it may {what} it"
            )
        return row

    def commit(self, reservation: Reservation, keep: Keep | None = None) -> list[SpendReceipt]:
        """Charge a reservation (the release happened); a second commit charges nothing.

        Only the attempt that reserved may commit (see :meth:`_owned_row`). ``keep``: the
        release's answer, kept in the same transaction for re-runs of its identity
        (:mod:`stored`; a second commit keeps nothing).
        """
        with self._database.write() as connection:
            row = self._owned_row(connection, reservation, "commit")
            try:
                self._locks.refuse_if_quarantined(connection)
            except LedgerQuarantined as refusal:
                raise LedgerQuarantined(
                    f"reservation {row.id} is not committed and its release must not be "
                    f"published: {refusal}; the reservation stays open and is charged when "
                    "it is reaped"
                ) from None
            if row.state in (COMMITTED, REAPED):
                return self._holdings.receipts(
                    connection, reservation_rows.keys_of(connection, row.id)
                )
            if row.state != OPEN:
                raise ReservationStateError(
                    f"reservation {row.id} was {row.state}; it cannot be committed"
                )
            return self._charge(connection, row, state=COMMITTED, keep=keep)

    def reuse(self, identity: ReleaseIdentity, attempt: str) -> StoredAnswer | None:
        """The stored answer of ``identity`` for ``attempt``, proven against the history
        (:func:`stored.served`), with the reuse appended to the history; None (nothing
        written) when the identity has no stored answer. Charges nothing: the answer is
        already published. Refused in quarantine (:class:`LedgerQuarantined`), and when the
        stored answer does not prove (:class:`LedgerCorrupt`)."""
        attempt_id = self._attempt(attempt)
        with self._database.write() as connection:
            self._locks.refuse_if_quarantined(connection)
            answer = stored.served(connection, identity, self._journal.key)
            if answer is None:
                return None
            self._journal.append(
                connection,
                ReuseEntry(
                    attempt_id=attempt_id,
                    identity=answer.identity,
                    reservation=answer.reservation_id,
                    digest=answer.digest,
                ),
                at=clock.stamp(clock.now()),
            )
            return answer

    def release(self, reservation: Reservation, reason: str = "") -> None:
        """Drop a reservation whose release never touched the data (nothing is charged).

        Only the attempt that reserved may release, and only before it touched the data:
        anyone else holding an id could otherwise void the charge of a release that ran.
        """
        reason = free_text("reason", reason, limit=2000)
        with self._database.write() as connection:
            row = self._owned_row(connection, reservation, "release")
            if row.state == RELEASED:
                return
            if row.state != OPEN:
                raise ReservationStateError(
                    f"reservation {row.id} was {row.state}; it cannot be released"
                )
            keys, locked = self._locks.lock_reservation(connection, row.id)
            now = clock.stamp(clock.now())
            cost = Spend.from_columns(
                row.cost_rho, row.cost_residual, row.cost_gaussian_mu2, self._pricing.orders.size
            )
            self._close_reservation(connection, keys, locked, cost, now, charge=None)
            connection.execute(
                update(ReservationRow)
                .where(ReservationRow.id == row.id)
                .values(state=RELEASED, resolved_at=now)
            )
            self._journal.append(
                connection,
                ReleaseEntry(attempt_id=row.attempt_id, reason=reason),
                at=now,
                keys=keys,
                reservation_id=row.id,
            )

    def renew(self, reservation: Reservation) -> datetime:
        """Extend an open reservation's lease to :attr:`lease` from now; returns its end.

        Only the attempt that reserved may renew (the token, as for :meth:`commit`), and
        only an open reservation: a committed, released or reaped one is refused with
        :class:`ReservationClosed` and nothing changes. A renewal is no history entry: it
        changes no spend, and the charge a lease that runs out leads to is (see
        :mod:`lease`). Renewing works in quarantine too: it keeps a live attempt from
        being reaped, never lets it publish (its commit is refused).
        """
        with self._database.write() as connection:
            row = self._owned_row(connection, reservation, "renew")
            if row.state != OPEN:
                raise ReservationClosed(
                    f"reservation {row.id} was {row.state} at {row.resolved_at}; only an open "
                    "reservation's lease can be renewed"
                )
            expires = clock.now() + self._lease
            connection.execute(
                update(ReservationRow)
                .where(ReservationRow.id == row.id)
                .values(lease_expires_at=clock.stamp(expires))
            )
        return expires

    def keep_alive(
        self,
        reservation: Reservation,
        log: WarningLog | None = None,
    ) -> LeaseKeeper:
        """A context manager renewing ``reservation``'s lease every third of :attr:`lease`
        (a daemon thread) until its block ends: wrap the work on the data in it.

        A renewal that fails is a warning on ``log`` and the block goes on: if the lease
        runs out, the next reap charges the reservation, which is what its commit would
        have done (see :class:`~dp_budget_provider.ledger.releases.lease.LeaseKeeper`).
        """
        if not isinstance(reservation, Reservation) or not isinstance(reservation.id, str):
            raise ValueError(
                "keep_alive takes the Reservation that reserve() returned, got "
                f"{_shown(reservation)}"
            )
        return LeaseKeeper(lambda: self.renew(reservation), self._lease, reservation.id, log)

    def reap(self, older_than: timedelta | None = None, now: datetime | None = None) -> list[str]:
        """Charge every open reservation whose lease has run out (its attempt stopped
        renewing: the worker died), and with ``older_than`` every one open longer than
        that, renewed or not (a hard bound on how long budget is held).

        Such a reservation may have touched the data, so it is charged, never refunded;
        the history records why (the lease that ran out, or the age). ``now`` (default:
        the ledger's clock, which stamped the leases) is for tests and audits. Each
        reservation is decided again under its row lock, so one renewed meanwhile is
        left alone. Returns the reaped reservation ids, oldest first. Records the reap
        job's run (:mod:`maintenance`).
        """
        if older_than is not None and (
            not isinstance(older_than, timedelta) or older_than < timedelta(0)
        ):
            raise ValueError(
                f"older_than must be a non-negative timedelta, got {_shown(older_than)}"
            )
        if now is not None and (not isinstance(now, datetime) or now.utcoffset() is None):
            raise ValueError(f"now must be a timezone-aware datetime, got {_shown(now)}")
        with self._database.reading() as connection:  # the candidates, by this process's clock
            at, cutoff = _reap_moments(now or clock.now(), older_than)
            due = [ReservationRow.lease_expires_at.is_(None), ReservationRow.lease_expires_at <= at]
            if cutoff is not None:
                due.append(ReservationRow.created_at <= cutoff)
            stale = list(
                connection.execute(
                    select(ReservationRow.id)
                    .where(ReservationRow.state == OPEN, or_(*due))
                    .order_by(ReservationRow.created_at, ReservationRow.id)
                ).scalars()
            )
        reaped = []
        for reservation_id in stale:
            with self._database.write() as connection:  # each decided by the ledger's clock
                at, cutoff = _reap_moments(now or clock.now(), older_than)
                row = self._open_row(connection, reservation_id)
                lease = _lease_of(row)
                why = _reap_reason(row, lease, at, cutoff, older_than)
                if row.state != OPEN or why is None:
                    continue
                self._charge(connection, row, state=REAPED, reaped=(why, lease))
                reaped.append(row.id)
        maintenance.ran(self._database, maintenance.REAP, self._journal.actor)
        return reaped

    # ------------------------------------------------------------------ cohorts

    def cohort(self, subjects: Iterable[Any], tenant: str = "default") -> Cohort:
        """Register a release's subjects once and get a handle naming them by content.

        ``subjects`` is any collection of ids (see :func:`~.keys.subject_ids`). The same
        set of ids is the same cohort: registering it again stores nothing. Hand the
        handle on (``cohort.as_dict()`` through XCom) and charge
        ``cohort.in_window(query_type, window)``: the ids never travel or get hashed
        again, and a release over a cohort its window has seen costs one row per class.
        Registering charges nothing and writes no history entry: the history names a
        cohort (by digest) when a charge covers it.
        """
        ids = sorted_subject_ids(subjects)
        tenant = canonical_part("tenant", tenant)
        with self._database.pipelined() as pipe:
            _, digest = classes.register(pipe, tenant, ids, clock.stamp(clock.now()))
        return Cohort(tenant, digest, len(ids))

    # ------------------------------------------------------------------ one-step spend

    def spend(
        self,
        key: LedgerKey,
        mechanism: Mechanism | Mapping[str, Any],
        count: int = 1,
        attempt: str | None = None,
    ) -> SpendReceipt:
        """Reserve and commit one release on one key (what a task does, in one call); the
        receipt of the key's own account (not of its totals at wider scopes)."""
        receipts = self.commit(self.reserve(one_key(key), mechanism, count, attempt))
        return next(r for r in receipts if r.key.query_type == key.query_type)


def _reap_moments(moment: datetime, older_than: timedelta | None) -> tuple[str, str | None]:
    """The stamps a reap at ``moment`` compares with: the moment, and the creation time
    before which a reservation is older than ``older_than`` (None: no such bound, or one
    reaching before the first moment)."""
    cutoff = None
    if older_than is not None:
        with contextlib.suppress(OverflowError):  # before the first moment: none so old
            cutoff = clock.stamp(moment - older_than)
    return clock.stamp(moment), cutoff


def _reap_reason(
    row: Any, lease: str | None, at: str, cutoff: str | None, older_than: timedelta | None
) -> str | None:
    """Why an open reservation with ``lease`` is due for reaping at ``at``, None if it is
    not (any more)."""
    if lease is None:
        return f"open since {row.created_at}, without a lease"
    if lease <= at:
        return f"open since {row.created_at}, its lease ran out at {lease}"
    if cutoff is not None and row.created_at <= cutoff:
        return f"open since {row.created_at}, older than {older_than}"
    return None


def _shown(value: object) -> str:
    """A caller's value as a one-line error may quote it: its repr, or only its type when
    that is not one short printable line."""
    text = repr(value)
    return text if text.isprintable() and len(text) <= 200 else type(value).__name__


def token_digest(token: str) -> str:
    """What the ledger stores of a reservation's token (never the token itself)."""
    return hashlib.sha256(token.encode()).hexdigest()


def _lease_of(row: Any) -> str | None:
    """A reservation row's lease, None when it holds none: NULL, or a value that is not
    text (a BLOB written into the SQLite column by hand). The column is no fact verify
    checks, so a value of it must never stop a reap (and every reservation after it)."""
    return row.lease_expires_at if isinstance(row.lease_expires_at, str) else None
