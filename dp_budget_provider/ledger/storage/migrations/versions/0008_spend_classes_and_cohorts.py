"""Spend classes and cohorts: a release is charged to classes of subjects, not to each one.

* ``dp_accounts.size``: how many subjects the account's class holds. Every account made
  before this revision holds one subject's spend, under that subject's own key: it is a
  class of one, labelled by its subject, so it gets size 1 and keeps every other column.
* ``dp_members`` names each subject's account in its (tenant, query type, window). It is
  filled with one row per existing account pointing at itself, so the first release at
  this revision finds every subject charged before it in the class it already has.
* ``dp_cohorts``, ``dp_cohort_members`` and ``dp_cohort_accounts``: the content-addressed
  sets of subjects releases are made over, and the accounts that partition each of them
  in a window; ``dp_charge_cohorts`` links each charge entry to the cohorts it covered
  (how a subject's history is found). They start empty: no release before this revision
  was recorded as one.
* Plain SQL, no batch copy: ``ADD COLUMN`` with a constant default rewrites no row (SQLite
  stores the default in the schema, PostgreSQL >= 11 in the catalogue), and the members
  are one ``INSERT ... SELECT`` (their secondary indexes are built after it, in one pass).

The way back is refused once revision 0008 code has made a class (a ``Class-`` label, or
a size other than 1) or registered a cohort: revision 0007 keeps spend per subject, so it
would charge a class's subjects again from zero, and the history would name cohorts whose
members only the dropped tables held (a later upgrade could never verify it again).

Revision ID: 0008
Revises: 0007
Create Date: 2027-01-18
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_KEY = 256
# 64-bit on PostgreSQL; SQLite's INTEGER is 64-bit already, and only it makes a row id
# primary key (dp_cohorts.id).
_BIG = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_CLASS_LABEL_PREFIX = "Class-"


def _key(name: str, *, primary_key: bool) -> sa.Column:
    return sa.Column(name, sa.String(_KEY), primary_key=primary_key, nullable=False)


def upgrade() -> None:
    op.add_column(
        "dp_accounts", sa.Column("size", _BIG, nullable=False, server_default=sa.text("1"))
    )
    op.create_table(
        "dp_members",
        *(_key(name, primary_key=False) for name in ("tenant", "query_type", "window", "subject")),
        _key("account", primary_key=False),
        sa.PrimaryKeyConstraint("tenant", "subject", "query_type", "window"),
    )
    op.execute(
        'INSERT INTO dp_members (tenant, query_type, "window", subject, account) '
        'SELECT tenant, query_type, "window", subject, subject FROM dp_accounts'
    )
    op.create_index(
        "ix_dp_members_account",
        "dp_members",
        ["tenant", "query_type", "window", "account", "subject"],
    )
    op.create_table(
        "dp_cohorts",
        sa.Column("id", _BIG, primary_key=True, autoincrement=True),
        _key("tenant", primary_key=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("size", _BIG, nullable=False),
        sa.Column("created_at", sa.String(40), nullable=False),
        sa.UniqueConstraint("tenant", "digest", name="uq_dp_cohorts_digest"),
    )
    op.create_table(
        "dp_cohort_members",
        sa.Column("cohort_id", _BIG, primary_key=True, autoincrement=False),
        _key("subject", primary_key=True),
    )
    op.create_index("ix_dp_cohort_members_subject", "dp_cohort_members", ["subject"])
    op.create_table(
        "dp_cohort_accounts",
        sa.Column("cohort_id", _BIG, primary_key=True, autoincrement=False),
        *(_key(name, primary_key=True) for name in ("query_type", "window", "account")),
    )
    op.create_table(
        "dp_charge_cohorts",
        sa.Column("seq", _BIG, primary_key=True, autoincrement=False),
        sa.Column("cohort_id", _BIG, primary_key=True, autoincrement=False),
        *(_key(name, primary_key=True) for name in ("query_type", "window")),
    )
    op.create_index(
        "ix_dp_charge_cohorts_cohort", "dp_charge_cohorts", ["cohort_id", "query_type", "window"]
    )


def downgrade() -> None:
    connection = op.get_bind()
    for count, why in (
        (
            # Not LIKE: SQLite's is case-insensitive, and "class-..." is a canonical subject.
            sa.text(
                "SELECT count(*) FROM dp_accounts "
                "WHERE substr(subject, 1, :length) = :prefix OR size <> 1"
            ).bindparams(length=len(_CLASS_LABEL_PREFIX), prefix=_CLASS_LABEL_PREFIX),
            "accounts hold the spend of a class of subjects, which revision 0007 would "
            "charge again from zero, subject by subject",
        ),
        (
            sa.text("SELECT count(*) FROM dp_cohorts"),
            "cohorts are named by the history, and their members would be lost",
        ),
    ):
        found = connection.execute(count).scalar_one()
        if found:
            raise RuntimeError(f"cannot downgrade below revision 0008: {found} {why}")
    op.drop_index("ix_dp_charge_cohorts_cohort", table_name="dp_charge_cohorts")
    op.drop_table("dp_charge_cohorts")
    op.drop_table("dp_cohort_accounts")
    op.drop_index("ix_dp_cohort_members_subject", table_name="dp_cohort_members")
    op.drop_table("dp_cohort_members")
    op.drop_table("dp_cohorts")
    op.drop_index("ix_dp_members_account", table_name="dp_members")
    op.drop_table("dp_members")
    # Plain DROP COLUMN (SQLite >= 3.35): a batch copy would rewrite every account row.
    op.execute("ALTER TABLE dp_accounts DROP COLUMN size")
