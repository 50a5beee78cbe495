"""Reservation key rows no longer carry a foreign key to their reservation.

A release over 10^5 subjects writes 10^5 ``dp_reservation_keys`` rows, and the foreign
key checked each of them with a query of its own: about 1.1 of its 2.4 seconds on
PostgreSQL (``bench/ledger.py``, many subjects). The rows are only ever written by the
ledger, in the transaction that writes their reservation, and nothing deletes
reservations. What the constraint guarded against (key rows of a reservation that does
not exist, e.g. one deleted in plain SQL) is now found by ``verify``, along with the
checks it already made: each reservation's key set against its digest, and every
history entry against its reservation.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_initial = importlib.import_module(
    "dp_budget_provider.ledger.storage.migrations.versions.0001_initial"
)

# PostgreSQL's default name for the constraint 0001 created.
_CONSTRAINT = "dp_reservation_keys_reservation_id_fkey"


def _keys_table(*, foreign_key: bool) -> sa.Table:
    """dp_reservation_keys as 0001 made it, with or without its foreign key (SQLite
    cannot drop or add a constraint in place: the table is copied to this shape)."""
    reference = [sa.ForeignKey("dp_reservations.id")] if foreign_key else []
    return sa.Table(
        "dp_reservation_keys",
        sa.MetaData(),
        sa.Column("reservation_id", sa.String(36), *reference, primary_key=True),
        sa.Column("position", sa.Integer, primary_key=True),
        *_initial._key_columns(),
        sa.Index("ix_dp_reservation_keys_key", "tenant", "subject", "query_type", "window"),
    )


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_constraint(_CONSTRAINT, "dp_reservation_keys", type_="foreignkey")
        return
    with op.batch_alter_table(
        "dp_reservation_keys", copy_from=_keys_table(foreign_key=False), recreate="always"
    ):
        pass


def downgrade() -> None:
    orphans = (
        op.get_bind()
        .execute(
            sa.text(
                "SELECT count(*) FROM dp_reservation_keys k WHERE NOT EXISTS "
                "(SELECT 1 FROM dp_reservations r WHERE r.id = k.reservation_id)"
            )
        )
        .scalar_one()
    )
    if orphans:
        raise RuntimeError(
            f"cannot downgrade below revision 0004: {orphans} reservation key rows belong to "
            "no reservation, which revision 0003's foreign key forbids (see `dp-budget verify`)"
        )
    if op.get_bind().dialect.name == "postgresql":
        op.create_foreign_key(
            _CONSTRAINT, "dp_reservation_keys", "dp_reservations", ["reservation_id"], ["id"]
        )
        return
    with op.batch_alter_table(
        "dp_reservation_keys", copy_from=_keys_table(foreign_key=True), recreate="always"
    ):
        pass
