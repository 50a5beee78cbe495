"""The administrator's authority: signed policies and clearings (see ``ledger.authority``).

* ``dp_ledger_config.admin_key``: the public key of the ledger's administrator (NULL
  until ``dp-budget admin init``); every policy and every clearing of a quarantine is
  signed with its private half, which no worker holds.
* ``dp_ledger_config.quarantine_epoch``: how many times the ledger has been quarantined.
  A clearing is signed for one epoch, so a quarantine lifted by SQL (or a clearing
  replayed from an earlier quarantine) is not honoured. Set to the number of quarantine
  entries the history holds.
* ``dp_ledger_config.clearance``: the administrator's signature lifting the current
  epoch's quarantine.
* ``dp_ledger_config.policy_set``: the administrator's signature over the whole set of
  policies, so that a row deleted (a looser default then applies), added or swapped for
  another signed row is refused.
* ``dp_policies.signature``: the administrator's signature over the policy row.
* ``ix_dp_history_quarantines``: the quarantine entries, which every charge counts (a
  quarantine counter rolled back below them is refused).

Revision ID: 0010
Revises: 0009
Create Date: 2027-03-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("dp_ledger_config", sa.Column("admin_key", sa.Text(), nullable=True))
    op.add_column(
        "dp_ledger_config",
        sa.Column("quarantine_epoch", sa.Integer(), nullable=False, server_default="0"),
    )
    op.add_column("dp_ledger_config", sa.Column("clearance", sa.Text(), nullable=True))
    op.add_column("dp_ledger_config", sa.Column("policy_set", sa.Text(), nullable=True))
    op.add_column("dp_policies", sa.Column("signature", sa.Text(), nullable=True))
    op.create_index(
        "ix_dp_history_quarantines",
        "dp_history",
        ["seq"],
        postgresql_where=sa.text("action = 'quarantine'"),
        sqlite_where=sa.text("action = 'quarantine'"),
    )
    op.execute(
        "UPDATE dp_ledger_config SET quarantine_epoch = "
        "(SELECT count(*) FROM dp_history WHERE action = 'quarantine')"
    )


def downgrade() -> None:
    connection = op.get_bind()
    administered = connection.execute(
        sa.text("SELECT count(*) FROM dp_ledger_config WHERE admin_key IS NOT NULL")
    ).scalar_one()
    if administered:
        raise RuntimeError(
            "cannot downgrade below revision 0010: the ledger has an administrator key, and "
            "revision 0009 would honour policies and clearings nobody signed"
        )
    op.drop_index("ix_dp_history_quarantines", table_name="dp_history")
    for table, column in (
        ("dp_policies", "signature"),
        ("dp_ledger_config", "policy_set"),
        ("dp_ledger_config", "clearance"),
        ("dp_ledger_config", "quarantine_epoch"),
        ("dp_ledger_config", "admin_key"),
    ):
        op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
