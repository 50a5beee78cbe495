"""Fixtures of the UI tests: the auth manager, tokens, and ledgers filled by real releases."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dp_budget_provider.accounting import GaussianMechanism, LaplaceMechanism
from dp_budget_provider.ledger import BudgetCap, LedgerKey, Policy, PrivacyBudgetLedger, key_for
from tests.admin import AdminLedger

WINDOW = "2026-w28"
# The UI's ledgers are keyed, as docs/deploying.md deploys them: a keyed ledger refuses to
# open without its key, which the UI once forgot (every page a 503).
CHAIN_KEY = "ui-test-chain-key-0123456789abcdef"
XSS = "<script>alert(1)</script>"
CLAUSE = "GDPR Art. 25 <b>data minimisation</b>: eps <= 2 per subject & week"


@dataclass
class Seeded:
    """A ledger after real releases, and the keys the tests look at."""

    ledger: PrivacyBudgetLedger
    heatmap: list[LedgerKey]  # 30 acme subjects; 0-9 WARNING, 10-29 ok, 0 EXHAUSTED
    xss: LedgerKey  # a subject that is a script tag, with an open reservation
    exhausted: LedgerKey


def seed(ledger: PrivacyBudgetLedger) -> Seeded:
    """Releases through the ledger API, as DPReleaseOperator makes them.

    acme/heatmap has cap 2: three multi-key Gaussian (z = 4) releases over 30, 20 and 10
    subjects put subjects 0-9 past the warning fraction (eps 1.70), 10-19 at 1.36, 20-29
    at 0.93; a correction pushes subject 0 past the cap. The script-tag subject gets five
    Laplace releases in the default policy (cap 3, a privacy filter at its own order) and
    keeps one reservation open. acme's heatmap cap is checked on the reported epsilon (the
    rule of a ledger charged before filters), so the pages show both rules.
    """
    ledger.set_policy(
        Policy(
            2.0,
            tenant="acme",
            query_type="heatmap",
            compliance_clause=CLAUSE,
            filter_order="reported",
        )
    )
    keys = [key_for(f"user-{i:03d}", "heatmap", WINDOW, tenant="acme") for i in range(30)]
    for run, size in enumerate((30, 20, 10)):
        attempt = f"example_dp_heatmap/release_heatmap/manual__2026-07-{10 + run}/-1/1"
        reservation = ledger.reserve(keys[:size], GaussianMechanism(4.0), attempt=attempt)
        ledger.commit(reservation)
    ledger.correct(keys[0], GaussianMechanism(2.0), reason="release missed by the ledger")
    xss = key_for(XSS, "count", WINDOW)
    for run in range(5):
        ledger.spend(xss, LaplaceMechanism(0.2), attempt=f"counts/count/run{run}/-1/1")
    ledger.reserve([xss], LaplaceMechanism(0.1), attempt="counts/count/run5/-1/1")
    return Seeded(ledger=ledger, heatmap=keys, xss=xss, exhausted=keys[0])


@pytest.fixture
def seeded(ledger_url):
    """A seeded ledger on SQLite and on PostgreSQL (the test runs once on each)."""
    ledger = AdminLedger(BudgetCap(3.0, 1e-5), url=ledger_url, chain_key=CHAIN_KEY)
    try:
        yield seed(ledger)
    finally:
        ledger.close()


@pytest.fixture(scope="session")
def auth_manager(airflow_db):
    """Airflow's configured auth manager (the simple one), initialised as the API server does."""
    from airflow.api_fastapi.app import init_auth_manager

    return init_auth_manager()


def _token(auth_manager, username: str, role: str | None, seconds: int | None = None) -> str:
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    user = SimpleAuthManagerUser(username=username, role=role)
    if seconds is None:
        return auth_manager.generate_jwt(user)
    return auth_manager.generate_jwt(user, expiration_time_in_seconds=seconds)


@pytest.fixture(scope="session")
def admin_token(auth_manager) -> str:
    return _token(auth_manager, "admin", "ADMIN")


@pytest.fixture(scope="session")
def viewer_token(auth_manager) -> str:
    return _token(auth_manager, "viewer", "VIEWER")


@pytest.fixture(scope="session")
def roleless_token(auth_manager) -> str:
    """A valid token of a user the auth manager grants nothing."""
    return _token(auth_manager, "nobody", None)


@pytest.fixture(scope="session")
def expired_token(auth_manager) -> str:
    return _token(auth_manager, "admin", "ADMIN", seconds=-3600)


@pytest.fixture
def client(seeded, admin_token):
    """The UI app on the seeded ledger, authenticated as an admin with a Bearer token."""
    from fastapi.testclient import TestClient

    from dp_budget_provider.plugins.app import create_app

    with TestClient(create_app(lambda: seeded.ledger)) as test_client:
        test_client.headers["Authorization"] = f"Bearer {admin_token}"
        yield test_client


@pytest.fixture
def anonymous(seeded):
    """The same app without credentials."""
    from fastapi.testclient import TestClient

    from dp_budget_provider.plugins.app import create_app

    with TestClient(create_app(lambda: seeded.ledger)) as test_client:
        yield test_client
