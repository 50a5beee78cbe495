"""Windows the ledger owns and seals; reservations owned by their attempt; 64-bit counters.

* ``dp_windows`` lists every (tenant, query_type, window) that has been charged. Each
  reservation creates its rows and share-locks them; a reset seals the rows of a closed
  window (exclusive lock) before it drops the window's accounts, and a sealed window is
  never charged again, so closing a window can never refund it. Windows that earlier
  revisions reset (a ``reset`` history entry) are sealed here, for every scope that had
  charged them.
* ``dp_policies.grace_seconds``: how long after a window ends late and backfilled runs may
  still be charged to it, before maintenance may seal it (3 days for existing policies).
* ``dp_accounts.rescoped_to``: a re-scoped key keeps its row, sealed, naming the query
  type its spend moved to, so it can never restart from zero.
* ``dp_reservations.token_hash``: the digest of the secret handed to the reserving
  attempt; only its holder may commit or release. Reservations open at upgrade time have
  none: they are committed or reaped (charged), never released.
* PostgreSQL: the server-side reserve and commit (``dp_reserve``, ``dp_commit``) are gone:
  the cap decision and the commit arithmetic each have one implementation, in Python.
  Account ids, release counts, reservation counts and history numbers become 64-bit
  (``dp_append`` with them).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib
import json

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_0003 = importlib.import_module(
    "dp_budget_provider.ledger.storage.migrations.versions.0003_sharded_history_chains"
)

_APPEND_SIGNATURE = "dp_append(integer, text, text, text, text, text, text, text, text, text, text)"
_COMMIT_SIGNATURE = (
    "dp_commit(integer, text, text, text, text, text, text, integer, text, double precision, "
    "double precision, text, text, text, text, text, text)"
)
# 0003's dp_append, numbering with 64-bit sequence values.
DP_APPEND = _0003.DP_APPEND.replace(") RETURNS integer", ") RETURNS bigint", 1).replace(
    "    v_seq integer;", "    v_seq bigint;", 1
)
_BIGINT_COLUMNS = (
    ("dp_accounts", "id"),
    ("dp_accounts", "releases"),
    ("dp_reservations", "count"),
    ("dp_history", "seq"),
    ("dp_chain_head", "seq"),
)
DEFAULT_GRACE_SECONDS = 3 * 86400
_KEY = 256


def _create_windows(connection: sa.Connection) -> None:
    op.create_table(
        "dp_windows",
        sa.Column("tenant", sa.String(_KEY), primary_key=True),
        sa.Column("query_type", sa.String(_KEY), primary_key=True),
        sa.Column("window", sa.String(_KEY), primary_key=True),
        sa.Column("created_at", sa.String(40), nullable=False),
        sa.Column("sealed_at", sa.String(40), nullable=True),
    )
    now = connection.execute(sa.text("SELECT COALESCE(max(at), '') FROM dp_history")).scalar_one()
    connection.execute(
        sa.text(
            'INSERT INTO dp_windows (tenant, query_type, "window", created_at) '
            'SELECT DISTINCT tenant, query_type, "window", :now FROM ('
            'SELECT tenant, query_type, "window" FROM dp_accounts UNION '
            'SELECT tenant, query_type, "window" FROM dp_reservation_keys) AS charged'
        ),
        {"now": now},
    )
    resets = connection.execute(
        sa.text("SELECT at, payload FROM dp_history WHERE action = 'reset' ORDER BY seq")
    ).all()
    for at, payload in resets:
        window = json.loads(payload).get("window")
        connection.execute(
            sa.text(
                'UPDATE dp_windows SET sealed_at = :at WHERE "window" = :window '
                "AND sealed_at IS NULL"
            ),
            {"at": at, "window": window},
        )


def upgrade() -> None:
    connection = op.get_bind()
    postgresql = connection.dialect.name == "postgresql"
    with op.batch_alter_table("dp_policies") as batch:
        batch.add_column(
            sa.Column(
                "grace_seconds",
                sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
                nullable=False,
                server_default=str(DEFAULT_GRACE_SECONDS),
            )
        )
    # Plain ADD COLUMN: a batch copy of these tables would rewrite every row on SQLite.
    op.execute("ALTER TABLE dp_accounts ADD COLUMN rescoped_to VARCHAR(256)")
    op.execute("ALTER TABLE dp_reservations ADD COLUMN token_hash VARCHAR(64)")
    _create_windows(connection)
    if postgresql:
        op.execute(f"DROP FUNCTION {_0003._RESERVE_SIGNATURE}")
        op.execute(f"DROP FUNCTION {_COMMIT_SIGNATURE}")
        op.execute(f"DROP FUNCTION {_APPEND_SIGNATURE}")
        for table, column in _BIGINT_COLUMNS:
            op.execute(f"ALTER TABLE {table} ALTER COLUMN {column} TYPE bigint")
        op.execute("ALTER SEQUENCE dp_accounts_id_seq AS bigint")
        op.execute("ALTER SEQUENCE dp_history_seq AS bigint")
        op.execute(DP_APPEND)


def downgrade() -> None:
    connection = op.get_bind()
    for count, why in (
        (
            "SELECT count(*) FROM dp_windows WHERE sealed_at IS NOT NULL",
            "windows are sealed; revision 0004 would charge them again from zero",
        ),
        (
            "SELECT count(*) FROM dp_accounts WHERE rescoped_to IS NOT NULL",
            "keys were re-scoped; revision 0004 would charge them again from zero",
        ),
    ):
        found = connection.execute(sa.text(count)).scalar_one()
        if found:
            raise RuntimeError(f"cannot downgrade below revision 0005: {found} {why}")
    if connection.dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION {_APPEND_SIGNATURE}")
        op.execute(_0003.DP_APPEND)
        op.execute(_0003.DP_COMMIT)
        connection.exec_driver_sql(_0003.DP_RESERVE)
    op.drop_table("dp_windows")
    op.execute("ALTER TABLE dp_reservations DROP COLUMN token_hash")
    op.execute("ALTER TABLE dp_accounts DROP COLUMN rescoped_to")
    with op.batch_alter_table("dp_policies") as batch:
        batch.drop_column("grace_seconds")
