"""Revision 0004: reservation key rows without a foreign key; ``verify`` checks them.

The foreign key cost a query per key row (10^5 of them for a release over 10^5
subjects). Without it the database accepts key rows of a reservation that does not
exist, so ``verify`` must report them, and a downgrade must refuse to restore the
constraint over such rows.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from dp_budget_provider.accounting import GaussianMechanism, LaplaceMechanism
from dp_budget_provider.ledger import BudgetCap, key_for
from tests.ledger.storage.test_history_chains import rows
from tests.ledger.storage.test_pending_and_server_paths import execute, migrate
from tests.ledger.storage.test_schema_matches_models import assert_schema_is_the_models

CAP = BudgetCap(epsilon=100.0, delta=1e-5)
WINDOW = "2026-w45"
LEDGER_WINDOWS = (WINDOW,)
ORPHAN = (
    "INSERT INTO dp_reservation_keys (reservation_id, position, tenant, subject, query_type, "
    "\"window\") VALUES ('no-such-reservation', 0, 'default', 'mallory', 'count', '2026-w45')"
)


def foreign_keys(url: str) -> list[dict]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            return sa.inspect(connection).get_foreign_keys("dp_reservation_keys")
    finally:
        engine.dispose()


def test_verify_reports_key_rows_of_no_reservation(ledger_url, make_ledger):
    ledger = make_ledger(cap=CAP, url=ledger_url)
    keys = [key_for(f"s{i}", "count", WINDOW) for i in range(3)]
    ledger.commit(ledger.reserve(keys, GaussianMechanism(5.0)))
    assert ledger.verify().ok
    execute(ledger_url, ORPHAN)
    report = ledger.verify()
    assert report.problems == [
        "reservation no-such-reservation: key rows of a reservation that does not exist"
    ]


def test_upgrade_drops_the_constraint_and_downgrade_restores_it(ledger_url, ledger_at, make_ledger):
    """From 0003 (with the constraint) to 0004 and back, keeping every row; the way
    back is refused while an orphan key row exists."""
    old = ledger_at(ledger_url, "0003", CAP)
    assert [fk["referred_table"] for fk in foreign_keys(ledger_url)] == ["dp_reservations"]
    keys = [key_for(f"s{i}", "count", WINDOW) for i in range(3)]
    old.commit(old.reserve(keys, GaussianMechanism(5.0)))
    old.spend(keys[0], LaplaceMechanism(2.0))
    key_rows = "SELECT * FROM dp_reservation_keys ORDER BY reservation_id, position"
    before = rows(ledger_url, key_rows)
    assert len(before) == 4

    migrate(ledger_url, "upgrade", "head")
    assert foreign_keys(ledger_url) == []
    assert rows(ledger_url, key_rows) == before
    ledger = make_ledger(url=ledger_url)
    assert ledger.verify().ok, ledger.verify().problems
    ledger.close()

    migrate(ledger_url, "downgrade", "0003")
    assert [fk["referred_table"] for fk in foreign_keys(ledger_url)] == ["dp_reservations"]
    assert rows(ledger_url, key_rows) == before

    migrate(ledger_url, "upgrade", "head")
    execute(ledger_url, ORPHAN)
    with pytest.raises(RuntimeError, match="1 reservation key rows belong to no reservation"):
        migrate(ledger_url, "downgrade", "0003")
    assert foreign_keys(ledger_url) == []
    assert_schema_is_the_models(ledger_url)  # the revisions taken down before it are back
    ledger = make_ledger(url=ledger_url)
    ledger.spend(keys[1], GaussianMechanism(5.0))  # the upgraded ledger works
