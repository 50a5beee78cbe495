"""Only the administrator moves a cap or lifts a quarantine (``ledger.authority``).

The attacks of issue 23, replayed through the public API and the tables: a task (which
holds the worker's connection and chain key, never the administrator's key) raising a cap
with ``set_policy``, clearing a quarantine with ``clear_quarantine``, an insider doing
either in SQL (also with a history entry linked under the chain key), replaying an earlier
clearing, or swapping the administrator key the connections pin.
"""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import (
    AdminAuthorityError,
    AdminKey,
    AdminPublicKey,
    BudgetCap,
    LedgerConfigMismatch,
    LedgerCorrupt,
    LedgerError,
    LedgerQuarantined,
    Policy,
    PrivacyBudgetLedger,
    key_for,
)
from dp_budget_provider.ledger.storage import history
from tests.admin import ADMIN
from tests.ledger.storage.test_pending_and_server_paths import execute, scalar

CHAIN_KEY = "authority-test-chain-key-0123456789"
RELEASE = GaussianMechanism(2.5)  # eps 1.55 alone, 2.29 twice: a cap of 2 takes one
LEDGER_WINDOWS = ("2026-w40",)
KEY = key_for("alice", "heatmap", "2026-w40", tenant="acme")


@pytest.fixture
def ledgers(ledger_url):
    """(the administrator's ledger, a task's ledger) on one database, cap 2 for acme."""
    admin = PrivacyBudgetLedger(
        BudgetCap(3.0, 1e-5), url=ledger_url, admin=ADMIN, chain_key=CHAIN_KEY, actor="ops"
    )
    admin.set_policy(Policy(2.0, tenant="acme", compliance_clause="GDPR Art. 25"))
    task = PrivacyBudgetLedger(url=ledger_url, chain_key=CHAIN_KEY, actor="airflow")
    yield admin, task
    admin.close()
    task.close()


def release(ledger, attempt):
    return ledger.commit(ledger.reserve([KEY], RELEASE, attempt=attempt))


def test_a_task_cannot_raise_a_cap_clear_a_quarantine_or_key_the_history(ledgers, ledger_url):
    admin, task = ledgers
    release(task, "a1")
    before = scalar(ledger_url, "SELECT count(*) FROM dp_history")
    with pytest.raises(AdminAuthorityError, match="administrator"):
        task.set_policy(Policy(50.0, tenant="acme"))
    # A key of the task's own making is not the ledger's: refused when it opens.
    with pytest.raises(LedgerConfigMismatch, match="administrator key"):
        PrivacyBudgetLedger(url=ledger_url, chain_key=CHAIN_KEY, admin=AdminKey.generate())
    admin.quarantine("investigating")
    with pytest.raises(AdminAuthorityError):
        task.clear_quarantine("nightly housekeeping")
    assert task.quarantine_status() is not None
    with pytest.raises(AdminAuthorityError):
        task.adopt_chain_key("another chain key of enough length")
    # Nothing of it was written but the quarantine itself.
    after = scalar(ledger_url, "SELECT count(*) FROM dp_history")
    assert after == before + 1
    admin.clear_quarantine("investigated: INC-7")
    assert task.quarantine_status() is None and task.verify().ok


def test_a_cap_raised_in_sql_is_refused_by_every_release_and_named_by_verify(ledgers, ledger_url):
    admin, task = ledgers
    release(task, "a1")
    url = ledger_url
    execute(url, "UPDATE dp_policies SET cap_epsilon = 50 WHERE tenant = 'acme'")
    with pytest.raises(LedgerCorrupt, match="not signed by the ledger's administrator"):
        task.reserve([KEY], RELEASE, attempt="a2")
    with pytest.raises(LedgerCorrupt, match="not signed"):
        task.budget_check([KEY], RELEASE)
    report = admin.verify()
    assert not report.ok
    assert any("cap_epsilon: 50.0 differs" in problem for problem in report.problems)
    # The administrator restores it, the history says so, and releases go on under cap 2.
    admin.set_policy(Policy(2.0, tenant="acme", compliance_clause="GDPR Art. 25"))
    admin.clear_quarantine("cap restored from its audited entry")
    assert admin.verify().ok
    with pytest.raises(LedgerError):  # a second release would pass 2: refused as before
        release(task, "a3")


def test_a_policy_forged_with_the_chain_key_is_refused_and_named(ledgers, ledger_url):
    """Task code holds the chain key: it can write a row and a history entry whose link
    verifies. Without the administrator's signature neither is honoured."""
    admin, task = ledgers
    url = ledger_url
    forged = Policy(50.0, tenant="acme", compliance_clause="GDPR Art. 25")
    engine = sa.create_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(
                sa.text("UPDATE dp_policies SET cap_epsilon = 50 WHERE tenant = 'acme'")
            )
            history.append(
                connection,
                history.ChainKey(CHAIN_KEY),
                chain=history.KEYLESS_CHAIN,
                at="2026-12-03T00:00:00.000000Z",
                action="policy",
                actor="ops",
                payload={**forged.as_record(), "calendar": forged.calendar.to_spec()},
            )
    finally:
        engine.dispose()
    with pytest.raises(LedgerCorrupt, match="not signed"):
        task.reserve([KEY], RELEASE, attempt="a1")
    problems = admin.verify().problems
    assert any("not signed by the ledger's administrator" in p for p in problems), problems


def test_a_quarantine_lifted_in_sql_or_by_a_replayed_clearing_stays_in_force(ledgers, ledger_url):
    admin, task = ledgers
    url = ledger_url
    admin.quarantine("first")
    admin.clear_quarantine("first investigated")
    old = scalar(url, "SELECT clearance FROM dp_ledger_config")
    admin.quarantine("second")
    # Lifted in SQL: every release refuses.
    execute(url, "UPDATE dp_ledger_config SET quarantined_at = NULL, quarantine_reason = NULL")
    with pytest.raises(LedgerQuarantined, match="without its administrator's signature"):
        task.reserve([KEY], RELEASE, attempt="a1")
    # The first quarantine's clearing, replayed for the second: refused too.
    execute(url, "UPDATE dp_ledger_config SET clearance = :c", c=old)
    with pytest.raises(LedgerQuarantined, match="quarantine #2"):
        task.reserve([KEY], RELEASE, attempt="a2")
    with pytest.raises(LedgerQuarantined):
        task.commit(task.reserve([KEY], RELEASE, attempt="a3"))
    problems = admin.verify(quarantine=False).problems
    assert any("dp_ledger_config.clearance" in p for p in problems), problems
    # Rolling the counter back to before the first quarantine is named by verify.
    execute(url, "UPDATE dp_ledger_config SET quarantine_epoch = 0, clearance = NULL")
    problems = admin.verify(quarantine=False).problems
    assert any("dp_ledger_config.quarantine_epoch" in p for p in problems), problems


def test_the_administrator_key_is_recorded_once_and_a_swapped_key_is_refused(ledger_url):
    """An unadministered ledger changes no policy; ``record_admin_key`` makes the first key
    its administrator's (signing the policies again); a key swapped in SQL is refused by a
    pinned opener and named by verify."""
    task = PrivacyBudgetLedger(BudgetCap(3.0, 1e-5), url=ledger_url)
    with pytest.raises(AdminAuthorityError, match="no administrator key yet"):
        task.set_policy(Policy(1.0))
    admin = PrivacyBudgetLedger(url=ledger_url, admin=ADMIN)
    public = admin.record_admin_key()
    assert public == ADMIN.public.text
    with pytest.raises(LedgerError, match="already"):
        admin.record_admin_key()
    admin.set_policy(Policy(1.0))
    assert admin.verify().ok
    insider = AdminKey.generate()
    execute(ledger_url, "UPDATE dp_ledger_config SET admin_key = :k", k=insider.public.text)
    with pytest.raises(LedgerConfigMismatch, match="administrator key"):
        PrivacyBudgetLedger(url=ledger_url, admin_public_key=public)
    problems = PrivacyBudgetLedger(url=ledger_url).verify(quarantine=False).problems
    assert any("dp_ledger_config.admin_key" in p for p in problems), problems
    history_key = json.loads(
        scalar(ledger_url, "SELECT payload FROM dp_history WHERE action = 'admin-key'")
    )["admin_key"]
    assert history_key == public
    task.close()
    admin.close()


def test_a_quarantine_counter_rolled_back_with_an_earlier_clearing_is_refused(ledgers, ledger_url):
    """Both halves rolled back together (the epoch and its clearing, or epoch 0 and none):
    the history's count of quarantines still says the last one is in force."""
    admin, task = ledgers
    admin.quarantine("first")
    admin.clear_quarantine("first investigated")
    first = scalar(ledger_url, "SELECT clearance FROM dp_ledger_config")
    admin.quarantine("second")
    for epoch, clearance in ((1, first), (0, None)):
        execute(
            ledger_url,
            "UPDATE dp_ledger_config SET quarantined_at = NULL, quarantine_reason = NULL, "
            "quarantine_epoch = :e, clearance = :c",
            e=epoch,
            c=clearance,
        )
        with pytest.raises(LedgerQuarantined, match="rolled back"):
            task.reserve([KEY], RELEASE, attempt=f"a{epoch}")
        with pytest.raises(LedgerQuarantined, match="rolled back"):
            task.budget_check([KEY], RELEASE)


def test_a_policy_deleted_or_replaced_by_an_earlier_signed_one_is_refused(ledgers, ledger_url):
    """Each row is signed, and so is the whole set: deleting acme's row (the looser default
    would apply) or writing back acme's earlier signed row is refused."""
    admin, task = ledgers
    earlier = [
        tuple(row)
        for row in sa.create_engine(ledger_url)
        .connect()
        .execute(
            sa.text(
                "SELECT cap_epsilon, filter_order, signature FROM dp_policies WHERE tenant = 'acme'"
            )
        )
    ]
    admin.set_policy(Policy(1.6, tenant="acme", compliance_clause="GDPR Art. 25"))
    (cap, order, signature) = earlier[0]
    execute(
        ledger_url,
        "UPDATE dp_policies SET cap_epsilon = :c, filter_order = :o, signature = :s "
        "WHERE tenant = 'acme'",
        c=cap,
        o=order,
        s=signature,
    )
    with pytest.raises(LedgerCorrupt, match="set of policies"):
        task.reserve([KEY], RELEASE, attempt="a1")
    execute(ledger_url, "DELETE FROM dp_policies WHERE tenant = 'acme'")
    with pytest.raises(LedgerCorrupt, match="set of policies"):
        task.reserve([KEY], RELEASE, attempt="a2")
    problems = admin.verify(quarantine=False).problems
    assert any("policy ('acme', '*'): in the history but its row is missing" in p for p in problems)


def test_what_a_task_holds_of_a_refusal_is_the_same_whatever_the_reason(ledgers, ledger_url):
    """The gate's refusal carries no context (the ledger's own error names the subject and
    its spend), the same words for every reason, and a reference of one fixed length."""
    from dp_budget_provider.ledger.gate import UNIFORM_REFUSAL, ReleaseGate, ReleaseRefused

    admin, task = ledgers
    gate = ReleaseGate(task)
    long_name = key_for("christopher-" + "x" * 200, "heatmap", KEY.window, tenant="acme")
    refusals = []
    admin.spend(KEY, RELEASE)
    admin.spend(long_name, RELEASE)
    for attempt, key in (("b1", KEY), ("b2", long_name)):
        with pytest.raises(ReleaseRefused) as refused:
            gate.reserve([key], RELEASE, attempt=attempt)
        refusals.append(refused.value)
    admin.quarantine("investigating")
    with pytest.raises(ReleaseRefused) as refused:
        gate.reserve([KEY], RELEASE, attempt="b3")
    refusals.append(refused.value)
    assert not gate.fits([KEY], RELEASE)  # one bit, not an error naming the reason
    texts = {str(r).rsplit(" ", 1)[0] for r in refusals}  # all but the reference
    assert len(texts) == 1 and texts.pop().startswith(UNIFORM_REFUSAL)
    assert len({len(r.reference) for r in refusals}) == 1
    for refusal in refusals:
        assert refusal.__context__ is None and refusal.__cause__ is None
        assert "alice" not in str(refusal) and "christopher" not in str(refusal)
    facts = [ADMIN.open(r.reference) for r in refusals]
    assert [f["refusal"] for f in facts] == [
        "BudgetExhausted",
        "BudgetExhausted",
        "LedgerQuarantined",
    ]
    assert facts[0]["account"] == KEY.as_dict()


def _twin(text: str) -> str:
    """``text`` with its last character's lowest bit flipped: 64 bytes encode to 86
    characters whose last 4 bits carry no data, so plain base64 decodes both alike."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    return text[:-1] + alphabet[alphabet.index(text[-1]) ^ 1]


def test_a_signature_or_key_re_encoded_with_other_spare_bits_is_not_the_same_value():
    """An edited stored signature or pinned key reads as edited, whatever key the session
    drew (a forgiving decoder let such an edit pass verify for some keys)."""
    signature = ADMIN.sign(b"a policy")
    assert ADMIN.public.signed(b"a policy", signature)
    assert not ADMIN.public.signed(b"a policy", _twin(signature))
    with pytest.raises(ValueError, match="admin public key"):
        AdminPublicKey(_twin(ADMIN.public.text))
