"""Shares of a cap among principals (teams, pipelines).

* ``dp_policies.shares``: a scope's cap divided among named principals, each with the DAG
  ids that act for it and its part of the scope's Rényi budget (canonical JSON, part of
  the policy's signed record). NULL: the cap is not divided, as every policy written
  before.

Every release of code at this revision also charges its principal's share accounts
wherever a cap is divided. A worker still running code of revision 0013 would charge
only the scope's own accounts: the new revision refuses its writes (every write proves
the revision it was written for).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("dp_policies") as batch:
        batch.add_column(sa.Column("shares", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("dp_policies") as batch:
        batch.drop_column("shares")
