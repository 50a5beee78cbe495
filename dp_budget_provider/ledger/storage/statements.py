"""The write path's hand-written SQL, and the helpers that read its rows back.

The ledger's PostgreSQL hot statements are plain SQL rather than SQLAlchemy constructs:
they are sent many times per second (building and compiling a construct each time cost
more than the database work), and several of them travel in one round trip (see
:mod:`pipeline`); their parameters are psycopg2's ``%(name)s``. The general path's
SQLAlchemy statements (SQLite, and commits with a residual curve) are built once, with
bind parameters. Rows are read by position in the order of :data:`ACCOUNT_ROW`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, Float, and_, bindparam, case, or_, select, update
from sqlalchemy.dialects import sqlite

from dp_budget_provider.accounting.rounding import ROUND_UP
from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.accounts.spend import Pending, Spend
from dp_budget_provider.ledger.errors import LedgerCorrupt
from dp_budget_provider.ledger.storage.schema import Account, ReservationKey
from dp_budget_provider.ledger.storage.schema import Reservation as ReservationRow

KEY_COLUMNS = (Account.tenant, Account.subject, Account.query_type, Account.window)
# How many values one IN list or batch carries (well under SQLite's variable limit).
CHUNK = 1000


def chunks(items: Sequence[Any], size: int = CHUNK) -> Iterable[Sequence[Any]]:
    """``items`` in slices of at most ``size``, in order."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


def lock_order(connection: Connection, columns: Sequence[Any] = KEY_COLUMNS) -> list[Any]:
    """ORDER BY clauses that sort keys (or other rows by ``columns``) exactly like
    Python's ``sorted`` (code points).

    Every writer locks accounts (and window rows) in this one order, so two transactions
    can never wait on each other in a cycle. PostgreSQL must compare bytes (collation
    "C"): a linguistic collation would order some keys differently from the upsert path
    (or the window lock of a charge) and deadlock.
    """
    if connection.dialect.name == "postgresql":
        return [column.collate("C") for column in columns]
    return list(columns)


def key_tuple(key: LedgerKey) -> tuple[str, str, str, str]:
    return key.tenant, key.subject, key.query_type, key.window


class LockedAccount:
    """An account row held under lock for the rest of the transaction."""

    __slots__ = ("id", "spend", "pending", "open_reservations", "releases", "rescoped_to", "size")

    def __init__(
        self,
        account_id: int,
        spend: Spend,
        pending: Pending,
        open_reservations: int,
        releases: int,
        rescoped_to: str | None,
        size: int,
    ) -> None:
        self.id = account_id
        self.spend = spend  # committed
        self.pending = pending  # summed cost of the open reservations
        self.open_reservations = open_reservations
        self.releases = releases
        self.rescoped_to = rescoped_to  # sealed: its spend moved to this query type
        self.size = size  # subjects in the account's class


# Column order of every account row the write paths read (raw rows are read by position).
ACCOUNT_ROW = (
    'id, tenant, subject, query_type, "window", rho, residual, gaussian_mu2, '
    "open_reservations, releases, pending_rho, pending_residual, pending_mu2, pending_others, "
    "rescoped_to, size"
)
ACCOUNT_COLUMNS = tuple(getattr(Account, name.strip(' "')) for name in ACCOUNT_ROW.split(","))

# PostgreSQL: create missing accounts and lock all of them, in the order given (key
# order), in one statement however many keys a release touches.
PG_UPSERT = f"""
INSERT INTO dp_accounts AS a (tenant, subject, query_type, "window", rho, residual,
    gaussian_mu2, releases, open_reservations, pending_rho, pending_residual, pending_mu2,
    pending_others, updated_at)
SELECT t, s, q, w, 0, NULL, 0, 0, %(add_open)s, %(add_rho)s, NULL, %(add_mu2)s,
    %(add_others)s, %(now)s
FROM unnest(string_to_array(%(tenants)s, E'\n'), string_to_array(%(subjects)s, E'\n'),
            string_to_array(%(query_types)s, E'\n'), string_to_array(%(windows)s, E'\n'))
     WITH ORDINALITY AS u(t, s, q, w, n)
ORDER BY n
ON CONFLICT (tenant, subject, query_type, "window") DO UPDATE
SET open_reservations = a.open_reservations + %(add_open)s,
    pending_rho = CASE WHEN a.pending_rho = 0 OR %(add_rho)s = 0 THEN a.pending_rho + %(add_rho)s
        ELSE (a.pending_rho + %(add_rho)s) * %(round_up)s END,
    pending_mu2 = CASE WHEN a.pending_mu2 = 0 OR %(add_mu2)s = 0 THEN a.pending_mu2 + %(add_mu2)s
        ELSE (a.pending_mu2 + %(add_mu2)s) * %(round_up)s END,
    pending_others = a.pending_others + %(add_others)s, updated_at = excluded.updated_at
RETURNING {", ".join("a." + c.strip() for c in ACCOUNT_ROW.split(","))},
    (SELECT c.policy_version FROM dp_ledger_config c WHERE c.id = 1)
"""

PG_RESERVATION_KEYS = """
INSERT INTO dp_reservation_keys (reservation_id, position, tenant, subject, query_type, "window")
SELECT %(reservation_id)s, n - 1, t, s, q, w
FROM unnest(string_to_array(%(tenants)s, E'\n'), string_to_array(%(subjects)s, E'\n'),
            string_to_array(%(query_types)s, E'\n'), string_to_array(%(windows)s, E'\n'))
     WITH ORDINALITY AS u(t, s, q, w, n)
"""

PG_SET_PENDING_RESIDUAL = """
UPDATE dp_accounts SET pending_residual = %(residual)s WHERE id = ANY(%(ids)s)
"""

INSERT_RESERVATION = """
INSERT INTO dp_reservations (id, attempt_id, token_hash, state, mechanism, count, cost_rho,
    cost_residual, cost_gaussian_mu2, key_count, keys_digest, prospective_epsilon, actor,
    created_at, lease_expires_at)
VALUES (%(id)s, %(attempt_id)s, %(token_hash)s, %(state)s, %(mechanism)s, %(count)s, %(cost_rho)s,
    %(cost_residual)s, %(cost_gaussian_mu2)s, %(key_count)s, %(keys_digest)s,
    %(prospective_epsilon)s, %(actor)s, %(created_at)s, %(lease_expires_at)s)
"""

# How many quarantines the history records (a partial index holds exactly those entries):
# every charge compares it with dp_ledger_config.quarantine_epoch.
QUARANTINES = "SELECT count(*) FROM dp_history WHERE action = 'quarantine'"

# PostgreSQL: create the window rows a charge touches (sorted, so two charges never
# wait on each other's new rows in opposite orders), then lock all of them, in that
# order, exclusively: a charge may refine the window's classes (see ``classes``), which
# must never interleave with another's, and a reset seals a window under the same lock,
# so it waits for every charge under way and every later one sees the seal. A separate
# statement, so that its snapshot sees rows a concurrent charge created meanwhile. The
# configuration row is share-locked: a policy change (whose trigger updates the row)
# waits for every charge under way and every later charge waits for it, so the history
# orders each charge wholly before or after it, as the policies it was decided by were.
PG_LOCK_WINDOWS = """
INSERT INTO dp_windows AS w (tenant, query_type, "window", created_at)
SELECT t, q, x, %(now)s
FROM unnest(string_to_array(%(tenants)s, E'\n'), string_to_array(%(query_types)s, E'\n'),
            string_to_array(%(windows)s, E'\n')) AS u(t, q, x)
ON CONFLICT DO NOTHING;
SELECT w.tenant, w.query_type, w."window", w.sealed_at,
    c.quarantined_at, c.quarantine_epoch, c.clearance, ({quarantines})
FROM dp_windows w
CROSS JOIN dp_ledger_config c
JOIN unnest(string_to_array(%(tenants)s, E'\n'), string_to_array(%(query_types)s, E'\n'),
            string_to_array(%(windows)s, E'\n')) AS u(t, q, x)
  ON w.tenant = u.t AND w.query_type = u.q AND w."window" = u.x
WHERE c.id = 1
ORDER BY w.tenant COLLATE "C", w.query_type COLLATE "C", w."window" COLLATE "C"
FOR UPDATE OF w FOR SHARE OF c
""".replace("{quarantines}", QUARANTINES)

SQLITE_NEW_WINDOW = (
    'INSERT OR IGNORE INTO dp_windows (tenant, query_type, "window", created_at) '
    "VALUES (%(tenant)s, %(query_type)s, %(window)s, %(now)s)"
)
SQLITE_WINDOW = (
    'SELECT w.tenant, w.query_type, w."window", w.sealed_at, '
    f"c.quarantined_at, c.quarantine_epoch, c.clearance, ({QUARANTINES}) "
    "FROM dp_windows w, dp_ledger_config c "
    "WHERE c.id = 1 AND w.tenant = %(tenant)s AND w.query_type = %(query_type)s "
    'AND w."window" = %(window)s'
)

QUARANTINE_REASON = "SELECT quarantine_reason FROM dp_ledger_config WHERE id = 1"

POLICY_ROWS = (
    "SELECT tenant, query_type, cap_epsilon, warn_fraction, calendar, calendar_length_seconds, "
    "min_window_seconds, compliance_clause, grace_seconds, calendar_span, filter_order, "
    "shares, signature, "
    "(SELECT policy_set FROM dp_ledger_config WHERE id = 1) FROM dp_policies"
)


def newline_joined(parts: Sequence[str]) -> str:
    """Key parts as one newline-separated text, for ``string_to_array(..., E'\\n')``.

    One string instead of an array of 10^5 quoted elements: canonical key parts cannot
    hold a newline (control characters are refused), which is checked here too, so a key
    made without canonicalisation is refused rather than split into two on the server.
    """
    joined = "\n".join(parts)
    if joined.count("\n") != len(parts) - 1:
        raise ValueError("a key part contains a newline")
    return joined


def key_parts(keys: Sequence[LedgerKey]) -> dict[str, str]:
    """The keys as four newline-separated texts (see :func:`newline_joined`)."""
    return {
        "tenants": newline_joined([k.tenant for k in keys]),
        "subjects": newline_joined([k.subject for k in keys]),
        "query_types": newline_joined([k.query_type for k in keys]),
        "windows": newline_joined([k.window for k in keys]),
    }


def accounts_by_key(
    rows: Iterable[Sequence[Any]], keys: Sequence[LedgerKey], size: int
) -> dict[LedgerKey, LockedAccount]:
    """Locked account rows (``ACCOUNT_ROW`` order) by key.

    Stored values are validated and turned into spends once per distinct value: the
    accounts of a release over many new subjects all hold the same (zero) spend. A key
    read twice (a subject held by two classes, which only an edit of the tables makes)
    is refused: neither class holds all of its spend.
    """
    by_parts = {key_tuple(key): key for key in keys}
    spends: dict[tuple[Any, ...], tuple[Spend, Pending]] = {}
    locked = {}
    for row in rows:
        stored = (row[5], row[6], row[7], row[10], row[11], row[12], row[13])
        pair = spends.get(stored)
        if pair is None:
            pair = spends[stored] = (
                Spend.from_columns(row[5], row[6], row[7], size),
                Pending.from_columns(row[10], row[11], row[12], row[13], size),
            )
        key = by_parts.get((row[1], row[2], row[3], row[4])) or LedgerKey.from_canonical(
            row[1], row[2], row[3], row[4]
        )
        if key in locked:
            raise LedgerCorrupt(f"{key} is held by two accounts: the ledger's tables were edited")
        locked[key] = LockedAccount(row[0], pair[0], pair[1], row[8], row[9], row[14], row[15])
    return locked


def _round_up() -> Any:
    """``rounding.ROUND_UP`` as a bound double (never a SQL literal a parser might round)."""
    return bindparam("round_up", ROUND_UP, type_=Float(53))


def _sum_up(column: Any, value: Any) -> Any:
    """:func:`rounding.sum_up` in SQL: exact when either side is zero, else raised."""
    return case(
        (or_(column == 0, value == 0), column + value), else_=(column + value) * _round_up()
    )


def _difference_up(column: Any, value: Any) -> Any:
    """:func:`spend.difference_up` before its clamp at zero, in SQL."""
    return case((value == 0, column - value), else_=(column - value) * _round_up())


@functools.cache
def sqlite_upsert() -> Any:
    """SQLite's lock-and-read upsert, built once: the inserted row carries the increments.

    A new account starts with exactly what one reservation adds, so the conflict branch
    adds ``excluded``'s values; the statement never changes and is compiled once.
    """
    statement = sqlite.insert(Account)
    added = statement.excluded
    return statement.on_conflict_do_update(
        index_elements=[c.name for c in KEY_COLUMNS],
        set_={
            "open_reservations": Account.open_reservations + added.open_reservations,
            "pending_rho": _sum_up(Account.pending_rho, added.pending_rho),
            "pending_mu2": _sum_up(Account.pending_mu2, added.pending_mu2),
            "pending_others": Account.pending_others + added.pending_others,
            "updated_at": added.updated_at,
        },
    ).returning(*ACCOUNT_COLUMNS)


def lock_reservation_accounts(connection: Connection) -> Any:
    """Every account of reservation ``:rid``, locked in key order (one indexed join): the
    order of every other writer (PostgreSQL compares bytes, see ``lock_order``)."""
    return _accounts_of_reservation(connection.dialect.name == "postgresql")


@functools.cache
def _accounts_of_reservation(postgresql: bool) -> Any:
    joined = and_(
        ReservationKey.tenant == Account.tenant,
        ReservationKey.subject == Account.subject,
        ReservationKey.query_type == Account.query_type,
        ReservationKey.window == Account.window,
    )
    return (
        select(*ACCOUNT_COLUMNS)
        .join(ReservationKey, joined)
        .where(ReservationKey.reservation_id == bindparam("rid"))
        .order_by(*(column.collate("C") if postgresql else column for column in KEY_COLUMNS))
        .with_for_update(of=Account)
    )


@functools.cache
def reservation_for_update() -> Any:
    return select(ReservationRow).where(ReservationRow.id == bindparam("rid")).with_for_update()


@functools.cache
def close_accounts(*, gaussian: bool, charge: bool) -> Any:
    """Close one reservation of a residual-free cost on accounts ``:ids`` (set-based).

    :meth:`Pending.remove` in SQL: the cost leaves the pending spend, clamped at zero,
    and everything pending resets to zero with the last open reservation; with
    ``charge``, ``:count`` releases of it join the committed spend.
    """
    last = Account.open_reservations <= 1
    rho = bindparam("cost_rho", type_=Float(53))
    mu2 = bindparam("cost_mu2", type_=Float(53))
    pending_rho = _difference_up(Account.pending_rho, rho)
    pending_mu2 = _difference_up(Account.pending_mu2, mu2)
    values: dict[str, Any] = {
        "open_reservations": Account.open_reservations - 1,
        "pending_rho": case((last, 0.0), (pending_rho < 0, 0.0), else_=pending_rho),
        "pending_mu2": case((last, 0.0), (pending_mu2 < 0, 0.0), else_=pending_mu2)
        if gaussian
        else case((last, 0.0), else_=Account.pending_mu2),
        "pending_others": case((last, 0), else_=Account.pending_others)
        if gaussian
        else case((last, 0), (Account.pending_others < 1, 0), else_=Account.pending_others - 1),
        "pending_residual": case((last, None), else_=Account.pending_residual),
        "updated_at": bindparam("now"),
    }
    if charge:
        values["rho"] = _sum_up(Account.rho, rho)
        values["gaussian_mu2"] = _sum_up(Account.gaussian_mu2, mu2) if gaussian else None
        values["releases"] = Account.releases + bindparam("count")
    return (
        update(Account)
        .where(Account.id.in_(bindparam("ids", expanding=True)))
        .values(**values)
        .execution_options(synchronize_session=False)
    )


def store_spend(
    connection: Connection,
    account_id: int,
    spend: Spend,
    releases_added: int,
    now: str,
    *,
    pending: Pending | None = None,
) -> None:
    """Write one locked account's new spend (its full curve, not an increment).

    With ``pending``, one of its open reservations closes: the count drops and the
    pending spend becomes ``pending``.
    """
    values: dict[str, Any] = {
        "rho": spend.rho,
        "residual": spend.residual_json(),
        "gaussian_mu2": spend.gaussian_mu2,
        "releases": Account.releases + releases_added,
        "updated_at": now,
    }
    if pending is not None:
        values["open_reservations"] = Account.open_reservations - 1
        values["pending_rho"] = pending.rho
        values["pending_residual"] = pending.residual_json()
        values["pending_mu2"] = pending.mu2
        values["pending_others"] = pending.others
    connection.execute(update(Account).where(Account.id == account_id).values(**values))
