"""The ledger's tables (SQLAlchemy 2 typed declarative models).

Design notes:
* An account's committed spend is ``rho`` (the zCDP-linear part of its RDP curve),
  ``residual`` (the rest, JSON, NULL while zero) and ``gaussian_mu2`` (sum 1/z^2 while
  every release was Gaussian, NULL after), exactly :class:`AccountantState`.
* ``open_reservations`` counts the reservations in flight and ``pending_*`` sums their
  cost (:class:`~dp_budget_provider.ledger.accounts.spend.Pending`), both kept under the account's
  row lock, so the prospective check reads everything it needs from the one locked row.
* An account holds the spend of a *class* of subjects: the subjects of one (tenant,
  query type, window) that every release so far covered all together or not at all,
  so they have had the same releases and hold the same spend. ``dp_members`` names each
  subject's account, but for the classes whose members are exactly one cohort's
  (``cohort_id``: a cohort new to its window makes one, and none of its subjects is
  written again until a later cohort splits the class); ``size`` counts them.
  A release is charged to accounts, never to subjects one by one: a release over a
  cohort seen before touches one row per class.
  An account's ``subject`` is its label: ``Class-...`` for a class (never a canonical
  subject: those are case-folded), or the subject itself for an account made before
  classes existed (revision 0008), a class of one.
* A release's subjects are stored once, as a content-addressed *cohort*
  (``dp_cohorts``, ``dp_cohort_members``: the same set of ids is the same cohort), and
  ``dp_cohort_accounts`` lists the accounts that partition a cohort in a window.
* Reservations list their keys (accounts) in ``dp_reservation_keys`` by value, not by
  account id: accounts are dropped when their window is reset, the audit trail is not.
* ``dp_history`` is append-only and chained by keyed links (``history``), in
  ``dp_ledger_config.chains`` chains: an entry is linked on its key's chain, so writers
  on different keys rarely share a chain head. ``dp_chain_head`` holds each chain's last
  link, locked last by every writer on that chain, so a chain is serialised and
  gap-free; ``seq`` orders the whole history. Links are made in the client (the chain
  key never reaches the database).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Float,
    Index,
    Integer,
    PrimaryKeyConstraint,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

KEY_LENGTH = 256
# 64-bit on PostgreSQL (counters that grow with every release must never run out);
# SQLite's INTEGER is 64-bit already, and only it makes a row id primary key.
BIG = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    """Declarative base of the ledger's own metadata (separate from Airflow's)."""


class LedgerConfig(Base):
    """The one row fixing delta, the order grid and the conversion for the ledger's life."""

    __tablename__ = "dp_ledger_config"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    delta: Mapped[float] = mapped_column(Float(53))
    orders: Mapped[str] = mapped_column(Text)
    conversion: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[str] = mapped_column(String(40))
    policy_version: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    chains: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # The public name of the chain key (history.ChainKey.key_id) and the first entry it
    # links; NULL while the history is unkeyed (revision 0006).
    chain_key_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    keyed_from: Mapped[int | None] = mapped_column(BIG, nullable=True)
    # Set by a failed verify: no release until an operator clears it (both audited).
    quarantined_at: Mapped[str | None] = mapped_column(String(40), nullable=True)
    quarantine_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    # The administrator's public key (ledger.authority; NULL until one is recorded), the
    # number of quarantines so far, and the administrator's signature lifting the latest
    # (revision 0010).
    admin_key: Mapped[str | None] = mapped_column(Text, nullable=True)
    quarantine_epoch: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    clearance: Mapped[str | None] = mapped_column(Text, nullable=True)
    # The administrator's signature over the whole set of policies (a row deleted, added or
    # swapped for another signed one breaks it).
    policy_set: Mapped[str | None] = mapped_column(Text, nullable=True)


class PolicyRow(Base):
    """A cap for one (tenant, query_type) scope, '*' meaning any."""

    __tablename__ = "dp_policies"
    __table_args__ = (UniqueConstraint("tenant", "query_type", name="uq_dp_policies_scope"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(KEY_LENGTH))
    query_type: Mapped[str] = mapped_column(String(KEY_LENGTH))
    cap_epsilon: Mapped[float] = mapped_column(Float(53))
    warn_fraction: Mapped[float] = mapped_column(Float(53))
    calendar: Mapped[str] = mapped_column(String(16))
    calendar_length_seconds: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # How many windows a period spans: a horizon's (revision 0013); NULL is one.
    calendar_span: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The Rényi order the cap is checked at (revision 0013); NULL: on the reported epsilon.
    filter_order: Mapped[float | None] = mapped_column(Float(53), nullable=True)
    # The cap's shares among principals, canonical JSON (revision 0014); NULL: undivided.
    shares: Mapped[str | None] = mapped_column(Text, nullable=True)
    min_window_seconds: Mapped[int] = mapped_column(Integer)
    compliance_clause: Mapped[str] = mapped_column(Text, default="")
    updated_at: Mapped[str] = mapped_column(String(40))
    grace_seconds: Mapped[int] = mapped_column(BIG)
    # The administrator's signature over the row (ledger.authority), NULL on a ledger
    # without an administrator key (revision 0010).
    signature: Mapped[str | None] = mapped_column(Text, nullable=True)


class _AccountColumns:
    """The columns of an account: a live one (``dp_accounts``) and a sealed one
    (``dp_sealed_accounts``) are the same row, so every read of one reads the other."""

    id: Mapped[int] = mapped_column(BIG, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(KEY_LENGTH))
    subject: Mapped[str] = mapped_column(String(KEY_LENGTH))
    query_type: Mapped[str] = mapped_column(String(KEY_LENGTH))
    window: Mapped[str] = mapped_column(String(KEY_LENGTH))
    rho: Mapped[float] = mapped_column(Float(53), default=0.0)
    residual: Mapped[str | None] = mapped_column(Text, nullable=True)
    gaussian_mu2: Mapped[float | None] = mapped_column(Float(53), nullable=True)
    releases: Mapped[int] = mapped_column(BIG, default=0)
    open_reservations: Mapped[int] = mapped_column(Integer, default=0)
    pending_rho: Mapped[float] = mapped_column(Float(53), default=0.0, server_default="0")
    pending_residual: Mapped[str | None] = mapped_column(Text, nullable=True)
    pending_mu2: Mapped[float] = mapped_column(Float(53), default=0.0, server_default="0")
    pending_others: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    updated_at: Mapped[str] = mapped_column(String(40))
    # Set when the key was re-scoped: its spend moved to this query type, and the key
    # is sealed (it can never be charged again, so it never restarts from zero).
    rescoped_to: Mapped[str | None] = mapped_column(String(KEY_LENGTH), nullable=True)
    # How many subjects the account's class holds (revision 0008; 1 for older accounts).
    size: Mapped[int] = mapped_column(BIG, default=1, server_default="1")
    # Set while the class's members are exactly this cohort's (revision 0009): a class a
    # cohort new to its window made, whose members are then never copied to dp_members.
    cohort_id: Mapped[int | None] = mapped_column(BIG, nullable=True)


class Account(_AccountColumns, Base):
    """Committed spend of one (tenant, subject, query_type, window)."""

    __tablename__ = "dp_accounts"
    __table_args__ = (
        UniqueConstraint("tenant", "subject", "query_type", "window", name="uq_dp_accounts_key"),
        Index("ix_dp_accounts_window", "window"),
        Index("ix_dp_accounts_cohort", "cohort_id"),
    )


class SealedAccount(_AccountColumns, Base):
    """The final spend of an account of a sealed window (revision 0011).

    A reset moves its window's accounts here, in the reset's transaction, so that what
    reservations lock and scan (``dp_accounts``) holds live windows only, while each
    subject's final spend stays readable: one row per class, as it was live (a class
    whose members are its cohort's keeps referring to it; other members keep their
    ``dp_members`` rows, under the window no release can charge again). No release,
    commit or reap touches it; ``verify`` proves every row from the history.
    """

    __tablename__ = "dp_sealed_accounts"
    __table_args__ = (
        UniqueConstraint(
            "tenant", "subject", "query_type", "window", name="uq_dp_sealed_accounts_key"
        ),
        Index("ix_dp_sealed_accounts_window", "window"),
        Index("ix_dp_sealed_accounts_cohort", "cohort_id"),
    )

    # When the reset sealed the window (its dp_windows.sealed_at).
    sealed_at: Mapped[str] = mapped_column(String(40))


class Member(Base):
    """The account (class) one subject of one (tenant, query type, window) belongs to."""

    __tablename__ = "dp_members"
    # Two indexes, as few as the reads allow (each costs a release over new subjects one
    # entry per subject). The key, in key order: a subject's rows in every window, one
    # subject's membership in a window, and the per-subject view's pages (``subject_rows``)
    # are index ranges, not sorts of every subject (the order the accounts' unique key
    # gave before classes). And an account's members in subject order: its least member
    # is one probe, a page of them one range (``spend_classes``), a window's rows a prefix.
    __table_args__ = (
        PrimaryKeyConstraint("tenant", "subject", "query_type", "window"),
        Index("ix_dp_members_account", "tenant", "query_type", "window", "account", "subject"),
    )

    tenant: Mapped[str] = mapped_column(String(KEY_LENGTH))
    query_type: Mapped[str] = mapped_column(String(KEY_LENGTH))
    window: Mapped[str] = mapped_column(String(KEY_LENGTH))
    subject: Mapped[str] = mapped_column(String(KEY_LENGTH))
    # The subject part of the account's key (its label).
    account: Mapped[str] = mapped_column(String(KEY_LENGTH))


class Cohort(Base):
    """A set of subjects of one tenant, named by the sha256 of its sorted canonical ids."""

    __tablename__ = "dp_cohorts"
    __table_args__ = (UniqueConstraint("tenant", "digest", name="uq_dp_cohorts_digest"),)

    id: Mapped[int] = mapped_column(BIG, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(KEY_LENGTH))
    digest: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column(BIG)
    created_at: Mapped[str] = mapped_column(String(40))


class CohortMember(Base):
    """One subject of a cohort (found by subject too: a subject's history goes through
    the cohorts that hold it)."""

    __tablename__ = "dp_cohort_members"
    __table_args__ = (Index("ix_dp_cohort_members_subject", "subject"),)

    cohort_id: Mapped[int] = mapped_column(BIG, primary_key=True)
    subject: Mapped[str] = mapped_column(String(KEY_LENGTH), primary_key=True)


class ChargeCohort(Base):
    """One cohort a charge entry (reserve, correction, rescope) covered in one window.

    How a subject's history is found after its classes split or its window was reset:
    through the cohorts that hold it, never through the accounts it passed through.
    """

    __tablename__ = "dp_charge_cohorts"
    __table_args__ = (Index("ix_dp_charge_cohorts_cohort", "cohort_id", "query_type", "window"),)

    seq: Mapped[int] = mapped_column(BIG, primary_key=True, autoincrement=False)
    cohort_id: Mapped[int] = mapped_column(BIG, primary_key=True, autoincrement=False)
    query_type: Mapped[str] = mapped_column(String(KEY_LENGTH), primary_key=True)
    window: Mapped[str] = mapped_column(String(KEY_LENGTH), primary_key=True)


class CohortAccount(Base):
    """One account of the partition of a cohort in one (query type, window).

    Written when a release first covers the cohort there (which splits the classes it
    covers in part); a later split of a listed account lists its new part too.
    """

    __tablename__ = "dp_cohort_accounts"

    cohort_id: Mapped[int] = mapped_column(BIG, primary_key=True)
    query_type: Mapped[str] = mapped_column(String(KEY_LENGTH), primary_key=True)
    window: Mapped[str] = mapped_column(String(KEY_LENGTH), primary_key=True)
    account: Mapped[str] = mapped_column(String(KEY_LENGTH), primary_key=True)


class Reservation(Base):
    """A prospective spend: counted against its keys from reserve until commit/release/reap."""

    __tablename__ = "dp_reservations"
    __table_args__ = (Index("ix_dp_reservations_state", "state"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    attempt_id: Mapped[str] = mapped_column(String(1024), unique=True)
    # sha256 of the secret handed to the reserving attempt (NULL before revision 0005:
    # such reservations are committed or reaped, never released).
    token_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    state: Mapped[str] = mapped_column(String(16))
    mechanism: Mapped[str] = mapped_column(Text)
    count: Mapped[int] = mapped_column(BIG)
    cost_rho: Mapped[float] = mapped_column(Float(53))
    cost_residual: Mapped[str | None] = mapped_column(Text, nullable=True)
    cost_gaussian_mu2: Mapped[float | None] = mapped_column(Float(53), nullable=True)
    key_count: Mapped[int] = mapped_column(Integer)
    keys_digest: Mapped[str] = mapped_column(String(64))
    # NULL when the server decided the reservation (dp_reserve, PostgreSQL): it cannot
    # compute the epsilon, so it records the prospective spend, which determines it.
    prospective_epsilon: Mapped[float | None] = mapped_column(Float(53), nullable=True)
    prospective_rho: Mapped[float | None] = mapped_column(Float(53), nullable=True)
    prospective_mu2: Mapped[float | None] = mapped_column(Float(53), nullable=True)
    actor: Mapped[str] = mapped_column(String(KEY_LENGTH))
    created_at: Mapped[str] = mapped_column(String(40))
    resolved_at: Mapped[str | None] = mapped_column(String(40), nullable=True)
    # Until when the reserving attempt is known to be alive: set by reserve, extended by
    # its renewals (``lease``), on the ledger's clock like created_at. An open reservation
    # past it is charged by the next reap; NULL counts as run out (revision 0007).
    lease_expires_at: Mapped[str | None] = mapped_column(String(40), nullable=True)


class ReservationKey(Base):
    """One key of a reservation, by value (survives the account's reset).

    No foreign key to its reservation (revision 0004): both are written in one
    transaction by the ledger only, and ``verify`` reports key rows of no reservation.
    """

    __tablename__ = "dp_reservation_keys"
    __table_args__ = (
        Index("ix_dp_reservation_keys_key", "tenant", "subject", "query_type", "window"),
    )

    reservation_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant: Mapped[str] = mapped_column(String(KEY_LENGTH))
    subject: Mapped[str] = mapped_column(String(KEY_LENGTH))
    query_type: Mapped[str] = mapped_column(String(KEY_LENGTH))
    window: Mapped[str] = mapped_column(String(KEY_LENGTH))


class HistoryEntry(Base):
    """One append-only audit entry; ``hash`` = MAC(prev_hash + canonical JSON of the entry).

    The key columns are set when the entry concerns exactly one account (the common
    case), so an account's history is an index lookup; multi-key entries are found
    through their reservation's keys.
    """

    __tablename__ = "dp_history"
    __table_args__ = (
        Index("ix_dp_history_key", "tenant", "subject", "query_type", "window"),
        # The quarantine entries alone: every charge counts them, so that a quarantine
        # counter rolled back in dp_ledger_config is refused (revision 0010).
        Index(
            "ix_dp_history_quarantines",
            "seq",
            postgresql_where=text("action = 'quarantine'"),
            sqlite_where=text("action = 'quarantine'"),
        ),
    )

    seq: Mapped[int] = mapped_column(BIG, primary_key=True, autoincrement=False)
    chain: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    at: Mapped[str] = mapped_column(String(40))
    action: Mapped[str] = mapped_column(String(16))
    actor: Mapped[str] = mapped_column(String(KEY_LENGTH))
    reservation_id: Mapped[str | None] = mapped_column(String(36), nullable=True, index=True)
    tenant: Mapped[str | None] = mapped_column(String(KEY_LENGTH), nullable=True)
    subject: Mapped[str | None] = mapped_column(String(KEY_LENGTH), nullable=True)
    query_type: Mapped[str | None] = mapped_column(String(KEY_LENGTH), nullable=True)
    window: Mapped[str | None] = mapped_column(String(KEY_LENGTH), nullable=True)
    payload: Mapped[str] = mapped_column(Text)
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64))


class ChainHead(Base):
    """The last link of one history chain (id = chain number; seq 0 while it is empty).

    Locked last by every writer on that chain, so a chain has no forks or gaps.
    """

    __tablename__ = "dp_chain_head"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(BIG)
    hash: Mapped[str] = mapped_column(String(64))
    # The chain key's public name its next link is made with: read with the head's lock,
    # so a writer still holding an older key (or none) after a key was adopted is refused.
    key_id: Mapped[str | None] = mapped_column(String(64), nullable=True)


class Window(Base):
    """One budget window of one (tenant, query_type) scope that has been charged.

    Every account's scope and window has a row here, written by the reservation that
    first charged it and share-locked by every later one; a reset seals it (under an
    exclusive lock, so no reservation is half-way through) before dropping its accounts.
    A sealed window is never charged again: closing it can never refund.
    """

    __tablename__ = "dp_windows"

    tenant: Mapped[str] = mapped_column(String(KEY_LENGTH), primary_key=True)
    query_type: Mapped[str] = mapped_column(String(KEY_LENGTH), primary_key=True)
    window: Mapped[str] = mapped_column(String(KEY_LENGTH), primary_key=True)
    created_at: Mapped[str] = mapped_column(String(40))
    sealed_at: Mapped[str | None] = mapped_column(String(40), nullable=True)


class MaintenanceRun(Base):
    """When each maintenance job (reap, reset, verify) last completed, by the ledger's
    clock (revision 0012): what the overdue warnings read (:mod:`maintenance`).

    A health signal, not a budget fact: no charge, seal or verify depends on it.
    """

    __tablename__ = "dp_maintenance"

    job: Mapped[str] = mapped_column(String(16), primary_key=True)
    last_run_at: Mapped[str] = mapped_column(String(40))
    actor: Mapped[str] = mapped_column(Text)


class StoredRelease(Base):
    """The noisy answer of the last committed release of one identity (revision 0015),
    which a re-run of that release is handed instead of a fresh, charged answer.

    ``identity`` is the digest of ``document`` (what the release is: ``identity``);
    ``value`` and ``receipt`` are canonical JSON; ``digest`` binds the three, and the
    commit entry that charged ``reservation_id`` records it, so a stored answer edited in
    the database matches no entry and is never served (``stored``).
    """

    __tablename__ = "dp_stored_releases"

    identity: Mapped[str] = mapped_column(String(64), primary_key=True)
    reservation_id: Mapped[str] = mapped_column(String(36), unique=True)
    document: Mapped[str] = mapped_column(Text)
    value: Mapped[str] = mapped_column(Text)
    receipt: Mapped[str] = mapped_column(Text)
    digest: Mapped[str] = mapped_column(String(64))
    stored_at: Mapped[str] = mapped_column(String(40))
