"""History entries as typed records (``storage/entries.py``): every action the package
writes has one, each stored payload of a real history reads into its record and back to
the same bytes, a new history is byte for byte what the writers wrote before there were
records, and the stability rules hold (a field a later version adds is ignored, an
optional field an earlier version lacked reads as its default, a malformed payload is
refused naming what is wrong, and verify reports it as that entry's problem).

One ledger per backend runs a workload writing every kind of entry: creation without an
administrator, the administrator's key, policies, releases over keys and over a cohort
(with a split carried to an open reservation), a correction, a re-scope, a reset, a
release, reaps by lease and by age, a quarantine and its clearing, and a key adoption.
Its random names (reservation ids, tokens, account labels) and its clock are made
repeatable, so its whole history is one known set of links.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import platform
import secrets
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa

import dp_budget_provider
from dp_budget_provider.accounting import GaussianMechanism, LaplaceMechanism
from dp_budget_provider.ledger import AdminKey, BudgetCap, Policy, PrivacyBudgetLedger, key_for
from dp_budget_provider.ledger.accounts.spend import Spend
from dp_budget_provider.ledger.audit.replay_acts import Configuration
from dp_budget_provider.ledger.audit.replay_charges import Charges
from dp_budget_provider.ledger.audit.replay_state import AuditSettings, Findings
from dp_budget_provider.ledger.audit.replay_stored import KeptAnswers
from dp_budget_provider.ledger.releases.identity import ReleaseIdentity, ReleaseSlot
from dp_budget_provider.ledger.releases.stored import Keep
from dp_budget_provider.ledger.storage import clock as ledger_clock
from dp_budget_provider.ledger.storage import entries, history
from dp_budget_provider.ledger.storage.entries import (
    ENTRY_KINDS,
    CreateEntry,
    NewClass,
    PolicyEntry,
    ReapEntry,
    ReserveEntry,
    ResetEntry,
    Split,
)
from dp_budget_provider.ledger.storage.payloads import Entry, MalformedEntry
from dp_budget_provider.ledger.windows.policy import DEFAULT_GRACE
from tests.ledger.audit.test_tamper import fetch, recompute_chain
from tests.ledger.storage.test_pending_and_server_paths import execute
from tests.scratch_postgres import scratch_database

UTC = timezone.utc
CAP = BudgetCap(3.0, 1e-5)
KEY = "entries-chain-key-0123456789abcdef"
ADMIN = AdminKey(bytes(range(32)))  # a fixed key: its signatures are repeatable too
CLOCK = {"now": datetime(2026, 11, 4, 12, tzinfo=UTC)}
PACKAGE = Path(dp_budget_provider.__file__).parent
# The workload's last entry and the sha256 of its entries' shape, on either backend:
# every entry's seq, action and payload, with each float to 12 significant digits, each
# signature left out and the chain heads an entry quotes by id and seq only. The costs and
# epsilons in the entries are floats the numerical libraries compute, whose last bits
# differ between machines even with numpy's SIMD kernels off (``SCALAR_NUMPY``: its
# AVX-512 kernels of exp and log round differently from the C library's), and signatures
# and chain hashes hash those bits; the shape is what a writer decides. Every policy entry
# names its filter order, the default one's included (a new ledger's default cap is a
# privacy filter). A change of what the writers write (a field, its form, its order in
# the workload) shows here; it must be deliberate, and keep what the entries' stability
# rules promise. Every ledger of the workload names its actor: the default one
# (user@host) would make the digest depend on the machine.
HEADS = (33, "54e06a838c08d0ee54e3a865c7c2c9190d0d03ca81c9d7383d67d0035455b0b1")
# numpy's dispatched x86-64 kernels, all turned off for the workload's process.
SCALAR_NUMPY = (
    "SSSE3 SSE41 POPCNT SSE42 AVX F16C FMA3 AVX2 AVX512F AVX512CD AVX512_KNL AVX512_KNM "
    "AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR"
)


def repeatable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ledger's clock reads ``CLOCK``, and its random names count up instead."""
    counter = itertools.count(1)
    monkeypatch.setattr(ledger_clock, "now", lambda: CLOCK["now"])
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=next(counter)))
    monkeypatch.setattr(secrets, "token_urlsafe", lambda nbytes=None: f"token-{next(counter)}")
    monkeypatch.setattr(secrets, "token_hex", lambda nbytes=6: f"{next(counter):0{2 * nbytes}x}")


def workload(url: str) -> tuple[int, str]:
    """Every kind of entry, on a ledger created without administrator and chain key; the
    heads of its history at the pin (``HEADS``)."""
    CLOCK["now"] = datetime(2026, 11, 4, 12, tzinfo=UTC)
    PrivacyBudgetLedger(CAP, url=url, actor="builder").close()
    ledger = PrivacyBudgetLedger(
        CAP, url=url, actor="builder", admin=ADMIN, lease=timedelta(minutes=5)
    )
    try:
        ledger.record_admin_key()
        ledger.set_policy(
            Policy(2.5, tenant="acme", query_type="counts", compliance_clause="GDPR Art. 25")
        )
        alice, bob = key_for("alice", "heatmap", "2026-w45"), key_for("bob", "heatmap", "2026-w45")
        ledger.spend(alice, GaussianMechanism(3.0))
        ledger.commit(ledger.reserve([alice, bob], LaplaceMechanism(0.25)))
        pat, quinn = key_for("pat", "heatmap", "2026-w45"), key_for("quinn", "heatmap", "2026-w45")
        held = ledger.reserve([pat, quinn], GaussianMechanism(7.0))
        ledger.commit(ledger.reserve([pat], GaussianMechanism(7.0)))  # a split, carried to held
        ledger.commit(held)
        cohort = ledger.cohort([f"s{i}" for i in range(20)])
        ledger.commit(
            ledger.reserve(cohort.in_window("heatmap", "2026-w45"), GaussianMechanism(9.0))
        )
        ledger.correct(bob, GaussianMechanism(5.0), reason="a missed release")
        snap = key_for("dave", "snapshot", "2026-w45")
        ledger.spend(snap, GaussianMechanism(3.0))
        ledger.rescope(snap, key_for("dave", "trajectory", "2026-w45"), reason="re-scored")
        ledger.spend(key_for("x", "counts", "2026-w45", tenant="acme"), GaussianMechanism(4.0))
        CLOCK["now"] = datetime(2026, 12, 1, 12, tzinfo=UTC)
        ledger.reset("2026-w45")
        erin = key_for("erin", "heatmap", "2026-w49")
        ledger.reserve([erin, key_for("frank", "heatmap", "2026-w49")], LaplaceMechanism(0.25))
        ledger.release(
            ledger.reserve(key_for("gina", "heatmap", "2026-w49"), GaussianMechanism(4.0))
        )
        CLOCK["now"] = datetime(2026, 12, 1, 12, 10, tzinfo=UTC)
        young = ledger.reserve(key_for("ivy", "heatmap", "2026-w49"), GaussianMechanism(4.0))
        assert len(ledger.reap()) == 1  # its lease ran out
        CLOCK["now"] = datetime(2026, 12, 1, 12, 12, tzinfo=UTC)
        assert ledger.reap(timedelta(minutes=1)) == [young.id]  # older than a minute
        ledger.quarantine("an investigation", ["a problem", "another one"])
        ledger.clear_quarantine("nothing found")
        ledger.adopt_chain_key(KEY)
    finally:
        ledger.close()
    keyed = PrivacyBudgetLedger(CAP, url=url, actor="builder", admin=ADMIN, chain_key=KEY)
    try:
        keyed.spend(erin, GaussianMechanism(3.0))
        with keyed.reading() as connection:
            pinned = shape_digest(connection)
        # Written after the pin (the entries are newer than the code it pins): a release
        # whose commit keeps its answer, and a re-run handed it.
        hank = key_for("hank", "heatmap", "2026-w49")
        identity = ReleaseIdentity.of(
            ReleaseSlot.in_window("etl", "heatmap", -1, "2026-w49", CLOCK["now"], CLOCK["now"]),
            {"count": 1},
            [hank],
        )
        kept = Keep.of(identity, [3, 4], {"reservation_id": "kept"})
        keyed.commit(keyed.reserve(hank, GaussianMechanism(3.0)), kept)
        assert keyed.reuse(identity, "etl/heatmap/rerun") is not None
        report = keyed.verify()
        assert report.ok, report.problems
    finally:
        keyed.close()
    return pinned


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def ledger(request, tmp_path_factory) -> Iterator[str]:
    """The URL of a ledger the workload wrote, repeatably."""
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            url = f"sqlite:///{tmp_path_factory.mktemp('entries') / 'ledger.db'}"
        else:
            _, url = stack.enter_context(scratch_database("dpb_entries"))
        PINNED[url] = written_apart(url)
        yield url


# The heads each workload's ledger had when it reached that pin (by URL).
def shape_digest(connection: Any) -> tuple[int, str]:
    """(last seq, sha256 of every entry's shape): see ``HEADS``."""

    def shape(value: Any) -> Any:
        if isinstance(value, float):
            return float(f"{value:.12g}")
        if isinstance(value, dict):  # a chain's heads hash those bits too
            return {
                k: [head[:2] for head in v] if k == "heads" else shape(v)
                for k, v in value.items()
                if k != "signature"
            }
        if isinstance(value, list):
            return [shape(v) for v in value]
        return value

    rows = connection.execute(
        sa.text("SELECT seq, action, payload FROM dp_history ORDER BY seq")
    ).all()
    text = "\n".join(
        f"{row.seq} {row.action} {history.canonical_json(shape(json.loads(row.payload)))}"
        for row in rows
    )
    return rows[-1].seq, hashlib.sha256(text.encode()).hexdigest()


PINNED: dict[str, tuple[int, str]] = {}


def written_apart(url: str) -> tuple[int, str]:
    """Run the workload on ``url`` in a process of its own, with numpy's SIMD kernels off
    on x86-64 (see ``HEADS``); the heads it had at the pin."""
    env = dict(os.environ)
    if platform.machine() in ("x86_64", "AMD64"):
        env["NPY_DISABLE_CPU_FEATURES"] = SCALAR_NUMPY
    script = (
        "import json, sys, pytest\n"
        "from tests.ledger.storage import test_entries as t\n"
        "with pytest.MonkeyPatch.context() as monkeypatch:\n"
        "    t.repeatable(monkeypatch)\n"
        "    print(json.dumps(t.workload(sys.argv[1])))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, url],
        env=env,
        cwd=PACKAGE.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seq, digest = json.loads(done.stdout.strip().splitlines()[-1])
    return seq, digest


@pytest.fixture(scope="module")
def written(ledger) -> list[Any]:
    """The workload's history: (seq, action, payload) rows in order."""
    return fetch(ledger, "SELECT seq, action, payload FROM dp_history ORDER BY seq")


def record_of(row: Any) -> Entry:
    return ENTRY_KINDS[row.action].from_payload(json.loads(row.payload))


# ------------------------------------------------------------------ every action has a kind


def _appends_outside_the_journal() -> list[str]:
    """Calls that write a history entry from anywhere but the journal (and the history
    and pipeline modules it writes through): none may write an untyped payload."""
    writers = {"append_history", "entry_columns"}
    allowed = {"storage/history.py", "storage/pipeline.py", "storage/journal.py"}
    found = []
    for path in sorted((PACKAGE / "ledger").rglob("*.py")):
        relative = path.relative_to(PACKAGE / "ledger").as_posix()
        if relative in allowed or relative.startswith("storage/migrations/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            name, owner = node.func.attr, node.func.value
            if name in writers or (
                name == "append" and isinstance(owner, ast.Name) and owner.id == "history"
            ):
                found.append(f"{relative}:{node.lineno}")
    return found


def test_every_action_the_package_writes_has_a_typed_entry(written):
    assert _appends_outside_the_journal() == []
    kinds = {
        value
        for value in vars(entries).values()
        if isinstance(value, type) and issubclass(value, Entry) and "action" in vars(value)
    }
    assert kinds == set(ENTRY_KINDS.values())
    assert all(ENTRY_KINDS[kind.action] is kind for kind in kinds)
    # The workload wrote every kind there is, and only those.
    assert {row.action for row in written} == set(ENTRY_KINDS)
    # verify's replay applies every kind.
    findings = Findings()
    settings = AuditSettings(np.arange(1.5, 10.0), CAP.delta, "improved", history.UNKEYED)
    configuration = Configuration(findings, settings)
    charges = Charges(settings, configuration, findings)
    kept = KeptAnswers(findings)
    handled = [*configuration.handlers(), *charges.handlers(), *kept.handlers()]
    assert sorted(handled, key=str) == sorted(ENTRY_KINDS.values(), key=str)


# ------------------------------------------------------------------ the payloads of a history


def test_a_new_history_is_what_the_writers_wrote_before_typed_entries(ledger):
    assert PINNED[ledger] == HEADS


def test_each_payload_of_a_real_history_reads_into_its_record_and_back(written):
    for row in written:
        record = record_of(row)
        assert type(record) is ENTRY_KINDS[row.action]
        assert record.payload() == json.loads(row.payload), row.seq
        # byte for byte, as the chain links it
        assert history.canonical_json(record.payload()) == row.payload, row.seq


def test_the_records_hold_typed_values(written):
    records = [record_of(row) for row in written]
    reserves = [record for record in records if isinstance(record, ReserveEntry)]
    assert all(isinstance(reserve.cost, Spend) for reserve in reserves)
    refinements = [
        cohort.refined
        for reserve in reserves
        for cohort in reserve.cohorts or ()
        if cohort.refined is not None
    ]
    splits = [split for refined in refinements for split in refined.split]
    assert splits and all(isinstance(split, Split) for split in splits)
    assert any(split.carried for split in splits)  # the held reservation was carried
    assert any(refined.new is not None and refined.new.refers for refined in refinements)
    reaps = [record for record in records if isinstance(record, ReapEntry)]
    assert [reap.lease_expires_at is not None for reap in reaps] == [True, True]
    # A reservation without a lease is reaped with its lease written as null, as ever.
    unleased = dataclasses.replace(reaps[0], lease_expires_at=None).payload()
    assert "lease_expires_at" in unleased and unleased["lease_expires_at"] is None
    (reset,) = [record for record in records if isinstance(record, ResetEntry)]
    assert reset.kept and ("acme", "counts") in (reset.sealed or ())
    (created,) = [record for record in records if isinstance(record, CreateEntry)]
    assert created.chain_key_id is None and created.admin_key is None
    assert "chain_key_id" in created.payload()  # written as null, as the writer always did
    assert "admin_key" not in created.payload()  # left out when the ledger has none


# ------------------------------------------------------------------ the stability rules


def test_a_field_unknown_to_this_version_is_ignored(written):
    for row in written:
        payload = json.loads(row.payload)
        later = {**payload, "written_by_a_later_version": {"any": [1, 2.5, None]}}
        assert ENTRY_KINDS[row.action].from_payload(later).payload() == payload


def _optional_fields(kind: type[Entry]) -> dict[str, Any]:
    """An entry kind's optional fields and their defaults."""
    return {
        item.name: item.default
        for item in dataclasses.fields(kind)
        if item.default is not dataclasses.MISSING
    }


def test_an_optional_field_left_out_reads_as_its_default(written):
    left_out = 0
    for row in written:
        kind = ENTRY_KINDS[row.action]
        payload = json.loads(row.payload)
        for name, default in _optional_fields(kind).items():
            if name not in payload:
                continue
            older = {key: value for key, value in payload.items() if key != name}
            assert getattr(kind.from_payload(older), name) == default, (row.seq, name)
            left_out += 1
    assert left_out > 20


def test_payloads_as_earlier_versions_wrote_them_read_with_their_meaning():
    cost = {"rho": 0.5, "residual": None, "gaussian_mu2": 1.0}
    # A reserve the server decided (revision 0003): its prospective spend, no epsilon, no
    # token, no cohorts.
    reserve = ReserveEntry.from_payload(
        {
            "attempt_id": "a",
            "mechanism": {"kind": "gaussian", "noise_multiplier": 1.0},
            "count": 1,
            "cost": cost,
            "key_count": 1,
            "keys_digest": "d",
            "prospective": {"rho": 1.5, "residual": None, "gaussian_mu2": 3.0},
        }
    )
    assert reserve.prospective_epsilon is None and reserve.token_hash is None
    assert reserve.cohorts is None and reserve.prospective.gaussian_mu2 == 3.0
    # The first version's reset: every scope of the window, nothing kept.
    reset = ResetEntry.from_payload({"window": "2026-w45", "accounts": 2, "closed_at": "t"})
    assert (reset.sealed, reset.kept, reset.subjects, reset.closed_at) == (None, False, None, "t")
    # A reap before leases, a creation before chains and keys.
    reap = ReapEntry.from_payload(
        {
            "attempt_id": "a",
            "cost": cost,
            "count": 1,
            "key_count": 1,
            "keys_digest": "d",
            "reason": "old",
        }
    )
    assert reap.lease_expires_at is None
    created = CreateEntry.from_payload(
        {"delta": 1e-5, "orders": [1.5, 2.0], "conversion": "improved"}
    )
    assert (created.chains, created.chain_key_id, created.orders) == (None, None, (1.5, 2.0))
    # A policy before grace periods and clauses, with its calendar as a bare kind.
    policy = PolicyEntry.from_payload(
        {
            "tenant": "*",
            "query_type": "*",
            "cap_epsilon": 3.0,
            "warn_fraction": 0.8,
            "calendar": "fixed",
            "calendar_length_seconds": 7 * 86400,
            "min_window_seconds": 86400,
        }
    ).policy
    assert policy.grace == DEFAULT_GRACE and policy.compliance_clause == ""
    assert (policy.calendar.kind, policy.calendar.length_seconds) == ("fixed", 7 * 86400)
    # A split before splits carried reservations; a new account before it could refer.
    assert Split.read(["Class-a", "Class-b", 2]) == Split(
        parent="Class-a", child="Class-b", moved=2, carried=()
    )
    assert NewClass.read(["Class-c", 3]) == NewClass(label="Class-c", size=3, refers=False)


@pytest.mark.parametrize(
    ("kind", "payload", "said"),
    [
        (ResetEntry, {"window": "2026-w45"}, "a reset entry's payload: no 'accounts'"),
        (ResetEntry, [], "a reset entry's payload: a list, not an object"),
        (
            ResetEntry,
            {"window": "2026-w45", "accounts": "2"},
            "a reset entry's payload: accounts: a text, not an integer",
        ),
        (
            ResetEntry,
            {"window": "w", "accounts": 2, "sealed": [["acme"]]},
            "a reset entry's payload: sealed[0]: a list of 1, not of 2",
        ),
        (
            ReapEntry,
            {"attempt_id": "a", "cost": {"rho": -1.0, "residual": None, "gaussian_mu2": None}},
            "a reap entry's payload: cost: stored spend is corrupt: rho=-1.0",
        ),
        (
            CreateEntry,
            {"delta": True, "orders": [], "conversion": "improved"},
            "a create entry's payload: delta: a boolean, not a number",
        ),
    ],
)
def test_a_malformed_payload_is_refused_saying_what_and_where(kind, payload, said):
    with pytest.raises(MalformedEntry) as refused:
        kind.from_payload(payload)
    assert str(refused.value) == said


def test_a_nested_part_is_refused_with_its_path(written):
    for row in written:
        payload = json.loads(row.payload)
        for cohort in payload.get("cohorts") or []:
            if cohort["refined"] and cohort["refined"]["split"]:
                cohort["refined"]["split"][0][2] = "one"
                with pytest.raises(MalformedEntry) as refused:
                    ENTRY_KINDS[row.action].from_payload(payload)
                assert "cohorts[0].refined.split[0][2]: a text, not an integer" in str(
                    refused.value
                )
                return
    raise AssertionError("no split in the history")


def test_verify_reports_a_malformed_payload_as_its_entry_problem(tmp_path, monkeypatch):
    """An insider rewrites an entry's payload and links the chain again: the entry is
    unreadable, and verify says which, as it always has."""
    monkeypatch.setattr(ledger_clock, "now", lambda: datetime(2026, 12, 1, 12, tzinfo=UTC))
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    opened = PrivacyBudgetLedger(CAP, url=url)
    try:
        opened.spend(key_for("alice", "heatmap", "2026-w49"), GaussianMechanism(3.0))
        ((seq, payload),) = fetch(
            url, "SELECT seq, payload FROM dp_history WHERE action = 'reserve'"
        )
        edited = {key: value for key, value in json.loads(payload).items() if key != "cost"}
        execute(
            url, "UPDATE dp_history SET payload = :p WHERE seq = :s", p=json.dumps(edited), s=seq
        )
        recompute_chain(url, history.UNKEYED)
        report = opened.verify(quarantine=False)
    finally:
        opened.close()
    said = MalformedEntry("a reserve entry's payload: no 'cost'")
    assert f"entry {seq} (reserve): unreadable payload ({said!r}); edited?" in report.problems
