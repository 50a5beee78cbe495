"""A database insider edits the ledger: verify names it, and releases stop (quarantine).

One ledger with a history of every kind (policies, one- and many-key releases, open,
released and reaped reservations, a correction, a re-scope, a sealed window) is built
once per backend; each case works on a copy of it. The matrix edits every column of
every ledger table, deletes a row of each, truncates the history's tail, and recomputes
the chain without the key.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import sqlalchemy as sa

from dp_budget_provider.accounting import GaussianMechanism, LaplaceMechanism
from dp_budget_provider.ledger import (
    BudgetCap,
    LedgerConfigMismatch,
    LedgerCorrupt,
    LedgerError,
    LedgerQuarantined,
    Policy,
    key_for,
)
from dp_budget_provider.ledger.audit.checkpoints import Checkpoint, CheckpointFile
from dp_budget_provider.ledger.releases.identity import ReleaseIdentity, ReleaseSlot
from dp_budget_provider.ledger.releases.stored import Keep
from dp_budget_provider.ledger.storage import clock as ledger_clock
from dp_budget_provider.ledger.storage import history
from dp_budget_provider.ledger.windows.shares import Share
from tests.admin import AdminLedger
from tests.ledger.storage.test_pending_and_server_paths import execute
from tests.scratch_postgres import PG_ADMIN_DSN, scratch_database, url_of

UTC = timezone.utc
DELTA = 1e-5
KEY = "test-chain-key-0123456789abcdef"
CLOCK = {"now": datetime(2026, 11, 4, 12, tzinfo=UTC)}
PROBE = key_for("probe", "heatmap", "2026-w49")

# Columns whose edit changes no fact, so verify has nothing to prove about them.
SURROGATE = {
    ("dp_accounts", "id"): "a surrogate key nothing refers to (reservations name keys)",
    ("dp_policies", "id"): "a surrogate key nothing refers to (policies are found by scope)",
    ("dp_ledger_config", "policy_version"): "a cache counter: a change only makes "
    "processes re-read the policies",
    ("dp_reservations", "lease_expires_at"): "when an open reservation is reaped, never "
    "whether it is charged: renewals are no history, and an edit only moves the reap's charge "
    "earlier, or later until reap_after (test_leases: an edited lease only moves its charge)",
}
TOKENS = {
    "dp_accounts": "account",
    "dp_reservations": "reservation",
    "dp_reservation_keys": "reservation",
    "dp_history": "entry",
    "dp_chain_head": "chain",
    "dp_windows": "window",
    "dp_policies": "polic",
    "dp_ledger_config": "dp_ledger_config",
    "dp_stored_releases": "dp_stored_releases",
}


def _clock() -> datetime:
    return CLOCK["now"]


def build(url: str) -> None:
    """A keyed ledger whose history holds every kind of entry, every column in use."""
    CLOCK["now"] = datetime(2026, 11, 4, 12, tzinfo=UTC)
    ledger = AdminLedger(BudgetCap(3.0, DELTA), url=url, chain_key=KEY, actor="builder")
    try:
        ledger.set_policy(
            Policy(2.5, tenant="acme", query_type="counts", compliance_clause="GDPR Art. 25")
        )
        alice, bob = key_for("alice", "heatmap", "2026-w45"), key_for("bob", "heatmap", "2026-w45")
        ledger.spend(alice, GaussianMechanism(3.0))
        ledger.commit(ledger.reserve([alice, bob], LaplaceMechanism(0.25)))
        ledger.correct(bob, GaussianMechanism(5.0), reason="a missed release")
        snap = key_for("dave", "snapshot", "2026-w45")
        ledger.spend(snap, GaussianMechanism(3.0))
        ledger.rescope(snap, key_for("dave", "trajectory", "2026-w45"), reason="re-scored")
        # acme's subjects' totals across query types and across a horizon of windows.
        ledger.set_policy(Policy(4.0, tenant="acme", across="query_types", filter_order="auto"))
        ledger.set_policy(Policy(6.0, tenant="acme", across="windows", horizon_windows=52))
        ledger.spend(key_for("x", "counts", "2026-w45", tenant="acme"), GaussianMechanism(4.0))
        ledger.spend(key_for("x", "heatmap", "2026-w45", tenant="acme"), GaussianMechanism(4.0))
        missed = key_for("y", "counts", "2026-w45", tenant="acme")
        ledger.correct(missed, GaussianMechanism(5.0), reason="missed")
        # beta's total across query types divided between two principals.
        shares = (Share("team", 0.5, ("etl_team",)), Share("other", 0.25, ("etl_other",)))
        ledger.set_policy(
            Policy(5.0, tenant="beta", across="query_types", filter_order="auto", shares=shares)
        )
        shared = key_for("z", "counts", "2026-w45", tenant="beta")
        ledger.spend(shared, GaussianMechanism(4.0), attempt="etl_team/release/manual/-1/1/u1")
        CLOCK["now"] = datetime(2026, 12, 1, 12, tzinfo=UTC)
        assert ledger.reset("2026-w45") == 12
        erin, frank = (
            key_for("erin", "heatmap", "2026-w49"),
            key_for("frank", "heatmap", "2026-w49"),
        )
        ledger.spend(erin, GaussianMechanism(3.0))
        # A release whose commit kept its answer, and a re-run handed it.
        identity = ReleaseIdentity.of(
            ReleaseSlot.in_window("etl", "heatmap", -1, "2026-w49", CLOCK["now"], CLOCK["now"]),
            {"count": 1},
            [frank],
        )
        kept = Keep.of(identity, [3.5, 4.25], {"reservation_id": "kept", "epsilon": 0.5})
        ledger.commit(ledger.reserve(frank, GaussianMechanism(3.0)), kept)
        assert ledger.reuse(identity, "etl/heatmap/rerun") is not None
        ledger.reserve([erin, frank], LaplaceMechanism(0.25))  # stays open: pending residual
        ledger.reserve(erin, GaussianMechanism(6.0))  # stays open: pending mu^2
        ledger.release(
            ledger.reserve(key_for("gina", "heatmap", "2026-w49"), GaussianMechanism(4.0))
        )
        ledger.reserve(key_for("hank", "heatmap", "2026-w49"), GaussianMechanism(4.0))
        ledger.spend(key_for("x", "counts", "2026-w49", tenant="acme"), GaussianMechanism(4.0))
        CLOCK["now"] = datetime(2026, 12, 1, 13, tzinfo=UTC)
        ledger.reap(timedelta(minutes=30), now=CLOCK["now"])
        report = ledger.verify()
        assert report.ok, report.problems
        assert report.keyed
    finally:
        ledger.close()


class Copies:
    """Fresh copies of a ledger ``make`` builds (this module's ``build``), per backend."""

    def __init__(self, backend: str, tmp: Path, make: Callable[[str], None] = build) -> None:
        self.backend = backend
        self.tmp = tmp
        self.count = 0
        if backend == "sqlite":
            self.template = tmp / "template.db"
            make(f"sqlite:///{self.template}")
        else:
            self._scratch = scratch_database("dpb_tamper_template")
            self.template_name, url = self._scratch.__enter__()
            make(url)

    def new(self) -> str:
        self.count += 1
        if self.backend == "sqlite":
            target = self.tmp / f"copy{self.count}.db"
            shutil.copy(self.template, target)
            return f"sqlite:///{target}"
        name = f"{self.template_name}_c{self.count}"
        admin = psycopg2.connect(PG_ADMIN_DSN)
        admin.autocommit = True
        with admin.cursor() as cursor:
            cursor.execute(f'CREATE DATABASE "{name}" TEMPLATE "{self.template_name}"')
        admin.close()
        self.copies = [*getattr(self, "copies", []), name]
        return url_of(name)

    def close(self) -> None:
        if self.backend == "sqlite":
            return
        admin = psycopg2.connect(PG_ADMIN_DSN)
        admin.autocommit = True
        with admin.cursor() as cursor:
            for name in getattr(self, "copies", []):
                cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()
        self._scratch.__exit__(None, None, None)


@pytest.fixture(scope="module")
def copies() -> Iterator[dict[str, Copies]]:
    made: dict[str, Copies] = {}
    patch = pytest.MonkeyPatch()
    patch.setattr(ledger_clock, "now", _clock)
    try:
        yield made
    finally:
        for copy in made.values():
            copy.close()
        patch.undo()


def copy_of(copies: dict[str, Copies], backend: str, tmp_path_factory: Any) -> str:
    if backend not in copies:
        copies[backend] = Copies(backend, tmp_path_factory.mktemp(f"tamper-{backend}"))
    return copies[backend].new()


def fetch(url: str, statement: str, **params: Any) -> list[Any]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            return list(connection.execute(sa.text(statement), params))
    finally:
        engine.dispose()


def assert_caught(url: str, token: str) -> list[str]:
    """verify fails naming ``token``, and the next release is refused; or the ledger
    refuses to open at all (fail closed). Returns the problems."""
    try:
        ledger = AdminLedger(url=url, chain_key=KEY)
    except (LedgerConfigMismatch, LedgerCorrupt) as error:
        return [str(error)]
    try:
        report = ledger.verify()
        assert not report.ok
        assert any(token in problem for problem in report.problems), report.problems
        with pytest.raises(LedgerQuarantined):
            ledger.spend(PROBE, GaussianMechanism(50.0))
        return report.problems
    finally:
        ledger.close()


# ------------------------------------------------------------------ the matrix

TABLES = (
    "dp_ledger_config",
    "dp_policies",
    "dp_accounts",
    "dp_reservations",
    "dp_reservation_keys",
    "dp_history",
    "dp_chain_head",
    "dp_windows",
    "dp_stored_releases",
)


def columns_of(table: str) -> list[str]:
    from dp_budget_provider.ledger.storage.schema import Base

    return [column.name for column in Base.metadata.tables[table].columns]


MATRIX = [
    (table, column)
    for table in TABLES
    for column in columns_of(table)
    if (table, column) not in SURROGATE
]


def mutated(column: str, value: Any) -> Any:
    """A plausible other value of the same type (never the same)."""
    if value is None:
        return {
            "residual": json.dumps([0.25] * 156),
            "pending_residual": json.dumps([0.25] * 156),
            "cost_residual": json.dumps([0.25] * 156),
            "gaussian_mu2": 0.5,
            "cost_gaussian_mu2": 0.5,
            "reservation_id": "00000000-0000-0000-0000-000000000000",
            "calendar_length_seconds": 86400,
            "prospective_rho": 0.1,
            "prospective_mu2": 0.1,
            "prospective_epsilon": 0.1,
            "rescoped_to": "trajectory",
            "resolved_at": "2026-12-01T13:00:00.000000Z",
            "sealed_at": "2026-12-01T13:00:00.000000Z",
            "quarantined_at": None,
            "quarantine_reason": "made up",
            "token_hash": "0" * 64,
            "keyed_from": 1,
            "chain_key_id": "0" * 64,
            "key_id": "0" * 64,
        }.get(column, "x")
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):  # far off: primary keys stay unique
        return value + (1_000_000 if column in ("seq", "id", "position") else 1)
    if isinstance(value, float):
        return value * 0.5 if value else 0.125
    text = str(value)
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, list) and parsed:
        parsed[0] = parsed[0] * 0.5 if isinstance(parsed[0], float) and parsed[0] else 0.125
        return json.dumps(parsed)
    if isinstance(parsed, dict):
        return json.dumps({**parsed, "tampered": 1})
    if column == "state":
        return "released" if text != "released" else "committed"
    if column in ("hash", "prev_hash", "keys_digest", "token_hash", "key_id", "chain_key_id"):
        return ("1" if text[0] != "1" else "2") + text[1:]
    if column == "conversion":
        return "classic" if text != "classic" else "improved"
    if column == "action":
        return "note"
    return text[:-1] + ("x" if text[-1:] != "x" else "y")


def pick(url: str, table: str, column: str) -> tuple[dict[str, Any], Any]:
    """A row of ``table`` where ``column`` is set (else any row): its identifying values."""
    quoted = f'"{column}"'
    rows = fetch(url, f"SELECT * FROM {table} WHERE {quoted} IS NOT NULL LIMIT 1") or fetch(
        url, f"SELECT * FROM {table} LIMIT 1"
    )
    row = rows[0]._mapping
    return dict(row), row[column]


def where_of(row: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    parts, params = [], {}
    for index, (name, value) in enumerate(row.items()):
        if value is None:
            parts.append(f'"{name}" IS NULL')
        else:
            parts.append(f'"{name}" = :w{index}')
            params[f"w{index}"] = value
    return " AND ".join(parts), params


@pytest.mark.parametrize(("table", "column"), MATRIX, ids=[f"{t}.{c}" for t, c in MATRIX])
def test_every_column_edited_is_caught(copies, tmp_path_factory, table, column):
    url = copy_of(copies, "sqlite", tmp_path_factory)
    row, value = pick(url, table, column)
    # A quarantine set in SQL is still a quarantine: verify reports it, releases stop.
    new = "2026-12-01T13:00:00.000000Z" if column == "quarantined_at" else mutated(column, value)
    assert new != value
    condition, params = where_of(row)
    execute(url, f'UPDATE {table} SET "{column}" = :new WHERE {condition}', new=new, **params)
    assert_caught(url, "dp_ledger_config" if table == "dp_ledger_config" else TOKENS[table])


@pytest.mark.parametrize("table", TABLES)
def test_every_row_deleted_is_caught(copies, tmp_path_factory, table):
    url = copy_of(copies, "sqlite", tmp_path_factory)
    row, _ = pick(url, table, columns_of(table)[0])
    condition, params = where_of(row)
    execute(url, f"DELETE FROM {table} WHERE {condition}", **params)
    assert_caught(url, TOKENS[table])


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_column_of_each_table_on_both_backends(copies, tmp_path_factory, backend):
    """The matrix's representative edits, on PostgreSQL too."""
    for table, column, token in (
        ("dp_policies", "cap_epsilon", "polic"),
        ("dp_ledger_config", "delta", "dp_ledger_config"),
        ("dp_accounts", "rho", "account"),
        ("dp_reservations", "cost_rho", "reservation"),
        ("dp_windows", "sealed_at", "window"),
    ):
        url = copy_of(copies, backend, tmp_path_factory)
        row, value = pick(url, table, column)
        condition, params = where_of(row)
        new = mutated(column, value)
        execute(url, f'UPDATE {table} SET "{column}" = :new WHERE {condition}', new=new, **params)
        assert_caught(url, token)


# ------------------------------------------------------------------ forging the chain


def recompute_chain(url: str, key: history.ChainKey) -> None:
    """Re-link every entry with ``key`` (sha256 when unkeyed) and move the heads."""
    last: dict[int, str] = {}
    engine = sa.create_engine(url)
    try:
        with engine.begin() as connection:
            entries = list(connection.execute(sa.text("SELECT * FROM dp_history ORDER BY seq")))
            for row in entries:
                prev = last.get(row.chain, history.GENESIS)
                link = history.entry_hash(
                    prev, row.seq, row.at, row.action, row.actor, history.entry_body(row), key
                )
                connection.execute(
                    sa.text("UPDATE dp_history SET prev_hash = :p, hash = :h WHERE seq = :s"),
                    {"p": prev, "h": link, "s": row.seq},
                )
                last[row.chain] = link
            for chain, link in last.items():
                connection.execute(
                    sa.text("UPDATE dp_chain_head SET hash = :h WHERE id = :c"),
                    {"h": link, "c": chain},
                )
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_rewritten_entry_with_the_chain_recomputed_without_the_key_is_caught(
    copies, tmp_path_factory, backend
):
    """The insider makes a commit cheaper, fixes the account, and re-links every entry:
    with sha256, and with a key of their own. Neither link verifies under the real key."""
    for forged_with in (history.UNKEYED, history.ChainKey("an insider's own key, 32 bytes")):
        url = copy_of(copies, backend, tmp_path_factory)
        (seq, payload), *_ = fetch(
            url, "SELECT seq, payload FROM dp_history WHERE action = 'correction' ORDER BY seq"
        )
        cheaper = json.loads(payload)
        cheaper["cost"]["gaussian_mu2"] = cheaper["cost"]["gaussian_mu2"] / 4
        execute(
            url, "UPDATE dp_history SET payload = :p WHERE seq = :s", p=json.dumps(cheaper), s=seq
        )
        recompute_chain(url, forged_with)
        problems = assert_caught(url, "entry")
        assert any("keyed link" in problem for problem in problems), problems


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_truncation_below_a_checkpoint_is_caught_and_a_forged_checkpoint_refused(
    copies, tmp_path_factory, tmp_path, backend
):
    """Delete the newest entries and move the heads back: every remaining link verifies,
    but the checkpoint kept outside the database names an entry that is gone."""
    url = copy_of(copies, backend, tmp_path_factory)
    ledger = AdminLedger(url=url, chain_key=KEY)
    store = CheckpointFile(tmp_path / "checkpoints.jsonl")
    store.append(ledger.checkpoint(ledger.verify()), ledger.chain_key)
    ledger.close()
    last_seq = fetch(url, "SELECT max(seq) FROM dp_history")[0][0]
    (chain,) = fetch(url, "SELECT chain FROM dp_history WHERE seq = :s", s=last_seq)[0]
    (prev_seq, prev_hash) = fetch(
        url,
        "SELECT seq, hash FROM dp_history WHERE chain = :c AND seq < :s ORDER BY seq DESC LIMIT 1",
        c=chain,
        s=last_seq,
    )[0]
    execute(url, "DELETE FROM dp_history WHERE seq = :s", s=last_seq)
    execute(
        url,
        "UPDATE dp_chain_head SET seq = :q, hash = :h WHERE id = :c",
        q=prev_seq,
        h=prev_hash,
        c=chain,
    )
    ledger = AdminLedger(url=url, chain_key=KEY)
    try:
        checkpoint = store.last(ledger.chain_key)
        report = ledger.verify(checkpoint)
        assert any("is gone (history truncated)" in p for p in report.problems), report.problems
        with pytest.raises(LedgerQuarantined):
            ledger.spend(PROBE, GaussianMechanism(50.0))
    finally:
        ledger.close()
    # A checkpoint edited to match the truncated history does not carry a valid MAC.
    line = json.loads((tmp_path / "checkpoints.jsonl").read_text().splitlines()[-1])
    line["entries"] -= 1
    with pytest.raises(LedgerCorrupt, match="forged or edited"):
        Checkpoint.from_json(json.dumps(line), history.ChainKey(KEY))


def test_a_keyed_ledger_refuses_to_open_without_its_key_or_with_another(tmp_path):
    url = f"sqlite:///{tmp_path / 'keyed.db'}"
    AdminLedger(BudgetCap(3.0, DELTA), url=url, chain_key=KEY).close()
    with pytest.raises(LedgerConfigMismatch, match="open it with its chain key"):
        AdminLedger(url=url)
    with pytest.raises(LedgerConfigMismatch, match="not with the chain key given"):
        AdminLedger(url=url, chain_key="another key of enough length")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        AdminLedger(url=url, chain_key="short")


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_adopting_a_key_keys_the_history_and_seals_what_came_before(tmp_path, backend):
    """An unkeyed ledger adopts a key: later links are HMACs, the heads before are sealed
    by the adoption entry, a writer without the key is refused, and verify passes."""
    with scratch_database("dpb_adopt") as (_, pg_url):
        url = pg_url if backend == "postgresql" else f"sqlite:///{tmp_path / 'adopt.db'}"
        unkeyed = AdminLedger(BudgetCap(3.0, DELTA), url=url)
        stale = AdminLedger(url=url)  # another process, still without the key
        unkeyed.spend(key_for("alice", "heatmap", "2026-w49"), GaussianMechanism(3.0))
        assert not unkeyed.verify().keyed
        unkeyed.adopt_chain_key(KEY)
        unkeyed.close()
        with pytest.raises(LedgerConfigMismatch, match="reopen the ledger with its chain key"):
            stale.spend(key_for("bob", "heatmap", "2026-w49"), GaussianMechanism(3.0))
        stale.close()
        with pytest.raises(LedgerConfigMismatch, match="open it with its chain key"):
            AdminLedger(url=url)
        keyed = AdminLedger(url=url, chain_key=KEY)
        keyed.spend(key_for("bob", "heatmap", "2026-w49"), GaussianMechanism(3.0))
        report = keyed.verify()
        assert report.ok and report.keyed, report.problems
        keyed.close()
        # Rewriting the unkeyed part and recomputing its sha256 links is caught: the
        # adoption entry's keyed link recorded the heads.
        execute(url, "UPDATE dp_history SET actor = 'someone else' WHERE action = 'create'")
        recompute_unkeyed_prefix(url)
        assert_caught(url, "checkpoint")


def recompute_unkeyed_prefix(url: str) -> None:
    """Re-link, with sha256, the entries before the key was adopted (and nothing after)."""
    keyed_from = fetch(url, "SELECT keyed_from FROM dp_ledger_config")[0][0]
    last: dict[int, str] = {}
    engine = sa.create_engine(url)
    try:
        with engine.begin() as connection:
            entries = connection.execute(
                sa.text("SELECT * FROM dp_history WHERE seq < :k ORDER BY seq"), {"k": keyed_from}
            ).all()
            for row in entries:
                prev = last.get(row.chain, history.GENESIS)
                link = history.entry_hash(
                    prev, row.seq, row.at, row.action, row.actor, history.entry_body(row)
                )
                connection.execute(
                    sa.text("UPDATE dp_history SET prev_hash = :p, hash = :h WHERE seq = :s"),
                    {"p": prev, "h": link, "s": row.seq},
                )
                last[row.chain] = link
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_quarantine_stops_releases_until_an_audited_clear(tmp_path, backend):
    with scratch_database("dpb_quarantine") as (_, pg_url):
        url = pg_url if backend == "postgresql" else f"sqlite:///{tmp_path / 'q.db'}"
        ledger = AdminLedger(BudgetCap(3.0, DELTA), url=url, chain_key=KEY, actor="ops")
        key = key_for("alice", "heatmap", "2026-w49")
        held = ledger.reserve(key, GaussianMechanism(4.0))
        ledger.spend(key, GaussianMechanism(4.0))
        execute(url, "UPDATE dp_policies SET cap_epsilon = 100")
        report = ledger.verify()
        assert any("cap_epsilon" in p for p in report.problems)
        assert ledger.quarantine_status() is not None
        with pytest.raises(LedgerQuarantined, match="quarantine clear"):
            ledger.spend(key, GaussianMechanism(4.0))
        with pytest.raises(LedgerQuarantined, match="is not committed"):
            ledger.commit(held)  # an in-flight release is not published either
        assert not ledger.quarantine(reason="again")  # one quarantine at a time
        # Clearing it in SQL is found: the history says quarantined.
        execute(url, "UPDATE dp_ledger_config SET quarantined_at = NULL, quarantine_reason = NULL")
        assert any("quarantine" in p for p in ledger.verify(quarantine=False).problems)
        execute(url, "UPDATE dp_policies SET cap_epsilon = 3.0")
        ledger2 = AdminLedger(url=url, chain_key=KEY, actor="ops")
        assert ledger2.verify().ok is False  # the SQL clear itself is still a problem
        with pytest.raises(ValueError, match="reason"):
            ledger2.clear_quarantine("  ")
        ledger2.clear_quarantine("cap restored from the audited policy entry; ticket 42")
        assert ledger2.quarantine_status() is None
        assert ledger2.verify().ok
        ledger2.spend(key, GaussianMechanism(4.0))
        actions = [e["action"] for e in ledger2.history()]
        assert actions.count("quarantine") == 2
        assert actions[-3:] == ["unquarantine", "reserve", "commit"]
        ledger.close()
        ledger2.close()


def test_a_release_granted_over_its_cap_is_found_in_the_history(tmp_path):
    """An insider lowers a key's committed spend, releases again, and puts the spend back:
    every table agrees with the history, but the replay finds the grant over the cap."""
    url = f"sqlite:///{tmp_path / 'breach.db'}"
    ledger = AdminLedger(BudgetCap(2.0, DELTA), url=url, chain_key=KEY)
    key = key_for("alice", "heatmap", "2026-w49")
    ledger.spend(key, GaussianMechanism(8.0))
    held = fetch(url, "SELECT rho, gaussian_mu2 FROM dp_accounts")[0]
    with pytest.raises(LedgerError):
        for _ in range(20):
            ledger.spend(key, GaussianMechanism(8.0))
    full = fetch(url, "SELECT rho, gaussian_mu2 FROM dp_accounts")[0]
    execute(url, "UPDATE dp_accounts SET rho = :r, gaussian_mu2 = :m", r=held[0], m=held[1])
    ledger.spend(key, GaussianMechanism(8.0))  # granted from the lowered spend
    execute(
        url,
        "UPDATE dp_accounts SET rho = rho + :r, gaussian_mu2 = gaussian_mu2 + :m",
        r=full[0] - held[0],
        m=full[1] - held[1],
    )
    problems = ledger.verify().problems
    assert any("above its cap" in p for p in problems), problems
    ledger.close()


def test_a_verify_that_cannot_even_read_a_row_still_quarantines(tmp_path):
    """SQLite stores a text in an INTEGER column: the walk cannot compare it. Crashing
    must not be a way around the quarantine."""
    url = f"sqlite:///{tmp_path / 'crash.db'}"
    ledger = AdminLedger(BudgetCap(3.0, DELTA), url=url, chain_key=KEY)
    ledger.spend(key_for("alice", "heatmap", "2026-w49"), GaussianMechanism(4.0))
    execute(url, "UPDATE dp_history SET chain = 'one' WHERE seq = 1")
    report = ledger.verify()
    assert any("could not complete" in p for p in report.problems), report.problems
    with pytest.raises(LedgerQuarantined):
        ledger.spend(key_for("alice", "heatmap", "2026-w49"), GaussianMechanism(4.0))
    ledger.close()
