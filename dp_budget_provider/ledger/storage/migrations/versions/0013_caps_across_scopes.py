"""Caps across query types and across the windows of a horizon; caps as privacy filters.

* ``dp_policies.calendar_span``: how many windows one period of a policy's calendar spans
  (NULL: one). A cap across windows (``Policy(across="windows", horizon_windows=52)``)
  keeps its horizon's totals in periods of that many windows.
* ``dp_policies.filter_order``: the one Rényi order a scope's cap is checked at (a privacy
  filter, valid for adaptively chosen releases). NULL: the cap is checked on the epsilon
  the ledger reports, as before; every policy written before is such, and a charged scope
  keeps how its cap is checked.

Every release of code at this revision charges a subject's totals across query types and
windows next to its per-query-type accounts wherever such a cap is set. A worker still
running code of revision 0012 would charge only the per-query-type accounts: the new
revision refuses its writes (every write proves the revision it was written for).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("dp_policies") as batch:
        batch.add_column(sa.Column("calendar_span", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("filter_order", sa.Float(53), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("dp_policies") as batch:
        batch.drop_column("filter_order")
        batch.drop_column("calendar_span")
