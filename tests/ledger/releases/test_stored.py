"""Stored releases (``identity``, ``stored``, ``replay_stored``), on real ledgers of both
backends: a release made again at the same identity is handed its stored answer and
charged nothing; ``refresh`` charges in full and replaces it; any other identity is a new
release; a stored answer edited in the database is never served and verify names it."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
from sqlalchemy import create_engine, text

from dp_budget_provider.accounting.answer_rule import AnswerRule
from dp_budget_provider.ledger import (
    BudgetCap,
    DeclaredRelease,
    PrivacyBudgetLedger,
    ReleaseGate,
    ReleaseIdentity,
    ReleaseResult,
    ReleaseSlot,
    covered_by,
)
from dp_budget_provider.ledger.releases import stored
from dp_budget_provider.ledger.releases.service import make_release
from dp_budget_provider.ledger.storage import history
from dp_budget_provider.ledger.storage.entries import ReuseEntry
from tests.admin import ADMIN

WINDOW = "2026-w28"
LEDGER_WINDOWS = (WINDOW,)
SUBJECTS = [f"person-{i:03d}" for i in range(40)]
LOG = logging.getLogger("tests.stored")
START = datetime(2026, 7, 6, tzinfo=timezone.utc)
END = datetime(2026, 7, 13, tzinfo=timezone.utc)


@pytest.fixture
def ledger(ledger_url):
    ledger = PrivacyBudgetLedger(BudgetCap(20.0, 1e-5), url=ledger_url, admin=ADMIN)
    yield ledger
    ledger.close()


def declared(noise_multiplier: float = 4.0) -> DeclaredRelease:
    return DeclaredRelease(
        {"kind": "gaussian", "noise_multiplier": noise_multiplier},
        "default",
        "heatmap",
        l2_sensitivity=1.0,
        rule=AnswerRule(cells=3, integer=True, bounds=(0, 1000)),
    )


SLOT = ReleaseSlot.over_interval("etl", "heatmap", -1, START, END)
ATTEMPTS = iter(range(10**6))


class Query:
    """The exact answer, counting how often the data was read."""

    def __init__(self, answer=(3, 4, 5)) -> None:
        self.answer, self.reads = list(answer), 0

    def __call__(self):
        self.reads += 1
        return self.answer


def release(gate, *, slot=SLOT, subjects=SUBJECTS, spec=None, refresh=False, query=None):
    keys = covered_by(subjects, "heatmap", [WINDOW], "default")
    return make_release(
        gate,
        spec or declared(),
        keys,
        query or Query(),
        attempt=f"etl/heatmap/run/-1/1/{next(ATTEMPTS)}",
        log=LOG,
        slot=slot,
        refresh=refresh,
    )


def spent(ledger) -> float:
    key = covered_by([SUBJECTS[0]], "heatmap", [WINDOW], "default")[0]
    return ledger.epsilon_of(key)


def history_actions(ledger) -> list[str]:
    return [entry["action"] for entry in ledger.history()]


def test_a_rerun_is_handed_the_stored_answer_and_charged_nothing(ledger):
    gate = ReleaseGate(ledger, dag="etl")
    first = release(gate)
    assert first.result is ReleaseResult.released
    assert first.receipt.stored is True and first.receipt.reused is False
    after_first = spent(ledger)
    query = Query()
    again = release(gate, query=query)
    assert again.result is ReleaseResult.reused
    assert query.reads == 0  # the data is never read
    assert again.value == first.value
    assert again.receipt.reused is True
    assert again.receipt.reservation_id == first.receipt.reservation_id
    assert again.summary["reused"] is True and again.summary["epsilon"] == first.receipt.epsilon
    assert spent(ledger) == after_first
    assert history_actions(ledger).count("reuse") == 1
    assert history_actions(ledger).count("commit") == 1
    assert ledger.verify(quarantine=False).ok


def test_refresh_charges_in_full_and_its_answer_is_the_one_then_served(ledger):
    gate = ReleaseGate(ledger, dag="etl")
    first = release(gate, query=Query((1, 1, 1)))
    once = spent(ledger)
    fresh = release(gate, refresh=True, query=Query((900, 900, 900)))
    assert fresh.result is ReleaseResult.released and fresh.receipt.reused is False
    assert spent(ledger) > once
    served = release(gate)
    assert served.result is ReleaseResult.reused
    assert served.value == fresh.value != first.value
    assert served.receipt.reservation_id == fresh.receipt.reservation_id
    assert ledger.verify(quarantine=False).ok


@pytest.mark.parametrize(
    "change",
    [
        {"spec": declared(5.0)},
        {"subjects": SUBJECTS[:-1]},
        {"slot": ReleaseSlot.over_interval("etl", "heatmap", -1, START, END.replace(day=12))},
        {"slot": ReleaseSlot.over_interval("etl", "heatmap", 2, START, END)},
        {"slot": ReleaseSlot.over_interval("etl", "counts", -1, START, END)},
        {"slot": ReleaseSlot.in_window("etl", "heatmap", -1, WINDOW, START, END)},
        {"slot": ReleaseSlot.over_interval("etl", "heatmap", -1, START, END, "other.callable")},
    ],
    ids=["mechanism", "cohort", "interval", "map-index", "task", "window", "callable"],
)
def test_another_identity_is_a_new_release_charged_in_full(ledger, change):
    gate = ReleaseGate(ledger, dag="etl")
    release(gate)
    once = spent(ledger)
    query = Query()
    other = release(gate, query=query, **change)
    assert other.result is ReleaseResult.released and query.reads == 1
    assert spent(ledger) > once


def test_a_release_without_a_slot_is_neither_kept_nor_reused(ledger):
    gate = ReleaseGate(ledger, dag="etl")
    first = release(gate, slot=None)
    assert first.receipt.stored is None
    assert release(gate, slot=None).result is ReleaseResult.released
    with ledger._database.reading() as connection:
        assert connection.execute(text("SELECT count(*) FROM dp_stored_releases")).scalar() == 0


def test_a_task_reuses_only_its_own_dags_releases(ledger):
    release(ReleaseGate(ledger, dag="etl"))
    other = release(ReleaseGate(ledger, dag="growth"))
    assert other.result is ReleaseResult.invalid
    assert "not this task's DAG" in str(other.error)
    assert history_actions(ledger).count("reuse") == 0


def test_an_answer_too_large_to_keep_is_released_charged_and_charged_again(ledger, monkeypatch):
    monkeypatch.setattr(stored, "MAX_STORED_BYTES", 5)
    gate = ReleaseGate(ledger, dag="etl")
    first = release(gate)
    assert first.result is ReleaseResult.released and first.receipt.stored is False
    once = spent(ledger)
    assert release(gate).result is ReleaseResult.released
    assert spent(ledger) > once
    assert ledger.verify(quarantine=False).ok


def _edit(ledger, sql: str, **params) -> None:
    engine = create_engine(ledger.url)
    with engine.begin() as connection:
        connection.execute(text(sql), params)
    engine.dispose()


def _row(ledger):
    with ledger._database.reading() as connection:
        return connection.execute(text("SELECT * FROM dp_stored_releases")).one()


def test_an_edited_answer_is_never_served_and_verify_names_it(ledger):
    gate = ReleaseGate(ledger, dag="etl")
    first = release(gate)
    _edit(ledger, "UPDATE dp_stored_releases SET value = :v", v=json.dumps([0, 0, 0]))
    query = Query()
    again = release(gate, query=query)
    assert again.result is ReleaseResult.refused and again.value is None and query.reads == 0
    assert first.receipt.reservation_id not in str(again.refusal)  # the uniform refusal
    problems = ledger.verify(quarantine=False).problems
    assert any("dp_stored_releases" in p and "digest" in p for p in problems), problems


def test_an_answer_edited_with_its_digest_matches_no_commit(ledger):
    gate = ReleaseGate(ledger, dag="etl")
    release(gate)
    row = _row(ledger)
    value = json.dumps([7, 7, 7])
    _edit(
        ledger,
        "UPDATE dp_stored_releases SET value = :v, digest = :d",
        v=value,
        d=stored.stored_digest(row.document, value, row.receipt),
    )
    assert release(gate).result is ReleaseResult.refused
    problems = ledger.verify(quarantine=False).problems
    assert any("is not the one the commit" in p for p in problems), problems


def test_an_answer_edited_with_its_commit_entry_breaks_the_entrys_link(ledger):
    """An insider who rewrites the commit's entry to match an edited answer: the entry no
    longer carries the link its content makes, so the answer is not served."""
    gate = ReleaseGate(ledger, dag="etl")
    first = release(gate)
    row = _row(ledger)
    value = json.dumps([7, 7, 7])
    digest = stored.stored_digest(row.document, value, row.receipt)
    _edit(
        ledger,
        "UPDATE dp_stored_releases SET value = :v, digest = :d",
        v=value,
        d=digest,
    )
    commit = "SELECT payload FROM dp_history WHERE reservation_id = :r AND action = 'commit'"
    with ledger._database.reading() as connection:
        payload = json.loads(
            connection.execute(text(commit), {"r": first.receipt.reservation_id}).scalar_one()
        )
    payload["stored"]["digest"] = digest
    _edit(
        ledger,
        "UPDATE dp_history SET payload = :p WHERE reservation_id = :r AND action = 'commit'",
        p=json.dumps(payload, sort_keys=True, separators=(",", ":")),
        r=first.receipt.reservation_id,
    )
    outcome = release(gate)
    assert outcome.result is ReleaseResult.refused
    # In an exposed gate the reason is told: the entry's link.
    exposed = release(ReleaseGate(ledger, exposed=True, dag="etl"))
    assert "link its content makes" in str(exposed.refusal)
    assert not ledger.verify(quarantine=False).ok


def test_a_deleted_answer_is_named_by_verify(ledger):
    release(ReleaseGate(ledger, dag="etl"))
    _edit(ledger, "DELETE FROM dp_stored_releases")
    problems = ledger.verify(quarantine=False).problems
    assert any("is missing" in p for p in problems), problems


def test_a_reuse_is_refused_in_quarantine(ledger):
    gate = ReleaseGate(ledger, dag="etl")
    release(gate)
    ledger.quarantine("test")
    assert release(gate).result is ReleaseResult.refused
    assert history_actions(ledger).count("reuse") == 0


def test_verify_names_a_reuse_of_an_answer_no_commit_kept(ledger):
    gate = ReleaseGate(ledger, dag="etl")
    release(gate)
    row = _row(ledger)
    reservations = ledger._reservations
    with ledger._database.write() as connection:
        reservations._journal.append(
            connection,
            ReuseEntry(
                attempt_id="forged", identity=row.identity, reservation="nope", digest=row.digest
            ),
            at="2026-07-14T00:00:00.000000+00:00",
        )
    problems = ledger.verify(quarantine=False).problems
    assert any("no commit of reservation nope" in p for p in problems), problems


def test_one_window_over_other_data_is_another_release(ledger):
    """A release told which window to charge (a sensor's) is still named by the data it
    reads: a backfill of last week's data charged to this week is not this week's run."""
    gate = ReleaseGate(ledger, dag="etl")
    this_week = ReleaseSlot.in_window("etl", "heatmap", -1, WINDOW, START, END)
    last_week = ReleaseSlot.in_window(
        "etl", "heatmap", -1, WINDOW, START.replace(day=1), END.replace(day=6)
    )
    release(gate, slot=this_week)
    query = Query()
    assert release(gate, slot=last_week, query=query).result is ReleaseResult.released
    assert query.reads == 1
    assert release(gate, slot=this_week).result is ReleaseResult.reused


def test_on_a_keyed_ledger_only_the_entrys_mac_proves_an_answer(ledger_url):
    """An insider without the chain key who edits the answer, its commit entry and its
    plain hash, and says the history was never keyed: the answer is not served."""
    keyed = PrivacyBudgetLedger(
        BudgetCap(20.0, 1e-5), url=ledger_url, admin=ADMIN, chain_key="k" * 32
    )
    try:
        gate = ReleaseGate(keyed, dag="etl")
        first = release(gate)
        row = _row(keyed)
        value = json.dumps([999, 999, 999])
        digest = stored.stored_digest(row.document, value, row.receipt)
        _edit(keyed, "UPDATE dp_stored_releases SET value = :v, digest = :d", v=value, d=digest)
        entry = "FROM dp_history WHERE reservation_id = :r AND action = 'commit'"
        with keyed._database.reading() as connection:
            found = connection.execute(
                text(f"SELECT * {entry}"), {"r": first.receipt.reservation_id}
            ).one()
        payload = json.loads(found.payload)
        payload["stored"]["digest"] = digest
        text_payload = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        forged = dict(found._mapping, payload=text_payload)
        link = history.entry_hash(
            found.prev_hash,
            found.seq,
            found.at,
            found.action,
            found.actor,
            history.entry_body(type("Row", (), forged)),
        )
        _edit(
            keyed,
            "UPDATE dp_history SET payload = :p, hash = :h WHERE seq = :s",
            p=text_payload,
            h=link,
            s=found.seq,
        )
        _edit(keyed, "UPDATE dp_ledger_config SET keyed_from = NULL")
        query = Query()
        outcome = release(gate, query=query)
        assert outcome.result is ReleaseResult.refused and outcome.value is None
        assert query.reads == 0
    finally:
        keyed.close()


def test_a_rolled_back_answer_is_named_by_verify(ledger):
    """After a refresh, the row put back to the answer the refresh replaced proves as that
    commit's and is served once; verify names that reuse."""
    gate = ReleaseGate(ledger, dag="etl")
    release(gate)
    old = _row(ledger)
    release(gate, refresh=True)
    _edit(ledger, "DELETE FROM dp_stored_releases")
    _edit(
        ledger,
        "INSERT INTO dp_stored_releases VALUES (:i, :r, :doc, :v, :rc, :d, :at)",
        i=old.identity,
        r=old.reservation_id,
        doc=old.document,
        v=old.value,
        rc=old.receipt,
        d=old.digest,
        at=old.stored_at,
    )
    assert release(gate).result is ReleaseResult.reused
    problems = ledger.verify(quarantine=False).problems
    assert any("not the last kept" in p for p in problems), problems


def test_a_release_made_again_after_its_answer_was_deleted_is_named_by_verify(ledger):
    """Deleting the kept answer makes the next run a new release (charged: the lookup
    cannot tell a deleted answer from none), and verify names its commit."""
    gate = ReleaseGate(ledger, dag="etl")
    release(gate)
    _edit(ledger, "DELETE FROM dp_stored_releases")
    assert release(gate).result is ReleaseResult.released
    problems = ledger.verify(quarantine=False).problems
    assert any("deleted or rolled back" in p for p in problems), problems


def test_a_refresh_replaces_the_last_answer_and_verify_agrees(ledger):
    gate = ReleaseGate(ledger, dag="etl")
    first = release(gate)
    release(gate, refresh=True)
    commits = [e["payload"] for e in ledger.history() if e["action"] == "commit"]
    assert commits[0]["stored"]["replaces"] is None
    assert commits[1]["stored"]["replaces"] == first.receipt.reservation_id
    assert ledger.verify(quarantine=False).ok


def test_a_commit_that_finds_its_reservation_reaped_keeps_nothing_and_says_so(ledger):
    gate = ReleaseGate(ledger, dag="etl")
    keys = covered_by(SUBJECTS, "heatmap", [WINDOW], "default")
    plan = declared().plan(declared().fixed_mechanism())
    granted = gate.reserve(keys, plan.charged, attempt="etl/heatmap/run/-1/1/reaped")
    assert len(ledger.reap(timedelta(0))) == 1  # its worker looked dead
    identity = ReleaseIdentity.of(SLOT, declared().identity_part(plan), keys)
    receipt = gate.commit(granted, (identity, [1, 2, 3]))
    assert receipt.stored is False
    assert release(gate).result is ReleaseResult.released  # nothing was kept to reuse


def test_a_gate_reuses_only_as_its_own_dag(ledger):
    gate = ReleaseGate(ledger, dag="etl")
    release(gate)
    keys = covered_by(SUBJECTS, "heatmap", [WINDOW], "default")
    plan = declared().plan(declared().fixed_mechanism())
    identity = ReleaseIdentity.of(SLOT, declared().identity_part(plan), keys)
    with pytest.raises(ValueError, match="own DAG"):
        gate.reuse(identity, attempt="growth/heatmap/run/-1/1/x")
    assert history_actions(ledger).count("reuse") == 0


def test_refresh_of_another_dags_release_reads_nothing(ledger):
    query = Query()
    outcome = release(ReleaseGate(ledger, dag="growth"), refresh=True, query=query)
    assert outcome.result is ReleaseResult.invalid and query.reads == 0
    assert ledger.open_reservations() == []


def test_numpy_numbers_in_a_declaration_name_the_same_release(ledger):
    gate = ReleaseGate(ledger, dag="etl")
    numpy_spec = DeclaredRelease(
        {"kind": "gaussian", "noise_multiplier": 4.0},
        "default",
        "heatmap",
        l2_sensitivity=np.int64(1),
        rule=AnswerRule(cells=3, integer=True, bounds=(np.int64(0), np.int64(1000))),
    )
    release(gate)
    assert release(gate, spec=numpy_spec).result is ReleaseResult.reused
