"""Entry point of the older-code worker of ``test_revision_and_clock.py`` (spawned, a real
OS process).

The worker runs this checkout's code unpatched, and is last week's code relative to the
database: it opens the ledger (with the administrator's key the parent hands it, so the
administrator's acts are refused only for their revision) while the database is at this
code's head, and writes to it, as it may. The parent then upgrades the database to a
newer release's revision, one this code does not know; the worker tries every kind of
write. It reports one plain dict through a queue and never raises.
"""

from __future__ import annotations

from typing import Any

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import AdminKey, LedgerError, Policy, PrivacyBudgetLedger

TIMEOUT = 120.0
READY = "opened and wrote at its own revision"


def writes(ledger: PrivacyBudgetLedger, handed: dict[str, Any]) -> dict[str, Any]:
    """Every kind of write a ledger makes, by name (each run in a write transaction)."""
    key, other = handed["key"], handed["other"]
    reservation = handed["reservation"]
    mechanism = GaussianMechanism(8.0)
    return {
        "reserve": lambda: ledger.reserve(key, mechanism, attempt="older-code"),
        "spend": lambda: ledger.spend(key, mechanism),
        "commit": lambda: ledger.commit(reservation),
        "release": lambda: ledger.release(reservation, "never touched the data"),
        "renew": lambda: ledger.renew(reservation),
        "reap": lambda: ledger.reap(now=handed["long_after"]),
        "set_policy": lambda: ledger.set_policy(Policy(cap_epsilon=50.0, tenant="t")),
        "cohort": lambda: ledger.cohort(["ann", "bob"], tenant="t"),
        "correct": lambda: ledger.correct(key, mechanism, reason="a release it missed"),
        "rescope": lambda: ledger.rescope(key, other, "re-scored"),
        "reset": lambda: ledger.reset(key.window),
        "quarantine": lambda: ledger.quarantine("older code says so"),
        "clear_quarantine": lambda: ledger.clear_quarantine("older code says so"),
    }


def attempt_all(ledger: PrivacyBudgetLedger, handed: dict[str, Any]) -> dict[str, str]:
    """Each write's outcome: ``written``, or the ledger error's class and message."""
    outcomes = {}
    for name, write in writes(ledger, handed).items():
        try:
            write()
            outcomes[name] = "written"
        except LedgerError as error:
            outcomes[name] = f"{type(error).__name__}: {error}"
    return outcomes


def older_code(url: str, admin_pem: bytes, ready: Any, go: Any, results: Any) -> None:
    """Open the ledger with the administrator's key ``admin_pem`` (the parent's: a key
    generated here would not be the ledger's) and write; after the upgrade, try every
    write. A failure before ``ready`` is put on ``ready`` too, so the parent sees it at
    once instead of waiting out its timeout."""
    report: dict[str, Any] = {}
    opened = False
    try:
        ledger = PrivacyBudgetLedger(url=url, admin=AdminKey.from_pem(admin_pem))
        ledger.set_policy(Policy(cap_epsilon=1.5, tenant="t", query_type="before"))
        ready.put(READY)
        opened = True
        handed = go.get(timeout=TIMEOUT)  # the database was upgraded meanwhile
        report["outcomes"] = attempt_all(ledger, handed)
        ledger.close()
    except BaseException as error:
        report["error"] = f"{type(error).__name__}: {error}"
        if not opened:
            ready.put(report["error"])
    results.put(report)
