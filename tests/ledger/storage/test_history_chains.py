"""The history's hash chains (migration 0003): entries spread over chains by key, every
chain verified, and an upgrade from the single chain of revision 0002.

Stored rows are read and tampered with in plain SQL on the ledger's own URL.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import sqlalchemy as sa

from dp_budget_provider.accounting import GaussianMechanism, LaplaceMechanism
from dp_budget_provider.ledger import BudgetCap, LedgerKey, PrivacyBudgetLedger, key_for
from dp_budget_provider.ledger.storage import history
from tests.ledger.releases.test_concurrency import pg_session
from tests.ledger.storage.test_pending_and_server_paths import execute, migrate, scalar

CAP = BudgetCap(epsilon=1e6, delta=1e-5)
WINDOW = "2026-w45"
LEDGER_WINDOWS = (WINDOW,)
GAUSS = GaussianMechanism(50.0)


def rows(url: str, statement: str) -> list[tuple]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            return [tuple(row) for row in connection.execute(sa.text(statement))]
    finally:
        engine.dispose()


def keys_on_distinct_chains(count: int, chains: int = history.CHAINS) -> list[LedgerKey]:
    """``count`` keys whose entries land on ``count`` different chains, none on chain 1."""
    found: dict[int, LedgerKey] = {}
    for i in range(10_000):
        key = key_for(f"subject-{i}", "count", WINDOW)
        chain = history.chain_of(key, chains)
        if chain != history.KEYLESS_CHAIN:
            found.setdefault(chain, key)
        if len(found) == count:
            return list(found.values())
    raise AssertionError("keys did not spread over chains")


def accounts_on_distinct_chains(
    ledger: PrivacyBudgetLedger, count: int
) -> list[tuple[LedgerKey, LedgerKey]]:
    """``count`` (subject key, account key) pairs whose accounts' entries land on ``count``
    different chains, none on chain 1.

    An entry lands on the chain of its (first) account's key, and a new subject's account
    is a new class with a random label: the chain is known once a spend has made it.
    Subjects whose class lands on a chain taken already are spent on and passed over.
    """
    found: dict[int, tuple[LedgerKey, LedgerKey]] = {}
    for i in range(10_000):
        key = key_for(f"subject-{i}", "count", WINDOW)
        account = ledger.spend(key, GAUSS).key
        assert account == ledger.account_of(key) != key  # a class of one, by its label
        chain = history.chain_of(account, history.CHAINS)
        if chain != history.KEYLESS_CHAIN:
            found.setdefault(chain, (key, account))
        if len(found) == count:
            return list(found.values())
    raise AssertionError("accounts did not spread over chains")


def raw_account_keys(url: str) -> list[LedgerKey]:
    """Every account's key as stored (a class's label as its subject part)."""
    return [
        LedgerKey.from_canonical(*row)
        for row in rows(url, 'SELECT tenant, subject, query_type, "window" FROM dp_accounts')
    ]


def key_on_chain(chain: int) -> LedgerKey:
    for i in range(10_000):
        key = key_for(f"first-chain-{i}", "count", WINDOW)
        if history.chain_of(key, history.CHAINS) == chain:
            return key
    raise AssertionError(f"no key maps to chain {chain}")


def test_keys_spread_over_the_chains_and_keyless_entries_use_chain_one():
    keys = [key_for(f"s-{i}", "q", WINDOW) for i in range(2000)]
    counts = Counter(history.chain_of(key, history.CHAINS) for key in keys)
    assert set(counts) == set(range(1, history.CHAINS + 1))  # every chain used
    assert max(counts.values()) < 3 * len(keys) / history.CHAINS
    assert history.chain_of(None, history.CHAINS) == history.KEYLESS_CHAIN
    assert {history.chain_of(key, 1) for key in keys} == {1}
    # Stable (a checksum of the canonical parts, not Python's salted hash()).
    assert history.chain_of(key_for("alice", "heatmap", "2026-w28"), 64) == history.chain_of(
        key_for(" Alice ", "HEATMAP", "2026-W28"), 64
    )


def test_each_entry_lands_on_its_keys_chain_and_every_chain_verifies(ledger_url, make_ledger):
    """Every entry about an account lands on its key's chain (a reservation's: its first
    account's), keyless ones on chain 1; the chains verify, and every head names its
    chain's last entry."""
    ledger = make_ledger(cap=CAP, url=ledger_url)
    charged = accounts_on_distinct_chains(ledger, 5)
    keys = [key for key, _ in charged]
    for key in keys:
        ledger.release(ledger.reserve(key, LaplaceMechanism(1.0)), reason="test")
    multi = ledger.reserve(keys[::-1], GAUSS)  # stored in key order: its first key anchors
    # The same subjects' classes (one cohort covering them wholly), in key order.
    assert list(multi.keys) == sorted(account for _, account in charged)
    ledger.commit(multi)
    accounts = set(raw_account_keys(ledger_url))

    assert scalar(ledger_url, "SELECT chains FROM dp_ledger_config") == history.CHAINS
    assert scalar(ledger_url, "SELECT count(*) FROM dp_chain_head") == history.CHAINS
    entries = rows(
        ledger_url,
        'SELECT seq, chain, action, tenant, subject, query_type, "window", reservation_id '
        "FROM dp_history ORDER BY seq",
    )
    for seq, chain, action, tenant, subject, query_type, window, reservation_id in entries:
        if tenant is not None:
            key = LedgerKey.from_canonical(tenant, subject, query_type, window)
            assert key in accounts, (seq, action)  # an account's key, never a subject's
            assert chain == history.chain_of(key, history.CHAINS), (seq, action)
        elif reservation_id == multi.id:
            assert chain == history.chain_of(multi.keys[0], history.CHAINS)
        else:
            assert action in ("create", "policy") and chain == history.KEYLESS_CHAIN
    used = {chain for _, chain, *_ in entries}
    assert used == {history.KEYLESS_CHAIN} | {history.chain_of(a, history.CHAINS) for a in accounts}
    assert len(used) >= 6
    # seq orders the whole history and every head names its chain's last entry.
    last = {}
    for seq, chain, *_ in entries:
        last[chain] = seq
    heads = dict(rows(ledger_url, "SELECT id, seq FROM dp_chain_head"))
    assert {chain: seq for chain, seq in heads.items() if seq} == last
    assert ledger.verify().ok


def _tampering(url: str) -> dict[str, tuple[str, str]]:
    """Edits of a ledger whose chains 1 and c hold entries (c: the second key's chain)."""
    chain = scalar(url, "SELECT max(chain) FROM dp_history")
    first, last = rows(url, f"SELECT min(seq), max(seq) FROM dp_history WHERE chain = {chain}")[0]
    other = scalar(url, f"SELECT max(seq) FROM dp_history WHERE chain <> {chain}")
    return {
        "delete the last entry of a chain (not the last overall)": (
            f"DELETE FROM dp_history WHERE seq = {last}",
            f"head of chain {chain} does not match",
        ),
        "delete a chain's first entry": (
            f"DELETE FROM dp_history WHERE seq = {first}",
            f"preceding entry of chain {chain}",
        ),
        "move an entry to another chain": (
            f"UPDATE dp_history SET chain = 1 WHERE seq = {last}",
            "preceding entry of chain 1",
        ),
        "swap the order of entries on two chains": (
            f"UPDATE dp_history SET seq = -1 WHERE seq = {last}; "
            f"UPDATE dp_history SET seq = {last} WHERE seq = {other}; "
            f"UPDATE dp_history SET seq = {other} WHERE seq = -1",
            "content does not match its hash",
        ),
        "drop a chain's head": (
            f"DELETE FROM dp_chain_head WHERE id = {chain}",
            f"the head of chain {chain} is missing",
        ),
        "claim fewer chains": (
            "UPDATE dp_ledger_config SET chains = 1",
            "outside 1..1",
        ),
        "add a chain head": (
            f"INSERT INTO dp_chain_head (id, seq, hash) VALUES ({history.CHAINS + 1}, 0, "
            f"'{history.GENESIS}')",
            f"a head for chain {history.CHAINS + 1}",
        ),
    }


@pytest.mark.parametrize(
    "name",
    [
        "delete the last entry of a chain (not the last overall)",
        "delete a chain's first entry",
        "move an entry to another chain",
        "swap the order of entries on two chains",
        "drop a chain's head",
        "claim fewer chains",
        "add a chain head",
    ],
)
def test_verify_finds_tampering_on_any_chain(ledger_url, make_ledger, name):
    ledger = make_ledger(cap=CAP, url=ledger_url)
    (a, _), (b, _) = accounts_on_distinct_chains(ledger, 2)
    for _ in range(3):
        ledger.spend(a, GAUSS)
        ledger.spend(b, GAUSS)
    assert ledger.verify().ok
    statements, problem = _tampering(ledger_url)[name]
    for statement in statements.split("; "):
        execute(ledger_url, statement)
    report = ledger.verify()
    assert not report.ok
    assert any(problem in p for p in report.problems), report.problems


def test_upgrade_from_one_chain_keeps_the_history_and_shards_new_entries(
    ledger_url, ledger_at, make_ledger
):
    """A revision-0002 ledger (one chain) upgraded: old entries stay valid on chain 1,
    numbering continues after them, new entries spread over the chains of their accounts.
    """
    postgresql = ledger_url.startswith("postgresql")
    key = key_on_chain(history.KEYLESS_CHAIN)
    old = ledger_at(ledger_url, "0002", CAP)
    assert scalar(ledger_url, "SELECT count(*) FROM dp_chain_head") == 1
    for _ in range(3):  # on the one chain, and decided by the client
        old.spend(key, LaplaceMechanism(5.0))
    before = rows(ledger_url, "SELECT seq, prev_hash, hash FROM dp_history ORDER BY seq")
    assert [seq for seq, *_ in before] == list(range(1, 9))
    if postgresql:  # 0002's single-chain append is back
        execute(
            ledger_url,
            "SELECT dp_append('2026-11-29T00:00:00.000000Z', 'correction', 'test', NULL, "
            "NULL, NULL, NULL, NULL, '{}', :prefix)",
            prefix='{"action":"correction","actor":"test","at":"2026-11-29T00:00:00.000000Z",'
            '"body":{"key":null,"payload":{},"reservation_id":null},"seq":',
        )
        assert scalar(ledger_url, "SELECT max(seq) FROM dp_history") == 9
        execute(ledger_url, "DELETE FROM dp_history WHERE seq = 9")
        execute(
            ledger_url,
            "UPDATE dp_chain_head SET seq = 8, hash = :hash WHERE id = 1",
            hash=before[-1][2],
        )

    migrate(ledger_url, "upgrade", "head")
    ledger = make_ledger(cap=CAP, url=ledger_url)
    assert ledger.verify().ok, ledger.verify().problems
    assert rows(ledger_url, "SELECT seq, prev_hash, hash FROM dp_history ORDER BY seq") == before
    # A new subject is charged to a new class, on its account's chain; the legacy key's
    # account (a class of one, labelled by its subject) stays on chain 1.
    elsewhere = ledger.spend(keys_on_distinct_chains(1)[0], GAUSS).key
    assert ledger.spend(key, GAUSS).key == key
    assert rows(ledger_url, "SELECT seq, chain FROM dp_history WHERE seq > 8 ORDER BY seq") == [
        (9, history.chain_of(elsewhere, history.CHAINS)),
        (10, history.chain_of(elsewhere, history.CHAINS)),
        (11, 1),
        (12, 1),
    ]
    assert ledger.verify().ok, ledger.verify().problems


def test_downgrade_to_one_chain_is_refused_once_entries_live_on_other_chains(ledger_url, ledger_at):
    old = ledger_at(ledger_url, "0007", CAP)
    old.spend(keys_on_distinct_chains(1)[0], GAUSS)  # sharded by subject, as 0003 to 0007 did
    with pytest.raises(RuntimeError, match="chains other than chain 1"):
        migrate(ledger_url, "downgrade", "0002")
    assert scalar(ledger_url, "SELECT count(*) FROM dp_chain_head") == history.CHAINS


def test_paging_waits_for_an_entry_numbered_before_others_but_still_committing(
    postgres_url, make_ledger
):
    """Entry S is numbered by a transaction that has not committed yet when S+1 and S+2
    (another chain) are already visible: a page after S-1 must wait for S instead of
    returning S+1, S+2 (a reader continuing after S+2 would never see S).
    """
    ledger = make_ledger(cap=CAP, url=postgres_url)
    (_, a), (b, _) = accounts_on_distinct_chains(ledger, 2)  # b's class: not on a's chain
    first = scalar(postgres_url, "SELECT max(seq) FROM dp_history") + 1
    entry = history.entry_columns(
        chain=history.chain_of(a, history.CHAINS),
        at="2026-11-29T00:00:00.000000Z",
        action="note",
        actor="test",
        payload={"note": "still committing"},
    )
    with pg_session(postgres_url, autocommit=False) as slow:
        with slow.cursor() as cursor:  # the append a writer makes, left uncommitted
            cursor.execute(history.PG_LOCK_HEAD, {"chain": entry["chain"]})
            values = history.linked(entry, cursor.fetchone(), history.UNKEYED)
            cursor.execute(history.INSERT_ENTRY, values)
            cursor.execute(history.MOVE_HEAD, values)
            assert values["seq"] == first
        ledger.spend(b, GAUSS)  # first + 1, first + 2, committed
        visible = rows(
            postgres_url, f"SELECT seq FROM dp_history WHERE seq >= {first} ORDER BY seq"
        )
        assert visible == [(first + 1,), (first + 2,)]  # S is not, yet
        committer = threading.Timer(1.0, slow.commit)
        committer.start()
        started = time.monotonic()
        page = ledger.history(after_seq=first - 1)
        waited = time.monotonic() - started
        committer.join()
    assert [e["seq"] for e in page] == [first, first + 1, first + 2]
    assert waited > 0.5
    assert ledger.history(after_seq=first + 2) == []
