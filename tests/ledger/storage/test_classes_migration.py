"""Revision 0008: spend classes. Every account made before it is a class of one.

An account made before 0008 holds one subject's spend under that subject's key. The
upgrade gives it size 1 and one ``dp_members`` row naming itself, keeps every other
column exactly (committed spend, the pending spend of its open reservations, a re-scope's
seal), and leaves the cohort tables empty; the ledger then opens and reads the same
spend. The way back keeps every account as it was, and is refused, writing nothing, once
a class or a cohort exists: revision 0007 would charge a class's subjects again from
zero, and the history would name cohorts whose members were dropped.

The 0007-era accounts and reservations are written in SQL (this package's ledger would
make classes of them), into a ledger the package created and took down to 0007 before
anything was charged.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
import sqlalchemy as sa

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import (
    BudgetCap,
    LedgerKey,
    LedgerSchemaError,
    PrivacyBudgetLedger,
    key_for,
    keys_for,
)
from dp_budget_provider.ledger.storage import history
from tests.ledger.legacy import insert
from tests.ledger.storage.test_history_chains import rows
from tests.ledger.storage.test_pending_and_server_paths import (
    GAUSS,
    GAUSS_B,
    LAPLACE,
    LAPLACE_B,
    REL,
    Cost,
    cost_of,
    epsilon_of_releases,
    execute,
    migrate,
    pending_of,
    snapshot,
    total,
)
from tests.ledger.storage.test_schema_matches_models import assert_schema_is_the_models

CAP = BudgetCap(epsilon=100.0, delta=1e-5)
STAMP = "2027-01-04T00:00:00.000000Z"
W45, W46 = "2026-w45", "2026-w46"
LEDGER_WINDOWS = (W45, W46)
ALICE = key_for("alice", "heatmap", W45)
BOB = key_for("bob", "heatmap", W45)
CAROL = key_for("carol", "heatmap", W45)
CAROL_COUNTS = key_for("carol", "count", W45)  # re-scoped to heatmap: sealed, spend moved
LOOKALIKE = key_for("Class-7", "count", W46)  # the canonical subject "class-7"
ACME_ALICE = key_for("alice", "heatmap", W45, tenant="acme")
# The open reservation, over bob and carol.
OPEN_COST = cost_of(GAUSS_B, 2)
# key: (committed releases, re-scoped to, open reservations)
LEGACY: dict[LedgerKey, tuple[list[tuple[Any, int]], str | None, int]] = {
    ALICE: ([(GAUSS, 2), (LAPLACE, 1)], None, 0),
    BOB: ([(GAUSS, 1)], None, 1),
    CAROL: ([(LAPLACE_B, 1)], None, 1),
    CAROL_COUNTS: ([(LAPLACE_B, 1)], "heatmap", 0),
    LOOKALIKE: ([(GAUSS, 1)], None, 0),
    ACME_ALICE: ([(GAUSS_B, 1)], None, 0),
}
NEW_TABLES = (
    "dp_members",
    "dp_cohorts",
    "dp_cohort_members",
    "dp_cohort_accounts",
    "dp_charge_cohorts",
)
ACCOUNTS = "SELECT * FROM dp_accounts ORDER BY id"
RESERVATIONS = "SELECT * FROM dp_reservations ORDER BY id"
RESERVATION_KEYS = "SELECT * FROM dp_reservation_keys ORDER BY reservation_id, position"
MEMBERS = 'SELECT tenant, query_type, "window", subject, account FROM dp_members'
REVISION = "SELECT version_num FROM dp_budget_alembic_version"


def _residual(cost: Cost) -> str | None:
    return None if cost[1] is None else json.dumps(cost[1].tolist())


def account_row(key: LedgerKey, **values: Any) -> dict[str, Any]:
    """A zero-spend account row of revision 0007's columns, with ``values`` over it."""
    return {
        **key.as_dict(),
        "rho": 0.0,
        "residual": None,
        "gaussian_mu2": 0.0,
        "releases": 0,
        "open_reservations": 0,
        "pending_rho": 0.0,
        "pending_residual": None,
        "pending_mu2": 0.0,
        "pending_others": 0,
        "updated_at": STAMP,
        "rescoped_to": None,
        **values,
    }


def seed_revision_0007(url: str) -> None:
    """Accounts, their windows and an open reservation as revision 0007 wrote them."""
    pending_rho, pending_residual, pending_mu2, pending_others = pending_of(OPEN_COST)
    accounts = []
    for key, (releases, rescoped_to, open_count) in LEGACY.items():
        committed = total(*(cost_of(mechanism, count) for mechanism, count in releases))
        accounts.append(
            account_row(
                key,
                rho=committed[0],
                residual=_residual(committed),
                gaussian_mu2=committed[2],
                releases=sum(count for _, count in releases),
                rescoped_to=rescoped_to,
                **(
                    {
                        "open_reservations": open_count,
                        "pending_rho": pending_rho,
                        "pending_residual": _residual((pending_rho, pending_residual, None)),
                        "pending_mu2": pending_mu2,
                        "pending_others": pending_others,
                    }
                    if open_count
                    else {}
                ),
            )
        )
    insert(url, "dp_accounts", *accounts)
    scopes = sorted({(key.tenant, key.query_type, key.window) for key in LEGACY})
    insert(
        url,
        "dp_windows",
        *(
            {"tenant": tenant, "query_type": query_type, "window": window, "created_at": STAMP}
            for tenant, query_type, window in scopes
        ),
    )
    held = [BOB, CAROL]
    insert(
        url,
        "dp_reservations",
        {
            "id": "r-open",
            "attempt_id": "attempt-r-open",
            "token_hash": hashlib.sha256(b"token").hexdigest(),
            "state": "open",
            "mechanism": history.canonical_json(GAUSS_B.to_spec()),
            "count": 2,
            "cost_rho": OPEN_COST[0],
            "cost_residual": _residual(OPEN_COST),
            "cost_gaussian_mu2": OPEN_COST[2],
            "key_count": len(held),
            "keys_digest": history.keys_digest(held),
            "prospective_epsilon": 0.5,
            "actor": "test",
            "created_at": STAMP,
            "lease_expires_at": STAMP,
        },
    )
    insert(
        url,
        "dp_reservation_keys",
        *(
            {"reservation_id": "r-open", "position": position, **key.as_dict()}
            for position, key in enumerate(held)
        ),
    )


@pytest.fixture
def ledger_at_0007(ledger_url, ledger_at) -> str:
    """A ledger the package made, taken down to 0007 while empty, then seeded."""
    ledger_at(ledger_url, "0007", CAP)
    seed_revision_0007(ledger_url)
    return ledger_url


def schema_of(url: str) -> dict[str, list[str]]:
    """Each table's columns, in order."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            inspector = sa.inspect(connection)
            return {
                table: [column["name"] for column in inspector.get_columns(table)]
                for table in inspector.get_table_names()
            }
    finally:
        engine.dispose()


def assert_legacy_accounts_are_classes_of_one(
    url: str, schema: dict[str, list[str]], before: list[tuple]
) -> None:
    """Every account as it was (``before``, at 0007's ``schema``), with size 1 and one
    member row naming itself; the cohort tables empty."""
    assert schema_of(url) == {
        **schema,
        "dp_accounts": [*schema["dp_accounts"], "size", "cohort_id"],
        # Revision 0010 (the administrator's authority) on the way to the head.
        "dp_ledger_config": [
            *schema["dp_ledger_config"],
            "admin_key",
            "quarantine_epoch",
            "clearance",
            "policy_set",
        ],
        # Revisions 0010 (signatures), 0013 (a horizon's span, a filter order), 0014 (shares).
        "dp_policies": [
            *schema["dp_policies"],
            "signature",
            "calendar_span",
            "filter_order",
            "shares",
        ],
        "dp_members": ["tenant", "query_type", "window", "subject", "account"],
        "dp_cohorts": ["id", "tenant", "digest", "size", "created_at"],
        "dp_cohort_members": ["cohort_id", "subject"],
        "dp_cohort_accounts": ["cohort_id", "query_type", "window", "account"],
        "dp_charge_cohorts": ["seq", "cohort_id", "query_type", "window"],
        # Revision 0011 (a sealed window's final spend, one row per account it held).
        "dp_sealed_accounts": [
            "id",
            "tenant",
            "subject",
            "query_type",
            "window",
            "rho",
            "residual",
            "gaussian_mu2",
            "releases",
            "open_reservations",
            "pending_rho",
            "pending_residual",
            "pending_mu2",
            "pending_others",
            "updated_at",
            "rescoped_to",
            "size",
            "cohort_id",
            "sealed_at",
        ],
        # Revision 0012 (when each maintenance job last ran).
        "dp_maintenance": ["job", "last_run_at", "actor"],
        # Revision 0015 (the answers re-runs of a release are handed).
        "dp_stored_releases": [
            "identity",
            "reservation_id",
            "document",
            "value",
            "receipt",
            "digest",
            "stored_at",
        ],
    }
    assert rows(url, ACCOUNTS) == [(*row, 1, None) for row in before]
    assert sorted(rows(url, MEMBERS)) == sorted(
        (key.tenant, key.query_type, key.window, key.subject, key.subject) for key in LEGACY
    )
    for table in NEW_TABLES[1:]:
        assert rows(url, f"SELECT * FROM {table}") == []


def test_upgrade_makes_every_account_a_class_of_one_and_downgrade_restores_0007(
    ledger_at_0007, make_ledger
):
    url = ledger_at_0007
    schema, before = schema_of(url), rows(url, ACCOUNTS)
    reservations, reservation_keys = rows(url, RESERVATIONS), rows(url, RESERVATION_KEYS)
    assert len(before) == len(LEGACY) and "size" not in schema["dp_accounts"]
    assert set(schema).isdisjoint(NEW_TABLES)

    migrate(url, "upgrade", "head")
    assert_legacy_accounts_are_classes_of_one(url, schema, before)
    assert rows(url, RESERVATIONS) == reservations
    assert rows(url, RESERVATION_KEYS) == reservation_keys
    assert_schema_is_the_models(url)
    ledger = make_ledger(url=url)  # at the package's head revision
    for key, (releases, rescoped_to, _) in LEGACY.items():
        if rescoped_to is None:
            assert ledger.epsilon_of(key) == pytest.approx(epsilon_of_releases(*releases), rel=REL)
    assert [r.id for r in ledger.open_reservations()] == ["r-open"]
    ledger.close()

    # Only classes of one, no cohort: the way back keeps every account as it was (the
    # lookalike subject "class-7" is a subject, not a label).
    migrate(url, "downgrade", "0007")
    assert rows(url, REVISION) == [("0007",)]
    assert schema_of(url) == schema
    assert rows(url, ACCOUNTS) == before
    with pytest.raises(LedgerSchemaError, match="revision '0007'"):
        PrivacyBudgetLedger(url=url)

    migrate(url, "upgrade", "head")  # and up again, to the same
    assert_legacy_accounts_are_classes_of_one(url, schema, before)
    assert_schema_is_the_models(url)


def _class_of_two(url: str) -> None:
    label = "Class-0123456789ab"  # as the subject column holds it (key_for would fold it)
    insert(url, "dp_accounts", account_row(key_for("erin", "count", W46), subject=label, size=2))
    scope = {"tenant": "default", "query_type": "count", "window": W46}
    insert(
        url,
        "dp_members",
        *({**scope, "subject": subject, "account": label} for subject in ("erin", "frank")),
    )


def _size_other_than_one(url: str) -> None:
    execute(url, "UPDATE dp_accounts SET size = 2 WHERE subject = 'alice' AND tenant = 'acme'")


def _cohort(url: str) -> None:
    digest = hashlib.sha256(b"alice").hexdigest()
    insert(
        url,
        "dp_cohorts",
        {"tenant": "default", "digest": digest, "size": 1, "created_at": STAMP},
    )


@pytest.mark.parametrize(
    ("made", "refusal"),
    [
        (_class_of_two, "1 accounts hold the spend of a class of subjects"),
        (_size_other_than_one, "1 accounts hold the spend of a class of subjects"),
        (_cohort, "1 cohorts are named by the history"),
    ],
    ids=["class-label", "size", "cohort"],
)
def test_downgrade_is_refused_once_a_class_or_a_cohort_exists(ledger_at_0007, made, refusal):
    url = ledger_at_0007
    migrate(url, "upgrade", "head")
    made(url)
    written = snapshot(url)
    with pytest.raises(RuntimeError, match=f"cannot downgrade below revision 0008: {refusal}"):
        migrate(url, "downgrade", "0007")
    assert snapshot(url) == written  # nothing dropped, still at the head revision


def test_the_way_back_below_0009_is_refused_once_a_class_refers_to_its_cohort(
    ledger_at_0007, make_ledger
):
    """A release over a cohort new to its window makes a class whose members are the
    cohort's (no dp_members rows): revision 0008 would find them in no class. Without
    such a class the way back drops the column, and the way up restores it."""
    url = ledger_at_0007
    migrate(url, "upgrade", "head")
    written = snapshot(url)
    migrate(url, "downgrade", "0008")
    assert "cohort_id" not in schema_of(url)["dp_accounts"]
    migrate(url, "upgrade", "head")
    assert snapshot(url) == written

    ledger = make_ledger(url=url)
    ledger.commit(
        ledger.reserve(keys_for(["nia", "omar", "pat"], "count", [W46]), GaussianMechanism(8.0))
    )
    assert ledger.epsilon_of(key_for("omar", "count", W46)) > 0
    ledger.close()
    assert rows(url, "SELECT count(*) FROM dp_accounts WHERE cohort_id IS NOT NULL") == [(1,)]
    assert rows(url, "SELECT count(*) FROM dp_members WHERE subject = 'nia'") == [(0,)]
    written = snapshot(url)
    with pytest.raises(RuntimeError, match="cannot downgrade below revision 0009: 1 classes"):
        migrate(url, "downgrade", "0008")
    assert snapshot(url) == written
