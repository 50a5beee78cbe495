"""When each maintenance job last ran.

* ``dp_maintenance``: one row per job (``reap``, ``reset``, ``verify``) with the time, by
  the ledger's clock, its last run completed, and who ran it. ``status``, the UI and the
  release tasks warn when a job has not run within twice its interval (a maintenance
  DAG left paused or failing: crashed attempts uncharged, windows never sealed, the
  history unverified). Empty after the upgrade: a job counts as never run until its
  next run, and is overdue once the ledger is older than twice its interval.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "dp_maintenance",
        sa.Column("job", sa.String(16), primary_key=True),
        sa.Column("last_run_at", sa.String(40), nullable=False),
        sa.Column("actor", sa.Text(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("dp_maintenance")
