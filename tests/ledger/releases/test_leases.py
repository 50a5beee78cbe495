"""Reservation leases (SQLite and PostgreSQL): set at reserve, renewed only by the reserving
attempt while open, and reaped (charged, never refunded) once run out; renewals write no
history and never let a reservation be refunded or closed twice.

The ledger's clock is ``ledger._now``: tests that move time patch it, as the model does.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import (
    BudgetCap,
    LedgerUnavailable,
    PrivacyBudgetLedger,
    ReservationClosed,
    ReservationStateError,
    key_for,
)
from dp_budget_provider.ledger.releases.lease import LeaseKeeper, check_lease, lease_of_seconds
from dp_budget_provider.ledger.storage import clock as ledger_clock

# Over 20 s in all: scheduled before the light files (tests/conftest.py).
pytestmark = pytest.mark.heavy

UTC = timezone.utc
CAP = BudgetCap(3.0, 1e-5)
LEDGER_WINDOWS = ("2026-w45",)
KEY = key_for("alice", "heatmap", "2026-w45")
NOISE = GaussianMechanism(4.0)
LEASE = timedelta(minutes=5)
START = datetime(2026, 11, 4, 12, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.moment = START

    def now(self) -> datetime:
        return self.moment


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(ledger_clock, "now", clock.now)
    return clock


def stamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def stored_lease(url: str, reservation_id: str) -> str | None:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            return connection.execute(
                sa.text("SELECT lease_expires_at FROM dp_reservations WHERE id = :id"),
                {"id": reservation_id},
            ).scalar_one()
    finally:
        engine.dispose()


def test_reserve_sets_the_lease_and_renew_moves_it_without_a_history_entry(
    ledger_url, make_ledger, clock
):
    ledger = make_ledger(CAP, url=ledger_url, lease=LEASE)
    reservation = ledger.reserve([KEY], NOISE)
    assert reservation.lease_expires_at == stamp(START + LEASE)
    assert stored_lease(ledger_url, reservation.id) == stamp(START + LEASE)
    assert ledger.open_reservations()[0].lease_expires_at == stamp(START + LEASE)
    entries = len(ledger.history())

    clock.moment = START + timedelta(minutes=4)
    assert ledger.renew(reservation) == START + timedelta(minutes=9)
    assert stored_lease(ledger_url, reservation.id) == stamp(START + timedelta(minutes=9))
    assert len(ledger.history()) == entries  # renewals are not facts of the history
    clock.moment = START + timedelta(minutes=6)  # past the first lease, within the renewed one
    assert ledger.reap() == []
    assert ledger.verify().ok


def test_only_the_reserving_attempt_renews_and_only_while_open(ledger_url, make_ledger, clock):
    ledger = make_ledger(CAP, url=ledger_url, lease=LEASE)
    committed, released, reaped = (ledger.reserve([KEY], NOISE) for _ in range(3))
    read_back = {r.id: r for r in ledger.open_reservations()}[committed.id]
    for handle in (read_back, dataclasses.replace(committed, token="not-the-token")):
        with pytest.raises(ReservationStateError, match="only the attempt"):
            ledger.renew(handle)
    with pytest.raises(ValueError, match="takes the Reservation"):
        ledger.renew(committed.id)  # type: ignore[arg-type]

    ledger.commit(committed)
    ledger.release(released, reason="never touched the data")
    clock.moment = START + LEASE
    assert ledger.reap() == [reaped.id]
    before = [stored_lease(ledger_url, r.id) for r in (committed, released, reaped)]
    for handle, state in ((committed, "committed"), (released, "released"), (reaped, "reaped")):
        with pytest.raises(ReservationClosed, match=f"was {state} at "):
            ledger.renew(handle)
    # Refused renewals changed nothing, and the closed reservations stay closed once.
    assert [stored_lease(ledger_url, r.id) for r in (committed, released, reaped)] == before
    with pytest.raises(ReservationStateError, match="cannot be released"):
        ledger.release(reaped, reason="a second close")
    epsilon = ledger.epsilon_of(KEY)
    assert ledger.commit(reaped)[0].epsilon == epsilon  # charged once, by the reap
    assert [e["action"] for e in ledger.history(KEY)].count("reap") == 1
    assert ledger.verify().ok


def test_reap_charges_run_out_leases_and_the_age_bound_also_renewed_ones(
    ledger_url, make_ledger, clock
):
    ledger = make_ledger(CAP, url=ledger_url, lease=LEASE)
    abandoned = ledger.reserve([KEY], NOISE)
    renewed = ledger.reserve([key_for("bob", "heatmap", "2026-w45")], NOISE)
    assert ledger.reap() == []
    clock.moment = START + timedelta(minutes=3)
    ledger.renew(renewed)
    clock.moment = START + LEASE  # the abandoned lease ends now: due
    assert ledger.reap() == [abandoned.id]
    assert ledger.epsilon_of(KEY) == pytest.approx(abandoned.prospective_epsilon)
    reap = [e for e in ledger.history() if e["action"] == "reap"][0]["payload"]
    assert reap["reason"] == (
        f"open since {stamp(START)}, its lease ran out at {stamp(START + LEASE)}"
    )
    assert reap["lease_expires_at"] == stamp(START + LEASE)

    # The age bound charges a renewed reservation too, naming the bound.
    assert ledger.reap(timedelta(hours=1)) == []
    assert ledger.reap(timedelta(minutes=5)) == [renewed.id]
    reason = [e for e in ledger.history() if e["action"] == "reap"][-1]["payload"]["reason"]
    assert reason == f"open since {stamp(START)}, older than 0:05:00"
    assert ledger.verify().ok


def test_a_renewal_landing_between_the_read_and_the_lock_saves_the_reservation(
    ledger_url, make_ledger, clock
):
    """reap decides each reservation again under its row lock: the one renewed meanwhile
    is left open, counted, and its attempt still commits it."""
    ledger = make_ledger(CAP, url=ledger_url, lease=LEASE)
    worker = make_ledger(url=ledger_url, lease=LEASE)
    reservation = worker.reserve([KEY], NOISE)
    clock.moment = START + LEASE + timedelta(seconds=1)
    write = ledger._database.write
    calls = []

    def renew_first() -> object:
        if not calls:
            calls.append(worker.renew(reservation))
        return write()

    ledger._database.write = renew_first  # type: ignore[method-assign]
    assert ledger.reap() == []
    assert calls == [START + 2 * LEASE + timedelta(seconds=1)]
    assert [r.id for r in ledger.open_reservations()] == [reservation.id]
    assert worker.commit(reservation)[0].epsilon == pytest.approx(reservation.prospective_epsilon)
    assert ledger.verify().ok


def test_a_reservation_without_a_lease_is_reaped(ledger_url, make_ledger, clock):
    """NULL (written by hand: the ledger always sets one) counts as run out."""
    ledger = make_ledger(CAP, url=ledger_url, lease=LEASE)
    reservation = ledger.reserve([KEY], NOISE)
    engine = sa.create_engine(ledger_url)
    with engine.begin() as connection:
        connection.execute(sa.text("UPDATE dp_reservations SET lease_expires_at = NULL"))
    engine.dispose()
    assert ledger.reap() == [reservation.id]
    reason = ledger.history()[-1]["payload"]["reason"]
    assert reason == f"open since {stamp(START)}, without a lease"
    assert ledger.verify().ok


def test_reaping_at_a_moment_before_the_year_1000_charges_nothing(make_ledger):
    """Stamps are fixed-width for every year, so string order is time order."""
    ledger = make_ledger(CAP)
    ledger.reserve([KEY], NOISE)
    assert ledger.reap(timedelta(0), now=datetime(999, 1, 1, tzinfo=UTC)) == []
    assert ledger_clock.stamp(datetime(999, 1, 1, tzinfo=UTC)) == "0999-01-01T00:00:00.000000Z"


@pytest.mark.parametrize("lease", [timedelta(0), timedelta(seconds=0.5), timedelta(days=2), 300])
def test_a_lease_out_of_bounds_is_refused(lease):
    with pytest.raises(ValueError, match="lease must be a timedelta from 0:00:01 to 1 day"):
        PrivacyBudgetLedger(CAP, lease=lease)


@pytest.mark.parametrize("text", ["", "abc", "0", "0.5", "nan", "inf", "-300", "86401", "1e30"])
def test_a_lease_option_out_of_bounds_is_refused_naming_the_option(text):
    with pytest.raises(ValueError, match=r"^\[dp_budget\] lease_seconds must be a number of"):
        lease_of_seconds(text, "[dp_budget] lease_seconds")
    assert lease_of_seconds("300", "x") == timedelta(minutes=5) == check_lease(LEASE)


# ---------------------------------------------------------------------- the keeper thread


def test_keep_alive_renews_while_the_block_runs_and_stops_with_it(ledger_url, make_ledger):
    ledger = make_ledger(CAP, url=ledger_url, lease=timedelta(seconds=1.5))
    reservation = ledger.reserve([KEY], NOISE)
    with ledger.keep_alive(reservation) as keeper:
        time.sleep(2.2)
        assert ledger.reap() == []  # past the first lease: alive
    assert keeper.renewals >= 2 and keeper.failures == 0 and keeper.closed is None
    assert not keeper._thread.is_alive()
    last = stored_lease(ledger_url, reservation.id)
    assert last > reservation.lease_expires_at
    time.sleep(1.6)  # the renewals stopped with the block
    assert stored_lease(ledger_url, reservation.id) == last
    assert ledger.reap() == [reservation.id]
    assert ledger.verify().ok


def test_keep_alive_stops_when_the_reservation_was_reaped_and_says_so(
    ledger_url, make_ledger, caplog
):
    ledger = make_ledger(CAP, url=ledger_url, lease=timedelta(seconds=1.2))
    reservation = ledger.reserve([KEY], NOISE)
    with caplog.at_level(logging.WARNING), ledger.keep_alive(reservation) as keeper:
        later = datetime.now(UTC) + timedelta(hours=1)
        assert ledger.reap(now=later) == [reservation.id]
        time.sleep(1.0)
    assert isinstance(keeper.closed, ReservationClosed)
    assert f"the lease of reservation {reservation.id} is no longer renewed" in caplog.text
    assert "was reaped at" in caplog.text
    assert ledger.commit(reservation)[0].epsilon == pytest.approx(reservation.prospective_epsilon)
    assert [e["action"] for e in ledger.history(KEY)] == ["reserve", "reap"]


def test_a_failed_renewal_is_a_warning_and_the_next_beat_tries_again(make_ledger, caplog):
    """A database that fails once (injected into the real renewal): warned, then renewed."""
    ledger = make_ledger(CAP, lease=timedelta(seconds=1.2))
    reservation = ledger.reserve([KEY], NOISE)
    outcomes: list[object] = [LedgerUnavailable("ledger database sqlite:// failed: gone")]

    def renew() -> datetime:
        if outcomes:
            raise outcomes.pop()  # type: ignore[misc]
        return ledger.renew(reservation)

    keeper = LeaseKeeper(renew, ledger.lease, reservation.id)
    with caplog.at_level(logging.WARNING), keeper:
        time.sleep(1.1)
    assert keeper.failures == 1 and keeper.renewals >= 1 and keeper.closed is None
    assert f"could not renew the lease of reservation {reservation.id}" in caplog.text
    assert "LedgerUnavailable: ledger database sqlite:// failed: gone" in caplog.text
    assert "the next reap charges the reservation" in caplog.text


def test_an_in_memory_ledger_serialises_a_thread_renewing_beside_releases(make_ledger):
    """The private in-memory ledger has one connection: the renewing thread and the
    releases take turns on it, never interleaving their transactions."""
    ledger = make_ledger(BudgetCap(1e6, 1e-5), lease=timedelta(seconds=1))
    reservation = ledger.reserve([KEY], NOISE)
    errors: list[BaseException] = []
    done = threading.Event()
    spent = []

    def releases() -> None:
        try:
            while not done.is_set():
                spent.append(
                    ledger.spend(key_for(f"s{len(spent) % 5}", "heatmap", KEY.window), NOISE)
                )
        except BaseException as error:  # reported to the test below
            errors.append(error)

    spender = threading.Thread(target=releases)
    with ledger.keep_alive(reservation) as keeper:
        spender.start()
        time.sleep(1.2)
        done.set()
        spender.join(60)
    assert not errors, errors
    assert keeper.failures == 0 and keeper.renewals >= 2 and len(spent) > 10
    assert ledger.verify().ok


LEASE_EDITS = {
    "null": "NULL",
    "long past": "'1970-01-01T00:00:00.000000Z'",
    "far future": "'9999-12-31T23:59:59.999999Z'",
    "not a time": "'never'",
    "bytes": "x'00'",  # a BLOB in SQLite's text column, read back as bytes (PostgreSQL: text only)
}
EDITED_LEASES = [
    (backend, edit)
    for backend in ("sqlite_url", "postgres_url")
    for edit in LEASE_EDITS
    if (backend, edit) != ("postgres_url", "bytes")
]


@pytest.mark.parametrize(("backend", "edit"), EDITED_LEASES)
def test_an_edited_lease_only_moves_its_charge_and_never_stops_the_reap(
    request, make_ledger, clock, backend, edit
):
    """verify leaves the lease column to insiders (the tamper matrix exempts it), so an
    edit of it must only make its reservation charged earlier, or later until the age
    bound: charged once, never refunded, and never a reap that fails on it (which would
    leave every reservation after it held, each maintenance run)."""
    ledger_url = request.getfixturevalue(backend)
    ledger = make_ledger(CAP, url=ledger_url, lease=LEASE)
    edited = ledger.reserve([KEY], NOISE)
    engine = sa.create_engine(ledger_url)
    with engine.begin() as connection:
        connection.execute(
            sa.text(f"UPDATE dp_reservations SET lease_expires_at = {LEASE_EDITS[edit]}")
        )
    engine.dispose()
    early = edit in ("null", "long past")
    clock.moment = START + timedelta(minutes=6)
    assert ledger.reap() == ([edited.id] if early else [])
    dead = ledger.reserve([key_for("bob", "heatmap", KEY.window)], NOISE)  # dies at once

    clock.moment = START + timedelta(days=1, minutes=1)
    assert ledger.reap(timedelta(days=1)) == ([dead.id] if early else [edited.id, dead.id])
    for reservation in (edited, dead):
        epsilon = reservation.prospective_epsilon  # alone on its key: charged once
        assert ledger.commit(reservation)[0].epsilon == pytest.approx(epsilon)
        with pytest.raises(ReservationStateError, match="cannot be released"):
            ledger.release(reservation, reason="a refund")
    assert [e["action"] for e in ledger.history(KEY)] == ["reserve", "reap"]
    assert ledger.verify().ok
