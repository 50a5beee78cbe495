"""Classes that refer to their cohort: a cohort new to its window writes no member rows.

* ``dp_accounts.cohort_id``: set on a class whose members are exactly one cohort's (the
  class a cohort makes of subjects its window has never seen, when it covers none of the
  window's classes). Its members are then read through the cohort, never copied into
  ``dp_members``, until a later cohort splits the class. Every account made before this
  revision has its members in ``dp_members``: NULL, no row rewritten.
* ``ix_dp_accounts_cohort``: the classes that refer to a cohort (a subject's classes, found
  through the cohorts that hold it).

The way back is refused once a class refers to its cohort: revision 0008 would find its
subjects in no class (and charge them again from zero), and the history records its
members as its cohort's, which an account of copied members would contradict on the way
up again.

Revision ID: 0009
Revises: 0008
Create Date: 2027-02-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_BIG = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.add_column("dp_accounts", sa.Column("cohort_id", _BIG, nullable=True))
    op.create_index("ix_dp_accounts_cohort", "dp_accounts", ["cohort_id"])


def downgrade() -> None:
    connection = op.get_bind()
    if connection.dialect.name == "postgresql":
        # No release may make a class that refers to its cohort between the count and the
        # drop (its subjects would be left in no class). SQLite's writers are serialised.
        op.execute("LOCK TABLE dp_accounts IN SHARE ROW EXCLUSIVE MODE")
    referring = connection.execute(
        sa.text("SELECT count(*) FROM dp_accounts WHERE cohort_id IS NOT NULL")
    ).scalar_one()
    if referring:
        raise RuntimeError(
            f"cannot downgrade below revision 0009: {referring} classes refer to their cohort "
            "for their members, which revision 0008 would find in no class"
        )
    op.drop_index("ix_dp_accounts_cohort", table_name="dp_accounts")
    # Plain DROP COLUMN (SQLite >= 3.35): a batch copy would rewrite every account row.
    op.execute("ALTER TABLE dp_accounts DROP COLUMN cohort_id")
