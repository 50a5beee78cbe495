"""A keyed history chain, linked in the client, and quarantine.

* ``dp_ledger_config`` gains ``chain_key_id`` and ``keyed_from`` (the public name of the
  HMAC key the history is linked with, and the first entry it links; NULL while the
  history is unkeyed: ``dp-budget db adopt-key`` keys an existing ledger), and
  ``quarantined_at`` / ``quarantine_reason`` (set by a failed verify).
* ``dp_chain_head`` gains ``key_id``: the key each chain's next link is made with, read
  under the head's lock, so a writer holding another key is refused.
* The server function ``dp_append`` goes: links are made in the client, so that the key
  never reaches the database server. Nothing else made links on the server.
* Every window's ``created_at`` becomes the time of the first entry that charged it
  (revision 0005 stamped the windows it found with the time of its upgrade), so
  ``verify`` can check it against the history like every other column.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_0005 = importlib.import_module(
    "dp_budget_provider.ledger.storage.migrations.versions.0005_windows_seals_and_owned_reservations"
)

_FIRST_CHARGE = """
UPDATE dp_windows SET created_at = COALESCE((
    SELECT min(firsts.at) FROM (
        SELECT h.at FROM dp_history h
        WHERE h.action IN ('reserve', 'correction', 'rescope')
          AND h.tenant = dp_windows.tenant AND h.query_type = dp_windows.query_type
          AND h."window" = dp_windows."window"
        UNION ALL
        SELECT h.at FROM dp_reservation_keys k
        JOIN dp_history h ON h.reservation_id = k.reservation_id AND h.action = 'reserve'
        WHERE k.tenant = dp_windows.tenant AND k.query_type = dp_windows.query_type
          AND k."window" = dp_windows."window"
    ) AS firsts
), created_at)
"""


def upgrade() -> None:
    connection = op.get_bind()
    big = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    for table, column in (
        ("dp_ledger_config", sa.Column("chain_key_id", sa.String(64), nullable=True)),
        ("dp_ledger_config", sa.Column("keyed_from", big, nullable=True)),
        ("dp_ledger_config", sa.Column("quarantined_at", sa.String(40), nullable=True)),
        ("dp_ledger_config", sa.Column("quarantine_reason", sa.Text(), nullable=True)),
        ("dp_chain_head", sa.Column("key_id", sa.String(64), nullable=True)),
    ):
        op.add_column(table, column)
    if connection.dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION {_0005._APPEND_SIGNATURE}")
    op.execute(_FIRST_CHARGE)


def downgrade() -> None:
    connection = op.get_bind()
    keyed, quarantined = connection.execute(
        sa.text("SELECT chain_key_id IS NOT NULL, quarantined_at IS NOT NULL FROM dp_ledger_config")
    ).one()
    if keyed or quarantined:
        raise RuntimeError(
            "refusing to downgrade below revision 0006: the history is keyed or the ledger "
            "is quarantined, and revision 0005 can neither verify keyed links nor stop "
            "releases"
        )
    if connection.dialect.name == "postgresql":
        op.execute(_0005.DP_APPEND)
    with op.batch_alter_table("dp_chain_head") as batch:
        batch.drop_column("key_id")
    with op.batch_alter_table("dp_ledger_config") as batch:
        for column in ("quarantine_reason", "quarantined_at", "keyed_from", "chain_key_id"):
            batch.drop_column(column)
