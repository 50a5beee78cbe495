"""Reservation leases: an abandoned reservation is charged minutes after its worker died.

* ``dp_reservations.lease_expires_at``: until when the reserving attempt is known to be
  alive (``reserve`` sets it, the attempt renews it, ``reap`` charges an open
  reservation past it; NULL counts as run out).
* Every existing row gets its ``created_at``, so reservations open at upgrade time are
  charged by the next reap. That is the only safe choice: they were made by an earlier
  version, which never renews, and which cannot open a ledger at this revision anyway,
  so no live attempt can commit, release or renew them any more. Such a reservation may
  have touched the data: it is charged, never refunded.

Revision ID: 0007
Revises: 0006
Create Date: 2027-01-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN: a batch copy would rewrite every reservation row on SQLite.
    op.execute("ALTER TABLE dp_reservations ADD COLUMN lease_expires_at VARCHAR(40)")
    op.execute(sa.text("UPDATE dp_reservations SET lease_expires_at = created_at"))


def downgrade() -> None:
    # Revision 0006 reaps by age only: an open reservation is charged later, never less.
    op.execute("ALTER TABLE dp_reservations DROP COLUMN lease_expires_at")
