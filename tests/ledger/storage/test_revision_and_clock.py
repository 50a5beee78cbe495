"""Every write proves its schema revision; on PostgreSQL the server's clock decides.

* Code of another revision never writes: a real process running this checkout's code is
  refused every kind of write once a newer release's ``dp-budget db upgrade`` has taken
  the database past it, and a revision changed under an open ledger stops the next write.
  Nothing is written either time.
* A migration waits for the writes under way, and a write that begins after the
  migration's lock waits for it and then reads the new revision.
* On PostgreSQL the ledger's time is the server's: stamps come from it, and a worker whose
  own clock is off by more than the bound is refused.

"The previous revision's code" is this checkout's code facing a database one revision
newer than its head: a test-only migration (:data:`NEWER`, written to a scratch folder as
a newer release would ship it) applied on top of today's schema. Downgrading the database
instead would leave today's models reading columns the older schema lacks; this way the
schema is always the one the code was written for, whatever migrations come next, and
only the revision differs.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import BudgetCap, ClockSkew, LedgerSchemaError, Policy, key_for
from dp_budget_provider.ledger.storage import clock, database
from tests.admin import ADMIN
from tests.ledger import revision_workers

CAP = BudgetCap(epsilon=2.0, delta=1e-5)
MECHANISM = GaussianMechanism(8.0)
HEAD = database.head_revision()


def _previous() -> str:
    """The revision before the head, from the migrations (whatever the head is)."""
    config = Config()
    config.set_main_option("script_location", str(database.MIGRATIONS))
    down = ScriptDirectory.from_config(config).get_revision(HEAD).down_revision
    assert isinstance(down, str)
    return down


PREVIOUS = _previous()
# The revision of a newer release than this code: test-only, shipped by no release (the
# version table's column holds 32 characters).
NEWER = f"newer_than_{HEAD}"[:32]
assert NEWER not in (HEAD, PREVIOUS)

_NEWER_MIGRATION = '''"""A newer release's migration, for the tests only: it follows {head!r}.

What it changes is immaterial to the tests: a write proves the revision first thing, so
code of the revisions before is refused before it reads any table.
"""

revision = {newer!r}
down_revision = {head!r}
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
'''


def _upgrade_to_a_newer_release(engine: sa.Engine, folder: Path) -> str:
    """``dp-budget db upgrade`` of a newer release, which ships one more migration
    (:data:`NEWER`); returns the revision the database is at afterwards.

    A real migration step, run as :func:`database.upgrade` runs it: in a
    :func:`database.migrating` transaction, through the package's alembic environment
    (``migrations/env.py``, which takes :func:`database.lock_revision` first thing), to
    the head of the package's migrations plus the newer release's, from ``folder``.
    """
    (folder / f"{NEWER}.py").write_text(_NEWER_MIGRATION.format(head=HEAD, newer=NEWER))
    with database.migrating(engine) as connection:
        config = Config()
        config.set_main_option("script_location", str(database.MIGRATIONS))
        config.set_main_option("path_separator", "os")
        shipped = database.MIGRATIONS / "versions"
        config.set_main_option("version_locations", os.pathsep.join([str(shipped), str(folder)]))
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
        return database.current_revision(connection) or ""


def _contents(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table of the ledger's database, sorted: what "nothing was
    written" compares."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            tables = sa.inspect(connection).get_table_names()
            return {
                table: sorted(
                    (tuple(row) for row in connection.execute(sa.text(f'SELECT * FROM "{table}"'))),
                    key=repr,
                )
                for table in tables
            }
    finally:
        engine.dispose()


def _set_revision(url: str, revision: str) -> None:
    """Record ``revision`` as the database's, under the lock a migration takes (the schema
    itself stays this code's)."""
    engine = database.make_engine(url)
    try:
        with database.migrating(engine) as connection:
            database.lock_revision(connection)
            connection.execute(
                sa.text(f"UPDATE {database.VERSION_TABLE} SET version_num = :revision"),
                {"revision": revision},
            )
    finally:
        engine.dispose()


def _handed(ledger: Any) -> dict[str, Any]:
    """What the writes of ``revision_workers.writes`` work on: an open reservation of
    this ledger, a key of the current window and its twin of another query type."""
    window = ledger.windows_for("t", "q", datetime.now(UTC))[0]
    key = key_for("s1", "q", window, tenant="t")
    reservation = ledger.reserve(key, MECHANISM, attempt="current-code")
    return {
        "key": key,
        "other": key_for("s1", "q2", window, tenant="t"),
        "reservation": reservation,
        "long_after": datetime.now(UTC) + timedelta(days=3650),
    }


def test_code_of_the_previous_revision_is_refused_every_write_after_an_upgrade(
    ledger_url, make_ledger, monkeypatch, tmp_path
):
    """The rolling upgrade of issue 23: a worker opened the ledger at its own revision and
    kept running after a newer release's ``dp-budget db upgrade``. It is a real process
    (this checkout's code, unpatched: the previous revision's code to the upgraded
    database); its writes are all refused, and the database holds exactly what it held
    before they were tried."""
    make_ledger(cap=CAP, url=ledger_url, admin=ADMIN).close()
    spawn = multiprocessing.get_context("spawn")
    ready, go, results = spawn.Queue(), spawn.Queue(), spawn.Queue()
    worker = spawn.Process(
        target=revision_workers.older_code,
        args=(ledger_url, ADMIN.to_pem(), ready, go, results),
    )
    worker.start()
    try:
        assert ready.get(timeout=revision_workers.TIMEOUT) == revision_workers.READY
        engine = database.make_engine(ledger_url)
        try:
            assert _upgrade_to_a_newer_release(engine, tmp_path) == NEWER
        finally:
            engine.dispose()
        monkeypatch.setattr(database, "head_revision", lambda: NEWER)  # this is the newer code
        ledger = make_ledger(url=ledger_url, admin=ADMIN)
        handed = _handed(ledger)
        before = _contents(ledger_url)
        go.put(handed)
        report = results.get(timeout=revision_workers.TIMEOUT)
    finally:
        worker.join(timeout=revision_workers.TIMEOUT)
        if worker.is_alive():
            worker.kill()
    assert "error" not in report, report
    outcomes = report["outcomes"]
    assert len(outcomes) == 13
    for name, outcome in outcomes.items():
        assert outcome.startswith("LedgerSchemaError: "), (name, outcome)
        assert f"revision {NEWER!r}" in outcome and f"revision {HEAD!r}" in outcome, outcome
    assert _contents(ledger_url) == before
    # The newer code's reservation was left as it was, and the current code writes.
    assert ledger.commit(handed["reservation"])[0].epsilon > 0
    assert ledger.verify().ok


@pytest.mark.parametrize("revision", [NEWER, PREVIOUS])
def test_a_revision_changed_under_an_open_ledger_stops_its_next_write(
    ledger_url, make_ledger, revision
):
    """The revision is proven by every write, not when the ledger was opened: changed
    under an open ledger (upgraded past it, or taken back), the next write fails closed
    and writes nothing; put back, the same ledger writes again."""
    ledger = make_ledger(cap=CAP, url=ledger_url, admin=ADMIN)
    handed = _handed(ledger)
    _set_revision(ledger_url, revision)
    before = _contents(ledger_url)
    outcomes = revision_workers.attempt_all(ledger, handed)
    assert len(outcomes) == 13
    for name, outcome in outcomes.items():
        assert outcome.startswith("LedgerSchemaError: "), (name, outcome)
        assert f"revision {revision!r}" in outcome and f"revision {HEAD!r}" in outcome, outcome
    assert _contents(ledger_url) == before
    _set_revision(ledger_url, HEAD)
    assert ledger.commit(handed["reservation"])[0].epsilon > 0


def _one_value(url: str, sql: str, **params: Any) -> Any:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            return connection.execute(sa.text(sql), params).scalar_one()
    finally:
        engine.dispose()


def _waiting_on_a_lock(url: str, statement: str) -> bool:
    """Whether a session of ``url``'s database waits on a lock, running ``statement``."""
    return (
        _one_value(
            url,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query LIKE :statement",
            statement=f"%{statement}%",
        )
        > 0
    )


def _until(condition: Any, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


class _Run(threading.Thread):
    """A call on a thread of its own, keeping what it returned or raised."""

    def __init__(self, call: Any) -> None:
        super().__init__(daemon=True)
        self.call, self.result, self.error = call, None, None

    def run(self) -> None:
        try:
            self.result = self.call()
        except BaseException as error:
            self.error = error


def test_an_upgrade_waits_for_the_write_under_way_and_later_writes_see_its_revision(
    ledger_url, make_ledger, tmp_path
):
    """A write under way holds the migration off until it commits (both backends: the
    two can never interleave). On PostgreSQL a write that begins while the migration
    holds its lock waits for the migration's commit and then reads the new revision, so
    code of the old revision is refused.

    The migration is a real one (a newer release's :data:`NEWER`, through the package's
    alembic environment and so its ``lock_revision``), not the version bumped by hand:
    what is tested is that every migration takes the lock the writes prove under; this
    checkout's code is the older code."""
    ledger = make_ledger(cap=CAP, url=ledger_url, admin=ADMIN)
    engine = database.make_engine(ledger_url)
    postgresql = engine.dialect.name == "postgresql"
    try:
        upgrade = _Run(lambda: _upgrade_to_a_newer_release(engine, tmp_path))
        later = _Run(lambda: ledger.set_policy(Policy(cap_epsilon=50.0, tenant="t")))
        with ledger._database.write():  # a write under way, proven at this code's revision
            upgrade.start()
            if postgresql:
                assert _until(lambda: _waiting_on_a_lock(ledger_url, "LOCK TABLE"))
                later.start()
                assert _until(lambda: _waiting_on_a_lock(ledger_url, "FOR SHARE"))
            else:
                time.sleep(1.0)
            assert upgrade.is_alive()  # waiting for this write
        upgrade.join(timeout=60)
        assert upgrade.error is None and upgrade.result == NEWER
        if postgresql:
            later.join(timeout=60)
            assert isinstance(later.error, LedgerSchemaError), later.error
            assert f"revision {NEWER!r}" in str(later.error)
    finally:
        engine.dispose()


# ---------------------------------------------------------------------- the server's clock


def _server_now(url: str) -> datetime:
    return _one_value(url, "SELECT clock_timestamp()")


def _skewed(monkeypatch, by: timedelta) -> None:
    """This worker's clock only (not the server's, not the ledger's time in tests)."""
    real = clock.process_now
    monkeypatch.setattr(clock, "process_now", lambda: real() + by)


def test_a_worker_whose_clock_is_off_is_refused_on_postgresql(
    postgres_url, make_ledger, monkeypatch
):
    ledger = make_ledger(cap=CAP, url=postgres_url, admin=ADMIN)
    handed = _handed(ledger)
    before = _contents(postgres_url)
    _skewed(monkeypatch, timedelta(minutes=-10))
    outcomes = revision_workers.attempt_all(ledger, handed)
    assert len(outcomes) == 13
    for name, outcome in outcomes.items():
        assert outcome.startswith("ClockSkew: "), (name, outcome)
        assert "disagree by more than 5 s" in outcome
    assert _contents(postgres_url) == before
    # The error names both times: the worker's, ten minutes behind, and the server's.
    start = _server_now(postgres_url)
    with pytest.raises(ClockSkew) as refused:
        ledger.renew(handed["reservation"])
    end = _server_now(postgres_url)
    worker, server = (
        datetime.fromisoformat(moment) for moment in re.findall(r"reads (\S+Z)", str(refused.value))
    )
    assert start <= server <= end
    assert abs(server - worker - timedelta(minutes=10)) < timedelta(seconds=1)


def test_the_bound_on_a_workers_clock_is_the_ledgers_own(postgres_url, make_ledger, monkeypatch):
    """3 s off passes the default bound (5 s), not a bound of 1 s."""
    make_ledger(cap=CAP, url=postgres_url, admin=ADMIN).close()
    _skewed(monkeypatch, timedelta(seconds=3))
    make_ledger(url=postgres_url, admin=ADMIN).set_policy(Policy(cap_epsilon=3.0, tenant="t"))
    strict = make_ledger(url=postgres_url, clock_skew=timedelta(seconds=1), admin=ADMIN)
    with pytest.raises(ClockSkew, match="more than 1 s"):
        strict.set_policy(Policy(cap_epsilon=3.0, tenant="u"))
    for bound in (timedelta(0), timedelta(hours=2), 5):
        with pytest.raises(ValueError, match="clock_skew"):
            make_ledger(url=postgres_url, clock_skew=bound)


def test_on_postgresql_the_ledger_stamps_with_the_servers_clock(
    postgres_url, make_ledger, monkeypatch
):
    """A worker 4 s ahead (within the bound) writes the server's moments, not its own:
    the reservation's creation and lease, its history entry, the window's first charge."""
    ledger = make_ledger(cap=CAP, url=postgres_url, lease=timedelta(minutes=5))
    _skewed(monkeypatch, timedelta(seconds=4))
    start = _server_now(postgres_url)
    handed = _handed(ledger)
    end = _server_now(postgres_url)
    created = datetime.fromisoformat(handed["reservation"].created_at)
    assert start <= created <= end
    assert clock.process_now() - created > timedelta(seconds=3)
    lease = datetime.fromisoformat(handed["reservation"].lease_expires_at)
    assert lease == created + timedelta(minutes=5)
    entry = ledger.history(limit=1, newest_first=True)[0]
    assert (entry["action"], entry["at"]) == ("reserve", handed["reservation"].created_at)
    renewed = ledger.renew(handed["reservation"])
    assert renewed - timedelta(minutes=5) <= _server_now(postgres_url)


def test_sqlite_keeps_the_process_clock(sqlite_url, make_ledger, monkeypatch):
    """SQLite is embedded: the worker's clock is its database's, so nothing to compare."""
    ledger = make_ledger(cap=CAP, url=sqlite_url)
    _skewed(monkeypatch, timedelta(minutes=10))
    handed = _handed(ledger)
    created = datetime.fromisoformat(handed["reservation"].created_at)
    assert abs(created - clock.process_now()) < timedelta(seconds=5)


def test_tests_still_move_the_ledgers_time_on_postgresql(postgres_url, make_ledger, monkeypatch):
    """Patching ``clock.now`` moves the ledger's time on both backends (the server's
    clock is not consulted for it), and is no skewed worker."""
    ledger = make_ledger(cap=CAP, url=postgres_url)
    moment = datetime(2030, 3, 6, 12, tzinfo=UTC)
    monkeypatch.setattr(clock, "now", lambda: moment)
    reservation = ledger.reserve(key_for("s", "q", "2030-w10", tenant="t"), MECHANISM)
    assert reservation.created_at == clock.stamp(moment)
