"""Stored releases: a re-run of a release is handed its stored answer, not charged again.

* ``dp_stored_releases``: per release identity (the digest of what the release is: its
  DAG, task, map index, data interval or window, mechanism and parameters, and whom it
  covers), the noisy answer of its last committed release, the receipt its task was given,
  and the digest the commit's history entry records.

A worker still running code of revision 0014 would charge a re-run again and store
nothing: the new revision refuses its writes (every write proves the revision it was
written for).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "dp_stored_releases",
        sa.Column("identity", sa.String(64), primary_key=True),
        sa.Column("reservation_id", sa.String(36), nullable=False, unique=True),
        sa.Column("document", sa.Text(), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.Column("receipt", sa.Text(), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("stored_at", sa.String(40), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("dp_stored_releases")
