"""verify proves the spend classes: refinements replayed, listings, members, cohorts.

A release over many subjects is charged to the accounts of their classes, and a cohort
new to a window refines the window's classes (``classes``). The history records every
refinement, so ``verify`` replays them and proves what the class tables must hold:
each account's size, each cohort's listing, each subject's account (the fold of its
window's refinements over the cohorts that contain it), each cohort's digest. Releases
over overlapping random cohorts verify clean on both backends; then an insider edits
each class table (and a refinement in the history, re-linked with the real key so only
the replay can tell): verify names the fact and releases stop.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

import pytest

from dp_budget_provider.accounting import GaussianMechanism, LaplaceMechanism
from dp_budget_provider.ledger import BudgetCap, PrivacyBudgetLedger, key_for, keys_for
from dp_budget_provider.ledger.audit import class_checks as audit
from dp_budget_provider.ledger.storage import clock as ledger_clock
from dp_budget_provider.ledger.storage import history
from tests.ledger.audit.test_tamper import KEY, Copies, assert_caught, fetch, recompute_chain
from tests.ledger.memberships_sql import MEMBERS
from tests.ledger.storage.test_pending_and_server_paths import execute
from tests.scratch_postgres import scratch_database

UTC = timezone.utc
DELTA = 1e-5
CLOCK = {"now": datetime(2026, 11, 4, 12, tzinfo=UTC)}
# Ids whose code-point order is not a linguistic collation's ("s_1" after "s1" in Python,
# before it under en-US; "é" after every ASCII letter): cohort digests sort by code point.
SUBJECTS = [f"u{i:02d}" for i in range(48)] + ["s_1", "s1", "s-2", "s 3", "é", "e", "z"]
# The clock starts in LIVE (RESET is in its grace period) and moves past RESET's grace
# period, not LIVE's, to reset RESET and go on charging LIVE.
LIVE, RESET = "2026-w45", "2026-w44"


def _clock() -> datetime:
    return CLOCK["now"]


@pytest.fixture(autouse=True, scope="module")
def ledger_clock_of_the_module() -> Iterator[None]:
    patch = pytest.MonkeyPatch()
    patch.setattr(ledger_clock, "now", _clock)
    yield
    patch.undo()


def build(url: str, seed: int = 14) -> None:
    """Releases over overlapping random cohorts (as subject keys, and by a registered
    cohort's handle): in one window, over two windows at once, cohorts seen before
    (known) and new (refined: kept, split, new), splits of accounts
    held by open reservations (carried to them, then committed or left open), a
    correction and a re-scope (each a class of one), a released reservation, and a reset
    window (whose accounts move to dp_sealed_accounts, its members and listings kept).
    Verifies clean."""
    CLOCK["now"] = datetime(2026, 11, 4, 12, tzinfo=UTC)
    rng = random.Random(seed)
    ledger = PrivacyBudgetLedger(BudgetCap(40.0, DELTA), url=url, chain_key=KEY, actor="builder")
    try:
        pool = [rng.sample(SUBJECTS, rng.randint(5, 40)) for _ in range(6)]
        for _ in range(14):
            cohort = rng.choice(pool) if rng.random() < 0.6 else rng.sample(SUBJECTS, 12)
            windows = rng.choice([[LIVE], [RESET], [LIVE, RESET]])
            ledger.commit(
                ledger.reserve(keys_for(cohort, "heatmap", windows), GaussianMechanism(6.0))
            )
        ledger.correct(key_for(pool[0][0], "heatmap", LIVE), GaussianMechanism(8.0), reason="x")
        ledger.commit(ledger.reserve(keys_for(pool[1], "snapshot", [LIVE]), LaplaceMechanism(1.0)))
        ledger.rescope(
            key_for(pool[1][0], "snapshot", LIVE),
            key_for(pool[1][0], "trajectory", LIVE),
            reason="re-scored",
        )
        ledger.release(ledger.reserve(keys_for(pool[2], "heatmap", [LIVE]), GaussianMechanism(5.0)))
        handle = ledger.cohort(pool[5])  # registered once, charged by its handle (twice)
        for _ in range(2):
            ledger.commit(ledger.reserve(handle.in_window("heatmap", LIVE), GaussianMechanism(6.0)))
        held = ledger.reserve(keys_for(pool[4], "counts", [LIVE]), GaussianMechanism(9.0))
        split_a_held_class(ledger, url)
        ledger.commit(held)
        CLOCK["now"] = datetime(2026, 11, 6, 12, tzinfo=UTC)  # RESET closed, LIVE charged
        assert ledger.reset(RESET) > 0
        ledger.commit(ledger.reserve(keys_for(pool[3], "heatmap", [LIVE]), GaussianMechanism(6.0)))
        ledger.reserve(keys_for(pool[3], "heatmap", [LIVE]), GaussianMechanism(7.0))  # open
        ledger.reserve(keys_for(pool[4], "counts", [LIVE]), GaussianMechanism(7.0))  # open
        split_a_held_class(ledger, url)
        report = ledger.verify()
        assert report.ok, report.problems
    finally:
        ledger.close()


def split_a_held_class(ledger: PrivacyBudgetLedger, url: str) -> None:
    """A release over one subject of a class (query type counts: one class of several
    subjects, split once per call) an open reservation holds: the class splits, and the
    reservation is carried to its new part."""
    ((subject,),) = fetch(
        url,
        f"SELECT min(m.subject) FROM {MEMBERS} m JOIN dp_accounts a ON a.tenant = m.tenant "
        'AND a.subject = m.account AND a.query_type = m.query_type AND a."window" = '
        'm."window" WHERE m."window" = :w AND m.query_type = \'counts\' '
        "AND a.open_reservations > 0 AND a.size > 1",
        w=LIVE,
    )
    ledger.commit(ledger.reserve(key_for(subject, "counts", LIVE), GaussianMechanism(6.0)))


def refinements(url: str) -> list[tuple[int, dict[str, Any]]]:
    """Every cohort of every charge in the history: (seq, its cohort payload)."""
    found = []
    for seq, payload in fetch(url, "SELECT seq, payload FROM dp_history ORDER BY seq"):
        for cohort in json.loads(payload).get("cohorts") or []:
            found.append((seq, cohort))
    return found


@pytest.mark.parametrize("seed", [14, 15])
def test_releases_over_overlapping_random_cohorts_verify_clean(ledger_url, seed):
    """Every kind of refinement happens, on either backend, and the class tables prove
    out (a split copies its parent's spend, listings follow splits, a reset keeps them)."""
    build(ledger_url, seed)
    cohorts = [cohort for _, cohort in refinements(ledger_url)]
    refined = [cohort["refined"] for cohort in cohorts if cohort["refined"]]
    assert any(r["split"] for r in refined) and any(r["kept"] for r in refined)
    assert any(r["new"] for r in refined)
    assert any(split[3] for r in refined for split in r["split"])  # to open reservations
    assert any(cohort["refined"] is None for cohort in cohorts)  # known cohorts
    rows = f'SELECT count(*) FROM {MEMBERS} t WHERE "window" = :w'
    assert fetch(ledger_url, rows, w=LIVE)[0][0] > 0
    # The reset moved its window's accounts out of the live ones and kept its members and
    # listings, each naming one of the window's sealed accounts (its final spend).
    live = 'SELECT count(*) FROM dp_accounts WHERE "window" = :w'
    assert fetch(ledger_url, live, w=RESET) == [(0,)]
    for table in ("dp_members", "dp_cohort_accounts"):
        for window, accounts in ((LIVE, "dp_accounts"), (RESET, "dp_sealed_accounts")):
            named = (
                f"SELECT count(*), count(a.id) FROM {table} t LEFT JOIN {accounts} a ON "
                'a.subject = t.account AND a.query_type = t.query_type AND a."window" = '
                't."window" WHERE t."window" = :w'
            )
            ((rows, found),) = fetch(ledger_url, named, w=window)
            assert rows == found > 0, (table, window, rows, found)


def test_the_digest_order_is_code_point_order_under_a_linguistic_collation():
    """A database whose default collation is ICU en-US sorts "s_1" before "s1": the
    digests are recomputed in code-point order all the same."""
    options = "TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'"
    with scratch_database("dpb_classes_icu", options) as (_, url):
        ordered = "SELECT s FROM unnest(ARRAY['s1', 's_1']) s ORDER BY s"
        assert [row[0] for row in fetch(url, ordered)] == ["s_1", "s1"]  # not Python's order
        build(url)


# ------------------------------------------------------------------ the insider


@pytest.fixture(scope="module")
def templates() -> Iterator[dict[str, Copies]]:
    """The built ledger, once per backend, to copy."""
    made: dict[str, Copies] = {}
    yield made
    for template in made.values():
        template.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def copy(request, templates, tmp_path_factory) -> Callable[[], str]:
    """Makes fresh copies of the built ledger (their URLs), on each backend."""
    backend = request.param
    if backend not in templates:
        made = tmp_path_factory.mktemp(f"classes-{backend}")
        templates[backend] = Copies(backend, made, build)
    return templates[backend].new


@pytest.fixture
def url(copy) -> str:
    """A fresh copy of the built ledger."""
    return copy()


def split_in_live_window(url: str) -> tuple[str, str, str]:
    """(query type, parent, child) of the first split in the live window."""
    for _, cohort in refinements(url):
        if cohort["window"] == LIVE and cohort["refined"] and cohort["refined"]["split"]:
            parent, child = cohort["refined"]["split"][0][:2]
            return cohort["query_type"], parent, child
    raise AssertionError("the build made no split in the live window")


def accounts_of(url: str, query_type: str) -> list[Any]:
    return fetch(
        url,
        'SELECT subject, rho, residual, gaussian_mu2, size FROM dp_accounts WHERE "window" = :w '
        "AND query_type = :q ORDER BY subject",
        w=LIVE,
        q=query_type,
    )


def test_a_subject_moved_to_another_account_is_caught(url):
    subject, account = fetch(
        url,
        'SELECT subject, account FROM dp_members WHERE "window" = :w AND query_type = '
        "'heatmap' ORDER BY subject LIMIT 1",
        w=LIVE,
    )[0]
    other = next(row.subject for row in accounts_of(url, "heatmap") if row.subject != account)
    execute(
        url,
        'UPDATE dp_members SET account = :a WHERE subject = :s AND "window" = :w '
        "AND query_type = 'heatmap'",
        a=other,
        s=subject,
        w=LIVE,
    )
    problems = assert_caught(url, f"member default/{subject}/heatmap/{LIVE}: in account {other}")
    assert any(f"/{account}/heatmap/{LIVE}: " in p and "in dp_members" in p for p in problems)


def test_an_account_size_edited_is_caught(url):
    label = accounts_of(url, "heatmap")[0].subject
    execute(url, "UPDATE dp_accounts SET size = size + 1 WHERE subject = :s", s=label)
    problems = assert_caught(url, "size differs from the history's")
    assert any(p.startswith(f"account default/{label}/heatmap/{LIVE} (holding ") for p in problems)


def test_a_cohort_listing_row_deleted_or_added_is_caught(url, copy):
    (cohort_id, query_type, account) = fetch(
        url,
        'SELECT cohort_id, query_type, account FROM dp_cohort_accounts WHERE "window" = :w '
        "ORDER BY cohort_id, account LIMIT 1",
        w=LIVE,
    )[0]
    execute(
        url,
        "DELETE FROM dp_cohort_accounts WHERE cohort_id = :c AND account = :a",
        c=cohort_id,
        a=account,
    )
    assert_caught(url, f"dp_cohort_accounts lacks its account {account}")
    added = copy()
    listed = {
        row[0]
        for row in fetch(
            added,
            "SELECT account FROM dp_cohort_accounts WHERE cohort_id = :c AND query_type = :q",
            c=cohort_id,
            q=query_type,
        )
    }
    other = next(row.subject for row in accounts_of(added, query_type) if row.subject not in listed)
    execute(
        added,
        'INSERT INTO dp_cohort_accounts (cohort_id, query_type, "window", account) '
        "VALUES (:c, :q, :w, :a)",
        c=cohort_id,
        q=query_type,
        w=LIVE,
        a=other,
    )
    assert_caught(added, f"dp_cohort_accounts lists {other}, the history does not")


@pytest.mark.parametrize(
    "limit",
    [0, 60, audit._SERVER_DIGEST_BYTES],
    ids=["streamed", "mixed", "server-hashed"],
)
def test_a_cohort_member_changed_is_caught(url, monkeypatch, limit):
    """Cohorts streamed and hashed here, or (PostgreSQL, members' text up to the limit)
    hashed by the server, or some each way: the digests of the clean ledger agree with those made at
    registration (ids out of linguistic order, non-ASCII), and a changed member is caught
    either way. Streamed in pages of 12 members: cohorts of many pages, and of exactly one
    page (the build's fresh samples hold 12), whose page after the last is empty."""
    monkeypatch.setattr(audit, "_SERVER_DIGEST_BYTES", limit)
    monkeypatch.setattr(audit, "_MEMBER_BATCH", 12)
    ledger = PrivacyBudgetLedger(url=url, chain_key=KEY)
    assert ledger.verify().ok
    ledger.close()
    cohort_id, subject = fetch(
        url, "SELECT cohort_id, subject FROM dp_cohort_members ORDER BY cohort_id, subject LIMIT 1"
    )[0]
    execute(
        url,
        "UPDATE dp_cohort_members SET subject = 'mallory' WHERE cohort_id = :c AND subject = :s",
        c=cohort_id,
        s=subject,
    )
    assert_caught(url, "its digest is not that of its")


def test_a_cohort_digest_or_size_changed_is_caught(url, copy):
    cohort_id, digest = fetch(url, "SELECT id, digest FROM dp_cohorts ORDER BY id LIMIT 1")[0]
    forged = ("1" if digest[0] != "1" else "2") + digest[1:]
    execute(url, "UPDATE dp_cohorts SET digest = :d WHERE id = :c", d=forged, c=cohort_id)
    problems = assert_caught(url, f"cohort {forged} of default: its digest is not that of")
    assert any(
        f"cohort {digest} of default: named by the history but not stored" in p for p in problems
    )
    resized = copy()
    execute(resized, "UPDATE dp_cohorts SET size = size + 1 WHERE id = :c", c=cohort_id)
    assert_caught(resized, f"cohort {digest} of default: size")


def test_a_child_given_the_spend_of_another_account_is_caught(url):
    """The insider copies the wrong parent's spend into a child (in dp_accounts)."""
    query_type, parent, child = split_in_live_window(url)
    rows = {row.subject: row for row in accounts_of(url, query_type)}
    wrong = next(
        row
        for label, row in rows.items()
        if label not in (parent, child)
        and (row.rho, row.gaussian_mu2) != (rows[child].rho, rows[child].gaussian_mu2)
    )
    execute(
        url,
        "UPDATE dp_accounts SET rho = :r, residual = :x, gaussian_mu2 = :m WHERE subject = :s",
        r=wrong.rho,
        x=wrong.residual,
        m=wrong.gaussian_mu2,
        s=child,
    )
    problems = assert_caught(url, "committed spend differs from the history's")
    assert any(p.startswith(f"account default/{child}/{query_type}/{LIVE} (") for p in problems)


def test_the_reset_windows_kept_members_and_listings_are_proven(url, copy):
    """A reset keeps its window's members and listings under the sealed accounts: a
    subject moved between sealed classes, or a listing dropped, is named as in a live
    window."""
    subject, account = fetch(
        url,
        'SELECT subject, account FROM dp_members WHERE "window" = :w AND query_type = '
        "'heatmap' ORDER BY subject LIMIT 1",
        w=RESET,
    )[0]
    ((other,),) = fetch(
        url,
        'SELECT min(subject) FROM dp_sealed_accounts WHERE "window" = :w AND query_type = '
        "'heatmap' AND subject <> :a",
        w=RESET,
        a=account,
    )
    execute(
        url,
        'UPDATE dp_members SET account = :a WHERE subject = :s AND "window" = :w '
        "AND query_type = 'heatmap'",
        a=other,
        s=subject,
        w=RESET,
    )
    problems = assert_caught(url, f"member default/{subject}/heatmap/{RESET}: in account {other}")
    assert any(f"/{account}/heatmap/{RESET}: " in p and "in dp_members" in p for p in problems)
    listed = copy()
    cohort_id, account = fetch(
        listed,
        'SELECT cohort_id, account FROM dp_cohort_accounts WHERE "window" = :w '
        "ORDER BY cohort_id, account LIMIT 1",
        w=RESET,
    )[0]
    execute(
        listed,
        'DELETE FROM dp_cohort_accounts WHERE cohort_id = :c AND "window" = :w AND account = :a',
        c=cohort_id,
        w=RESET,
        a=account,
    )
    assert_caught(listed, f"dp_cohort_accounts lacks its account {account}")


def test_a_key_carried_to_an_open_reservation_deleted_is_caught(url):
    """The reservation left open holds the new parts of its split accounts as key rows
    past its own: the insider drops one (its commit would no longer charge that part)."""
    reservation, position = fetch(
        url,
        "SELECT k.reservation_id, max(k.position) FROM dp_reservation_keys k JOIN "
        "dp_reservations r ON r.id = k.reservation_id WHERE r.state = 'open' "
        "GROUP BY k.reservation_id HAVING max(k.position) >= min(r.key_count)",
    )[0]
    execute(
        url,
        "DELETE FROM dp_reservation_keys WHERE reservation_id = :r AND position = :p",
        r=reservation,
        p=position,
    )
    assert_caught(url, f"reservation {reservation}: its key rows past those it reserved")


# ------------------------------------------------------------------ the refinements themselves


def edit_entry(url: str, edit: Callable[[dict[str, Any]], bool]) -> int:
    """Edit the payload of the first entry ``edit`` changes (it returns True); its seq."""
    for seq, payload in fetch(url, "SELECT seq, payload FROM dp_history ORDER BY seq"):
        body = json.loads(payload)
        if edit(body):
            execute(
                url, "UPDATE dp_history SET payload = :p WHERE seq = :s", p=json.dumps(body), s=seq
            )
            return seq
    raise AssertionError("no entry to edit")


def drop_an_account(body: dict[str, Any]) -> bool:
    """A cohort charged in the live window charges one account fewer."""
    for cohort in body.get("cohorts") or []:
        if cohort["window"] == LIVE and len(cohort["accounts"]) > 1:
            cohort["accounts"] = cohort["accounts"][1:]
            return True
    return False


def split_another_parent(body: dict[str, Any]) -> bool:
    """A split names the refinement's kept account as its parent: the child copies the
    wrong parent's spend, and the subjects moved are not the ones the members say."""
    for cohort in body.get("cohorts") or []:
        refined = cohort["refined"]
        if cohort["window"] == LIVE and refined and refined["split"] and refined["kept"]:
            parent = refined["split"][0][0]
            refined["split"][0][0], refined["kept"][0] = refined["kept"][0], parent
            refined["kept"].sort()
            return True
    return False


def carry_to_none(body: dict[str, Any]) -> bool:
    """A split of an account held by open reservations says it carried it to none."""
    for cohort in body.get("cohorts") or []:
        for split in (cohort["refined"] or {}).get("split", []):
            if split[3]:
                split[3] = []
                return True
    return False


def rescope_another_subject(body: dict[str, Any]) -> bool:
    """A re-scope says it moved another subject's spend than its accounts'."""
    if "carried" not in body:
        return False
    body["subject"] = "someone-else"
    return True


@pytest.mark.parametrize(
    ("edit", "token"),
    [
        (drop_an_account, "its keys are not the accounts of its cohorts"),
        (split_another_parent, "but the history puts"),
        (carry_to_none, "open reservations, but carries 0 of them"),
        (rescope_another_subject, "re-scopes other accounts than its subject's own"),
    ],
    ids=["accounts", "split-parent", "carried", "rescope-subject"],
)
def test_an_edited_refinement_is_caught_by_the_chain_and_by_the_replay(url, copy, edit, token):
    """The chain catches the edit; re-linked with the real chain key (an insider who
    has it), the replay alone still does."""
    seq = edit_entry(url, edit)
    assert_caught(url, f"entry {seq}: content does not match")
    relinked = copy()
    assert edit_entry(relinked, edit) == seq
    recompute_chain(relinked, history.ChainKey(KEY))
    problems = assert_caught(relinked, token)
    assert not any("does not match" in p for p in problems), problems


def test_legacy_accounts_swapping_their_members_is_caught(ledger_url, ledger_at, make_ledger):
    """Two accounts kept per subject before classes (each a class of one, named by its
    subject) swap their members: every size still holds and neither lies in a cohort, but
    a legacy account holds only its own subject."""
    from tests.ledger.storage.test_pending_and_server_paths import migrate

    cap = BudgetCap(3.0, DELTA)
    old = ledger_at(ledger_url, "0007", cap)
    for name in ("alice", "bob"):
        old.spend(key_for(name, "heatmap", LIVE), GaussianMechanism(8.0))
    migrate(ledger_url, "upgrade", "head")
    ledger = make_ledger(cap=cap, url=ledger_url)
    assert ledger.verify().ok, ledger.verify().problems
    for subject, account in (("alice", "bob"), ("bob", "alice")):
        execute(
            ledger_url,
            "UPDATE dp_members SET account = :a WHERE subject = :s",
            a=account,
            s=subject,
        )
    report = ledger.verify()
    assert not report.ok
    for subject, account in (("alice", "bob"), ("bob", "alice")):
        expected = f"member default/{subject}/heatmap/{LIVE}: in account {account}, the legacy"
        assert any(expected in p for p in report.problems), report.problems
    ledger.close()


def test_an_empty_legacy_account_keeps_its_subject(ledger_url, ledger_at, make_ledger):
    """A legacy account that holds nothing (reserved and released before classes) is kept
    by a release over a cohort, beside the new class of the cohort's other subjects: both
    lie in the same cohort. Its subject moved into that class (and one of the class's own
    deleted, so the class keeps its size) is caught: a listed account keeps its member."""
    from tests.ledger.storage.test_pending_and_server_paths import migrate

    cap = BudgetCap(3.0, DELTA)
    old = ledger_at(ledger_url, "0007", cap)
    old.release(old.reserve([key_for("alice", "heatmap", LIVE)], GaussianMechanism(8.0)))
    migrate(ledger_url, "upgrade", "head")
    ledger = make_ledger(cap=cap, url=ledger_url)
    keys = keys_for(["alice", "bob", "carol"], "heatmap", [LIVE])
    ledger.release(ledger.reserve(keys, GaussianMechanism(8.0)))
    assert ledger.verify().ok, ledger.verify().problems
    label = fetch(ledger_url, "SELECT account FROM dp_members WHERE subject = 'bob'")[0][0]
    execute(ledger_url, "UPDATE dp_members SET account = :a WHERE subject = 'alice'", a=label)
    execute(ledger_url, "DELETE FROM dp_members WHERE subject = 'bob'")
    report = ledger.verify()
    assert not report.ok
    expected = f"account default/alice/heatmap/{LIVE}: 0 members in dp_members"
    assert any(expected in p for p in report.problems), report.problems
    ledger.close()
