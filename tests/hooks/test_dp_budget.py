"""DPBudgetHook: which ledger a connection points at, and the embedded default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowNotFoundException

from dp_budget_provider.hooks import dp_budget
from dp_budget_provider.hooks.dp_budget import DPBudgetHook
from dp_budget_provider.ledger import BudgetCap, LedgerConfigMismatch, PrivacyBudgetLedger

LEDGER_WINDOWS = ("2026-w45",)  # the windows these tests charge (tests/ledger_time.py)


@pytest.fixture(autouse=True)
def unpinned_allowed(monkeypatch):
    """These tests open ledgers through connections that pin no administrator key (what
    they test is elsewhere); the refusal without the opt-in is tested below."""
    monkeypatch.setenv("AIRFLOW__DP_BUDGET__ALLOW_UNPINNED", "True")


def conn(monkeypatch, conn_id, **fields):
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": "dpbudget", **fields})
    )


def test_extra_url_names_the_ledger(monkeypatch, sqlite_url):
    conn(monkeypatch, "dp_budget_default", extra={"url": sqlite_url})
    assert DPBudgetHook().ledger_url() == sqlite_url


def test_host_fields_build_a_postgresql_url(monkeypatch):
    conn(
        monkeypatch,
        "ledger_pg",
        host="db.internal",
        port=6432,
        schema="ledger",
        login="dp",
        password="s3cr/t",
    )
    url = DPBudgetHook("ledger_pg").ledger_url()
    assert url == "postgresql+psycopg2://dp:s3cr%2Ft@db.internal:6432/ledger"


def test_connection_without_url_or_host_is_an_error(monkeypatch):
    conn(monkeypatch, "empty_ledger")
    with pytest.raises(ValueError, match="neither extra.url nor a host"):
        DPBudgetHook("empty_ledger").ledger_url()


def test_a_missing_named_connection_is_an_error_not_a_default(monkeypatch):
    with pytest.raises(AirflowNotFoundException):
        DPBudgetHook("does_not_exist").ledger_url()


def test_embedded_default_without_a_connection_is_announced_once(
    monkeypatch, tmp_path, caplog, capfd
):
    monkeypatch.delenv("AIRFLOW_CONN_DP_BUDGET_DEFAULT", raising=False)
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    dp_budget._announced_embedded.clear()
    with caplog.at_level("INFO"):
        first = DPBudgetHook().ledger_url()
        second = DPBudgetHook().ledger_url()
    assert first == second == f"sqlite:///{tmp_path / 'dp_budget_ledger.db'}"
    out, err = capfd.readouterr()
    logged = caplog.text + out + err
    assert logged.count("embedded SQLite budget ledger") == 1


def test_a_new_ledger_takes_its_defaults_from_config(monkeypatch, sqlite_url):
    conn(monkeypatch, "dp_budget_default", extra={"url": sqlite_url})
    monkeypatch.setenv("AIRFLOW__DP_BUDGET__DEFAULT_CAP_EPSILON", "1.5")
    monkeypatch.setenv("AIRFLOW__DP_BUDGET__DELTA", "1e-07")
    monkeypatch.setenv("AIRFLOW__DP_BUDGET__WINDOW_CALENDAR", "month")
    ledger = DPBudgetHook().ledger
    policy = ledger.policies()[0]
    assert (policy.cap_epsilon, ledger.delta, policy.calendar.kind) == (1.5, 1e-7, "month")
    # An existing ledger keeps its default cap and calendar whatever the config says now.
    monkeypatch.setenv("AIRFLOW__DP_BUDGET__DEFAULT_CAP_EPSILON", "2.5")
    monkeypatch.setenv("AIRFLOW__DP_BUDGET__WINDOW_CALENDAR", "day")
    reopened = DPBudgetHook().ledger
    assert (reopened.policies()[0].cap_epsilon, reopened.delta) == (1.5, 1e-7)
    ok, message = DPBudgetHook().test_connection()
    assert ok and "ledger OK" in message


def test_a_changed_delta_in_the_config_refuses_to_open_the_ledger(monkeypatch, sqlite_url):
    """Every eps a task reads is at the config's delta: a ledger of another delta is
    refused, naming both values, instead of being read at its own delta silently."""
    conn(monkeypatch, "dp_budget_default", extra={"url": sqlite_url})
    monkeypatch.setenv("AIRFLOW__DP_BUDGET__DELTA", "1e-07")
    DPBudgetHook().ledger.close()
    monkeypatch.setenv("AIRFLOW__DP_BUDGET__DELTA", "1e-05")
    with pytest.raises(LedgerConfigMismatch) as refused:
        DPBudgetHook().get_ledger()
    message = str(refused.value)
    assert "1e-07" in message and "1e-05" in message and "[dp_budget] delta" in message


def test_opening_a_ledger_with_a_conflicting_cap_stays_refused(sqlite_url):
    from dp_budget_provider.ledger import BudgetCap, PrivacyBudgetLedger

    PrivacyBudgetLedger(BudgetCap(1.0, 1e-5), url=sqlite_url).close()
    with pytest.raises(LedgerConfigMismatch):
        PrivacyBudgetLedger(BudgetCap(2.0, 1e-5), url=sqlite_url)


def test_reservations_hold_the_configured_lease_and_reap_reads_its_bounds(monkeypatch, sqlite_url):
    from datetime import datetime

    from dp_budget_provider.accounting import GaussianMechanism
    from dp_budget_provider.ledger import key_for

    conn(monkeypatch, "dp_budget_default", extra={"url": sqlite_url})
    monkeypatch.setenv("AIRFLOW__DP_BUDGET__LEASE_SECONDS", "120")
    hook = DPBudgetHook()
    ledger = hook.ledger
    reservation = ledger.reserve([key_for("alice", "heatmap", "2026-w45")], GaussianMechanism(4))
    lease = datetime.fromisoformat(reservation.lease_expires_at)
    assert (lease - datetime.fromisoformat(reservation.created_at)).total_seconds() == 120
    assert hook.reap() == 0  # leased, and younger than reap_after (a day)
    monkeypatch.setenv("AIRFLOW__DP_BUDGET__REAP_AFTER", "0")
    assert hook.reap() == 1
    assert ledger.open_reservations() == []


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("LEASE_SECONDS", "0", r"\[dp_budget\] lease_seconds must be a number of seconds"),
        ("LEASE_SECONDS", "5m", r"\[dp_budget\] lease_seconds must be a number of seconds"),
        ("LEASE_SECONDS", "1e9", r"\[dp_budget\] lease_seconds must be a number of seconds"),
        ("REAP_AFTER", "-1", r"\[dp_budget\] reap_after must be a whole number of seconds"),
        ("REAP_AFTER", "1d", r"\[dp_budget\] reap_after must be a whole number of seconds"),
        ("REAP_AFTER", "9" * 30, r"\[dp_budget\] reap_after must be a whole number of seconds"),
    ],
)
def test_a_bad_lease_or_reap_bound_is_refused_naming_the_option(
    monkeypatch, sqlite_url, option, value, says
):
    conn(monkeypatch, "dp_budget_default", extra={"url": sqlite_url})
    monkeypatch.setenv(f"AIRFLOW__DP_BUDGET__{option}", value)
    with pytest.raises(ValueError, match=says):
        DPBudgetHook().reap()


def test_a_task_gets_a_gate_that_offers_no_administrators_act_and_no_accounts(
    monkeypatch, sqlite_url
):
    """What a task holds releases within the caps: no policy, quarantine or account read
    is offered, and the ledger underneath refuses an administrator's act without the key."""
    from dp_budget_provider.ledger import AdminAuthorityError, Policy
    from dp_budget_provider.ledger.gate import ReleaseGate

    conn(monkeypatch, "dp_budget_default", extra={"url": sqlite_url})
    hook = DPBudgetHook()
    gate = hook.get_ledger()
    assert isinstance(gate, ReleaseGate)
    for power in (
        "set_policy",
        "clear_quarantine",
        "adopt_chain_key",
        "accounts",
        "epsilon_of",
        "budget_check",
        "subject_of",
        "prospective_epsilon",
        "history",
        "receipt",
    ):
        assert not hasattr(gate, power), power
    with pytest.raises(AdminAuthorityError):
        hook.ledger.set_policy(Policy(50.0))


def test_a_pinned_administrator_key_must_be_the_ledgers(monkeypatch, sqlite_url, caplog, capfd):
    """The connection pins the administrator's public key: a ledger with another key (or
    none) is refused; without a pin the hook warns that a task could become administrator."""
    from dp_budget_provider.ledger import AdminKey, BudgetCap, PrivacyBudgetLedger

    real, insider = AdminKey.generate(), AdminKey.generate()
    PrivacyBudgetLedger(BudgetCap(1.0, 1e-5), url=sqlite_url, admin=real).close()
    conn(
        monkeypatch,
        "dp_budget_default",
        extra={"url": sqlite_url, "admin_public_key": insider.public.text},
    )
    with pytest.raises(LedgerConfigMismatch, match="administrator key"):
        DPBudgetHook().get_ledger()
    conn(
        monkeypatch,
        "dp_budget_default",
        extra={"url": sqlite_url, "admin_public_key": real.public.text},
    )
    assert DPBudgetHook().get_ledger().delta == 1e-5
    other = sqlite_url.replace(".db", "-unadministered.db")
    conn(monkeypatch, "dp_budget_default", extra={"url": other})
    monkeypatch.delenv("AIRFLOW__DP_BUDGET__ALLOW_UNPINNED")
    with pytest.raises(LedgerConfigMismatch, match="pins no administrator key"):
        DPBudgetHook().get_ledger()  # fail closed: a task could become administrator
    assert not Path(other.removeprefix("sqlite:///")).exists()  # and nothing was created
    monkeypatch.setenv("AIRFLOW__DP_BUDGET__ALLOW_UNPINNED", "True")
    DPBudgetHook().get_ledger()
    out, err = capfd.readouterr()
    assert "any task could record one and make itself its administrator" in caplog.text + out + err


KEY = "hook-test-chain-key-0123456789abcdef"


def api_extra(extra: dict) -> dict:
    """``extra`` as Airflow's REST API shows a connection (GET /api/v2/connections/{id}):
    through ConnectionResponse, whose validator redacts it with the secrets masker."""
    from airflow.api_fastapi.core_api.datamodels.connections import ConnectionResponse

    shown = ConnectionResponse(
        connection_id="dp_budget_default",
        conn_type="dpbudget",
        description=None,
        host=None,
        login=None,
        schema=None,
        port=None,
        password=None,
        extra=json.dumps(extra),
        team_name=None,
    )
    return json.loads(shown.extra)


def test_the_chain_key_lives_under_a_name_airflow_masks(monkeypatch, sqlite_url):
    """GET /api/v2/connections/... and `airflow connections` showed extra.chain_key in
    clear text; whoever reads connections could then forge the history's links."""
    extra = {"url": sqlite_url, dp_budget.CHAIN_KEY_FIELD: KEY}
    assert api_extra(extra) == {"url": sqlite_url, dp_budget.CHAIN_KEY_FIELD: "***"}
    conn(monkeypatch, "dp_budget_default", extra=extra)
    assert DPBudgetHook().chain_key() == KEY


def test_the_old_chain_key_name_still_works_with_a_warning(monkeypatch, sqlite_url, caplog, capfd):
    conn(monkeypatch, "ledger_old", extra={"url": sqlite_url, "chain_key": KEY})
    assert DPBudgetHook("ledger_old").chain_key() == KEY
    out, err = capfd.readouterr()
    assert "rename the field to chain_key_secret" in caplog.text + out + err


def test_the_chain_key_is_masked_in_logs_once_read(monkeypatch, sqlite_url):
    """Read from $DP_BUDGET_CHAIN_KEY (or an old name) Airflow knows nothing of it: the hook
    masks it itself, so a task that logs it shows ***."""
    from airflow.sdk.log import redact

    key = "env-chain-key-that-no-log-may-show-42"
    conn(monkeypatch, "ledger_env", extra={"url": sqlite_url})
    monkeypatch.setenv("DP_BUDGET_CHAIN_KEY", key)
    assert DPBudgetHook("ledger_env").chain_key() == key
    assert key not in redact(f"the key is {key}")


def test_the_ui_opens_a_keyed_ledger_with_the_connections_key(monkeypatch, sqlite_url):
    """HookLedgerSource opened the ledger without its key, so every UI page was a 503."""
    from dp_budget_provider.plugins.app import HookLedgerSource

    PrivacyBudgetLedger(BudgetCap(3.0, 1e-5), url=sqlite_url, chain_key=KEY).close()
    conn(monkeypatch, "dp_budget_default", extra={"url": sqlite_url, "chain_key_secret": KEY})
    ledger = HookLedgerSource()()
    try:
        assert ledger.chain_key.keyed and ledger.verify().ok
    finally:
        ledger.close()
