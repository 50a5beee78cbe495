"""Sealed windows keep their final spend: ``dp_sealed_accounts``.

* ``dp_sealed_accounts``: an account of a sealed window, moved out of ``dp_accounts`` by
  the reset that sealed it (the same columns, and ``sealed_at``). Its members stay where
  they were (its cohort, or its ``dp_members`` rows and its cohorts' listings), so every
  subject's final spend in the window stays readable. Windows sealed before this revision
  had their accounts and members deleted: they stay so (their history is intact, the
  final spend is not stored), and reads of them say so instead of answering zero.

The way back is refused once a window's final spend is kept: revision 0010's verify
reads the members a reset now keeps as the members of no account.

Revision ID: 0011
Revises: 0010
Create Date: 2027-04-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_BIG = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_KEY = sa.String(256)


def upgrade() -> None:
    op.create_table(
        "dp_sealed_accounts",
        sa.Column("id", _BIG, primary_key=True, autoincrement=True),
        sa.Column("tenant", _KEY, nullable=False),
        sa.Column("subject", _KEY, nullable=False),
        sa.Column("query_type", _KEY, nullable=False),
        sa.Column("window", _KEY, nullable=False),
        sa.Column("rho", sa.Float(53), nullable=False),
        sa.Column("residual", sa.Text(), nullable=True),
        sa.Column("gaussian_mu2", sa.Float(53), nullable=True),
        sa.Column("releases", _BIG, nullable=False),
        sa.Column("open_reservations", sa.Integer(), nullable=False),
        sa.Column("pending_rho", sa.Float(53), nullable=False, server_default="0"),
        sa.Column("pending_residual", sa.Text(), nullable=True),
        sa.Column("pending_mu2", sa.Float(53), nullable=False, server_default="0"),
        sa.Column("pending_others", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("updated_at", sa.String(40), nullable=False),
        sa.Column("rescoped_to", _KEY, nullable=True),
        sa.Column("size", _BIG, nullable=False, server_default="1"),
        sa.Column("cohort_id", _BIG, nullable=True),
        sa.Column("sealed_at", sa.String(40), nullable=False),
        sa.UniqueConstraint(
            "tenant", "subject", "query_type", "window", name="uq_dp_sealed_accounts_key"
        ),
    )
    op.create_index("ix_dp_sealed_accounts_window", "dp_sealed_accounts", ["window"])
    op.create_index("ix_dp_sealed_accounts_cohort", "dp_sealed_accounts", ["cohort_id"])


def downgrade() -> None:
    connection = op.get_bind()
    if connection.dialect.name == "postgresql":
        op.execute("LOCK TABLE dp_sealed_accounts IN SHARE ROW EXCLUSIVE MODE")
    kept = connection.execute(sa.text("SELECT count(*) FROM dp_sealed_accounts")).scalar_one()
    if kept:
        raise RuntimeError(
            f"cannot downgrade below revision 0011: {kept} accounts of sealed windows keep "
            "their final spend, whose members revision 0010 would read as no account's"
        )
    op.drop_index("ix_dp_sealed_accounts_cohort", table_name="dp_sealed_accounts")
    op.drop_index("ix_dp_sealed_accounts_window", table_name="dp_sealed_accounts")
    op.drop_table("dp_sealed_accounts")
