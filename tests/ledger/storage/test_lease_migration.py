"""Revision 0007: reservations get a lease; the ones open at upgrade time are due at once.

Reservations made before 0007 were made by a version that never renews them, and that
version cannot open a ledger at 0007 (nor this one a ledger at 0006), so nobody can ever
commit, release or renew them again: their lease is their creation time, and the next
reap charges them. Closed ones keep their state; the history is untouched and verifies.
"""

from __future__ import annotations

import pytest

from dp_budget_provider.accounting import GaussianMechanism, LaplaceMechanism
from dp_budget_provider.ledger import BudgetCap, LedgerSchemaError, PrivacyBudgetLedger, key_for
from tests.ledger.storage.test_history_chains import rows
from tests.ledger.storage.test_pending_and_server_paths import columns_of, migrate

CAP = BudgetCap(epsilon=100.0, delta=1e-5)
WINDOW = "2026-w45"
LEDGER_WINDOWS = (WINDOW,)
RESERVATIONS = "SELECT id, state, created_at, resolved_at FROM dp_reservations ORDER BY id"
LEASES = "SELECT created_at, lease_expires_at FROM dp_reservations"
HISTORY = "SELECT seq, action, payload, hash FROM dp_history ORDER BY seq"


def test_upgrade_from_0006_leases_every_row_at_its_creation_and_reap_charges_the_open(
    ledger_url, ledger_at, make_ledger
):
    old = ledger_at(ledger_url, "0006", CAP)
    keys = [key_for(f"s{i}", "count", WINDOW) for i in range(3)]
    old.commit(old.reserve(keys, GaussianMechanism(5.0)))
    old.release(old.reserve(keys[:1], LaplaceMechanism(2.0)), reason="never ran")
    abandoned = [
        old.reserve(keys[1:], GaussianMechanism(6.0)),
        old.reserve(keys[:1], LaplaceMechanism(3.0)),
    ]
    assert "lease_expires_at" not in columns_of(ledger_url, "dp_reservations")
    with pytest.raises(LedgerSchemaError, match="revision '0006'"):
        PrivacyBudgetLedger(url=ledger_url)  # and an 0006 package cannot open 0007
    reservations, entries = rows(ledger_url, RESERVATIONS), rows(ledger_url, HISTORY)

    migrate(ledger_url, "upgrade", "head")
    assert rows(ledger_url, RESERVATIONS) == reservations
    assert rows(ledger_url, HISTORY) == entries
    leases = rows(ledger_url, LEASES)
    assert len(leases) == 4 and all(lease == created for created, lease in leases)

    ledger = make_ledger(url=ledger_url)
    assert ledger.verify().ok, ledger.verify().problems
    held = {key: ledger.receipt(key).epsilon for key in keys}
    fresh = ledger.reserve(keys[2:], GaussianMechanism(9.0))  # this version's: leased ahead
    assert sorted(ledger.reap()) == sorted(r.id for r in abandoned)
    assert [r.id for r in ledger.open_reservations()] == [fresh.id]
    for reservation in abandoned:
        for key in reservation.keys:
            assert ledger.receipt(key).epsilon > held[key]  # charged, never refunded
    assert ledger.verify().ok, ledger.verify().problems


def test_down_and_up_again_a_leased_reservation_is_due_at_the_next_reap(
    ledger_url, ledger_at, make_ledger
):
    """A reservation open with a lease (made at 0007, leased ahead) taken down to 0006 and
    up again: the lease is re-derived from its creation, the reservation is due at the next
    reap, and nothing else changes."""
    old = ledger_at(ledger_url, "0007", CAP)
    leased = old.reserve([key_for("s0", "count", WINDOW)], GaussianMechanism(9.0))
    migrate(ledger_url, "upgrade", "head")
    ledger = make_ledger(url=ledger_url)
    assert ledger.reap() == []  # its lease has not run out
    ledger.close()
    reservations, entries = rows(ledger_url, RESERVATIONS), rows(ledger_url, HISTORY)
    assert [(created < lease) for created, lease in rows(ledger_url, LEASES)] == [True]

    migrate(ledger_url, "downgrade", "0006")
    migrate(ledger_url, "upgrade", "head")
    assert rows(ledger_url, RESERVATIONS) == reservations
    assert rows(ledger_url, HISTORY) == entries
    assert [(created == lease) for created, lease in rows(ledger_url, LEASES)] == [True]
    ledger = make_ledger(url=ledger_url)
    assert ledger.reap() == [leased.id]
    assert ledger.verify().ok, ledger.verify().problems
