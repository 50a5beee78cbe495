"""The ledger's layout: a thin facade over collaborators with one job each, no Airflow below.

``PrivacyBudgetLedger`` inherits nothing: it opens the database, builds its collaborators
(reservations, budget checks, reading, window changes, policies, audit), each an object
with its own state, and every public method hands the call to one of them. No
collaborator is a subclass of another or of a shared base, and nothing in the ledger
package imports Airflow or the adapters.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import dp_budget_provider.ledger as ledger_package
from dp_budget_provider.ledger import PrivacyBudgetLedger
from dp_budget_provider.ledger.audit.auditing import Auditor
from dp_budget_provider.ledger.releases.budget_checks import BudgetChecks
from dp_budget_provider.ledger.releases.reservations import Reservations
from dp_budget_provider.ledger.views.reading import Reading
from dp_budget_provider.ledger.windows.changes import WindowChanges
from dp_budget_provider.ledger.windows.policies import Policies

COLLABORATORS = (Reservations, BudgetChecks, Reading, WindowChanges, Policies, Auditor)
ADAPTERS = ("airflow", *(f"dp_budget_provider.{p}" for p in
            ("hooks", "operators", "sensors", "triggers", "plugins", "decorators")))  # fmt: skip
FOLDER = Path(ledger_package.__path__[0])


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_facade_inherits_nothing_and_holds_its_collaborators():
    assert PrivacyBudgetLedger.__bases__ == (object,)
    ledger = PrivacyBudgetLedger(ledger_package.BudgetCap(1.0, 1e-5))
    try:
        held = {type(value) for value in vars(ledger).values()}
        assert set(COLLABORATORS) <= held
    finally:
        ledger.close()


def test_no_collaborator_inherits_from_another_or_a_shared_base():
    for collaborator in COLLABORATORS:
        assert collaborator.__bases__ == (object,), collaborator


def test_every_public_method_is_one_collaborators_documented_method():
    """Each facade method is handed to exactly one collaborator's method of the same name,
    whose docstring and signature it shows."""
    owners = {}
    for name, member in vars(PrivacyBudgetLedger).items():
        if name.startswith("_") or not hasattr(member, "__wrapped__"):
            continue
        wrapped = member.__wrapped__
        (owner,) = [c for c in COLLABORATORS if getattr(c, name, None) is wrapped]
        owners[name] = owner
        assert member.__doc__ == wrapped.__doc__ and wrapped.__doc__
        assert inspect.signature(member) == inspect.signature(wrapped)
    assert {"reserve", "commit", "budget_check", "receipt", "reset", "verify"} <= set(owners)
    assert len(owners) == 44
    assert owners["reserve"] is Reservations and owners["verify"] is Auditor


def test_no_ledger_module_imports_airflow_or_the_adapters():
    paths = sorted(FOLDER.rglob("*.py"))
    assert FOLDER / "releases" / "reservations.py" in paths
    for path in paths:
        for name in imported(path):
            assert not name.startswith(ADAPTERS), (path, name)
