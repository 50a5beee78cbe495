"""TEMPORARY lead stub, replaced by the helper's revision."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

BIG = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.execute("ALTER TABLE dp_accounts ADD COLUMN size BIGINT DEFAULT 1 NOT NULL")
    op.create_table(
        "dp_members",
        sa.Column("tenant", sa.String(256), primary_key=True),
        sa.Column("query_type", sa.String(256), primary_key=True),
        sa.Column("window", sa.String(256), primary_key=True),
        sa.Column("subject", sa.String(256), primary_key=True),
        sa.Column("account", sa.String(256), nullable=False),
    )
    op.create_index(
        "ix_dp_members_account", "dp_members", ["tenant", "query_type", "window", "account"]
    )
    op.create_table(
        "dp_cohorts",
        sa.Column("id", BIG, primary_key=True, autoincrement=True),
        sa.Column("tenant", sa.String(256), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("size", BIG, nullable=False),
        sa.Column("created_at", sa.String(40), nullable=False),
        sa.UniqueConstraint("tenant", "digest", name="uq_dp_cohorts_digest"),
    )
    op.create_table(
        "dp_cohort_members",
        sa.Column("cohort_id", BIG, primary_key=True),
        sa.Column("subject", sa.String(256), primary_key=True),
    )
    op.create_table(
        "dp_cohort_accounts",
        sa.Column("cohort_id", BIG, primary_key=True),
        sa.Column("query_type", sa.String(256), primary_key=True),
        sa.Column("window", sa.String(256), primary_key=True),
        sa.Column("account", sa.String(256), primary_key=True),
    )
    op.execute(
        'INSERT INTO dp_members (tenant, query_type, "window", subject, account) '
        'SELECT tenant, query_type, "window", subject, subject FROM dp_accounts'
    )


def downgrade() -> None:
    raise NotImplementedError
