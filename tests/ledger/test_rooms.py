"""The ledger's layout: a thin facade over rooms with one job each, and no Airflow below.

``PrivacyBudgetLedger`` only combines the rooms (reservations, budget checks, reading,
windows, audit), each a class over the shared core; a room imports the core, never
another room, and nothing in the ledger package imports Airflow or the adapters.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dp_budget_provider.ledger as ledger_package
from dp_budget_provider.ledger import PrivacyBudgetLedger
from dp_budget_provider.ledger.core import LedgerCore

ROOMS = (
    "releases.reservations",
    "releases.budget_checks",
    "views.reading",
    "windows.changes",
    "audit.auditing",
)
PACKAGE = "dp_budget_provider.ledger."
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


def test_the_facade_only_combines_the_rooms():
    tree = ast.parse((FOLDER / "ledger.py").read_text())
    (facade,) = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    assert [n for n in facade.body if not isinstance(n, ast.Expr)] == []  # a docstring only
    rooms = [base.__module__.removeprefix(PACKAGE) for base in PrivacyBudgetLedger.__bases__]
    assert sorted(rooms) == sorted(ROOMS)
    assert all(issubclass(base, LedgerCore) for base in PrivacyBudgetLedger.__bases__)


def test_a_room_imports_the_core_never_another_room():
    for room in ROOMS:
        others = {PACKAGE + r for r in ROOMS if r != room}
        names = imported(FOLDER / (room.replace(".", "/") + ".py"))
        assert "dp_budget_provider.ledger.core" in names, room
        assert not names & others, (room, names & others)


def test_no_ledger_module_imports_airflow_or_the_adapters():
    paths = sorted(FOLDER.rglob("*.py"))
    assert FOLDER / "releases" / "reservations.py" in paths
    for path in paths:
        for name in imported(path):
            assert not name.startswith(ADAPTERS), (path, name)
