"""Initial ledger schema: config, policies, accounts, reservations, history, chain head.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

KEY = 256


def _key_columns() -> list[sa.Column]:
    return [
        sa.Column("tenant", sa.String(KEY), nullable=False),
        sa.Column("subject", sa.String(KEY), nullable=False),
        sa.Column("query_type", sa.String(KEY), nullable=False),
        sa.Column("window", sa.String(KEY), nullable=False),
    ]


def upgrade() -> None:
    op.create_table(
        "dp_ledger_config",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("delta", sa.Float(53), nullable=False),
        sa.Column("orders", sa.Text, nullable=False),
        sa.Column("conversion", sa.String(16), nullable=False),
        sa.Column("created_at", sa.String(40), nullable=False),
    )
    op.create_table(
        "dp_policies",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("tenant", sa.String(KEY), nullable=False),
        sa.Column("query_type", sa.String(KEY), nullable=False),
        sa.Column("cap_epsilon", sa.Float(53), nullable=False),
        sa.Column("warn_fraction", sa.Float(53), nullable=False),
        sa.Column("calendar", sa.String(16), nullable=False),
        sa.Column("calendar_length_seconds", sa.Integer, nullable=True),
        sa.Column("min_window_seconds", sa.Integer, nullable=False),
        sa.Column("compliance_clause", sa.Text, nullable=False),
        sa.Column("updated_at", sa.String(40), nullable=False),
        sa.UniqueConstraint("tenant", "query_type", name="uq_dp_policies_scope"),
    )
    op.create_table(
        "dp_accounts",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        *_key_columns(),
        sa.Column("rho", sa.Float(53), nullable=False),
        sa.Column("residual", sa.Text, nullable=True),
        sa.Column("gaussian_mu2", sa.Float(53), nullable=True),
        sa.Column("releases", sa.Integer, nullable=False),
        sa.Column("open_reservations", sa.Integer, nullable=False),
        sa.Column("updated_at", sa.String(40), nullable=False),
        sa.UniqueConstraint("tenant", "subject", "query_type", "window", name="uq_dp_accounts_key"),
    )
    op.create_index("ix_dp_accounts_window", "dp_accounts", ["window"])
    op.create_table(
        "dp_reservations",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("attempt_id", sa.String(1024), nullable=False, unique=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("mechanism", sa.Text, nullable=False),
        sa.Column("count", sa.Integer, nullable=False),
        sa.Column("cost_rho", sa.Float(53), nullable=False),
        sa.Column("cost_residual", sa.Text, nullable=True),
        sa.Column("cost_gaussian_mu2", sa.Float(53), nullable=True),
        sa.Column("key_count", sa.Integer, nullable=False),
        sa.Column("keys_digest", sa.String(64), nullable=False),
        sa.Column("prospective_epsilon", sa.Float(53), nullable=False),
        sa.Column("actor", sa.String(KEY), nullable=False),
        sa.Column("created_at", sa.String(40), nullable=False),
        sa.Column("resolved_at", sa.String(40), nullable=True),
    )
    op.create_index("ix_dp_reservations_state", "dp_reservations", ["state"])
    op.create_table(
        "dp_reservation_keys",
        sa.Column(
            "reservation_id", sa.String(36), sa.ForeignKey("dp_reservations.id"), primary_key=True
        ),
        sa.Column("position", sa.Integer, primary_key=True),
        *_key_columns(),
    )
    op.create_index(
        "ix_dp_reservation_keys_key",
        "dp_reservation_keys",
        ["tenant", "subject", "query_type", "window"],
    )
    op.create_table(
        "dp_history",
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("at", sa.String(40), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("actor", sa.String(KEY), nullable=False),
        sa.Column("reservation_id", sa.String(36), nullable=True),
        *[sa.Column(c.name, c.type, nullable=True) for c in _key_columns()],
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("prev_hash", sa.String(64), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
    )
    op.create_index("ix_dp_history_reservation_id", "dp_history", ["reservation_id"])
    op.create_index(
        "ix_dp_history_key", "dp_history", ["tenant", "subject", "query_type", "window"]
    )
    op.create_table(
        "dp_chain_head",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
    )


def downgrade() -> None:
    for table in (
        "dp_chain_head",
        "dp_history",
        "dp_reservation_keys",
        "dp_reservations",
        "dp_accounts",
        "dp_policies",
        "dp_ledger_config",
    ):
        op.drop_table(table)
