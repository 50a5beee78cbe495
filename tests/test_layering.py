"""The package's imports run one way: no cycle, no private name taken from another module,
and the layers stay apart (``accounting`` <- ``ledger`` <- the Airflow adapters, which use
the ledger's public surface ``dp_budget_provider.ledger`` only).

Parsed from the source (``ast``), so a cycle hidden behind a function-level import is found
as well as one at the top of a module.

A ratchet while the ledger is redesigned into packages (issue 24): what each test finds must
equal its ``KNOWN_`` list exactly, so a new adapter reaching into the ledger fails, and so
does a fixed one left on the list (take it off). The list ends empty.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import dp_budget_provider

PACKAGE = Path(dp_budget_provider.__file__).parent
NAME = "dp_budget_provider"


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "migrations" in path.relative_to(PACKAGE).parts:
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(module: str) -> Iterator[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) of every import of the package."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(NAME):
                    yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if not base.startswith(NAME):
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in MODULES:
                    yield submodule, None, node.lineno
                else:
                    yield base, alias.name, node.lineno


def _target(imported: str) -> str:
    """The package module an import names (its longest known prefix)."""
    while imported not in MODULES:
        imported = imported.rpartition(".")[0]
    return imported


def _graph() -> dict[str, set[str]]:
    """Module -> the modules it imports; a package's ``__init__`` re-exporting its own
    modules is an edge too, but importing a name from a package counts as importing that
    package only when the name is defined there."""
    graph: dict[str, set[str]] = {module: set() for module in MODULES}
    for module in MODULES:
        for imported, _name, _line in _imports(module):
            target = _target(imported)
            if target != module:
                graph[module].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _short(module: str) -> str:
    return module.removeprefix(NAME + ".")


_CLI_REACHES = {
    "arguments": "accounts.keys audit.checkpoints windows.calendar",
    "inspection": "accounts.classes accounts.keys audit.authority views.queries views.report "
    "views.spend_classes windows.calendar windows.maintenance",
    "output": "records views.report",
    "parser": "audit.authority storage.history views.report windows.calendar",
    "target": "audit.authority storage.database storage.history storage.schema",
    "upkeep": "audit.authority storage.database storage.history views.report windows.calendar "
    "windows.policy",
}
KNOWN_ADAPTER_REACHES = {
    *(
        (f"cli.{command}", f"ledger.{module}")
        for command, modules in _CLI_REACHES.items()
        for module in modules.split()
    ),
    ("plugins.admin", "ledger.accounts.keys"),
    ("plugins.admin", "ledger.windows.policy"),
    ("plugins.admin", "ledger.windows.calendar"),
    ("plugins.admin_routes", "ledger.errors"),
    *(
        ("plugins.app", f"ledger.{module}")
        for module in [
            "audit.authority",
            "accounts.classes",
            "accounts.keys",
            "windows.maintenance",
            "views.queries",
            "records",
            "views.report",
            "views.spend_classes",
            "windows.calendar",
        ]
    ),
    ("plugins.chart", "ledger.windows.policy"),
    ("plugins.chart", "ledger.views.account_history"),
    ("plugins.links", "ledger.accounts.keys"),
    ("plugins.templates", "ledger.windows.calendar"),
}

ADAPTERS = (
    "hooks",
    "operators",
    "sensors",
    "triggers",
    "plugins",
    "decorators",
    "cli",
    "assets",
    "openlineage",
)


def _layer(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_no_import_cycle_anywhere_in_the_package():
    # A package's __init__ importing its own modules, and those modules importing each
    # other, is not a cycle through the __init__: drop the edges from a module to a package
    # that contains it (it reaches its siblings directly).
    graph = {
        module: {
            target
            for target in targets
            if not (_is_package(target) and module.startswith(target + "."))
        }
        for module, targets in _graph().items()
    }
    found = [{_short(module) for module in cycle} for cycle in _cycles(graph)]
    assert found == []


def test_no_private_name_is_imported_from_another_module():
    crossings = {
        (_short(module), name, _short(imported))
        for module in MODULES
        for imported, name, _line in _imports(module)
        if name is not None and name.startswith("_") and not name.startswith("__")
    }
    assert crossings == set()


def test_the_lower_layers_never_import_the_upper_ones():
    """``accounting`` imports nothing of the package above it and no Airflow; the ledger
    imports no adapter and no Airflow."""
    wrong = []
    for module in MODULES:
        layer = _layer(module)
        if layer not in ("accounting", "ledger"):
            continue
        for imported, _name, line in _imports(module):
            target = _layer(_target(imported))
            if (layer == "accounting" and target not in ("accounting", "")) or (
                layer == "ledger" and target in ADAPTERS
            ):
                wrong.append(f"{module}:{line} imports {imported}")
        tree = ast.parse(MODULES[module].read_text())
        for node in ast.walk(tree):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            wrong += [
                f"{module}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == "airflow"
            ]
    assert wrong == []


def test_adapters_reach_into_the_ledger_only_where_known():
    reaches = {
        (_short(module), _short(_target(imported)))
        for module in MODULES
        if _layer(module) in ADAPTERS
        for imported, _name, _line in _imports(module)
        if _layer(_target(imported)) == "ledger" and _target(imported) != f"{NAME}.ledger"
    }
    assert reaches == KNOWN_ADAPTER_REACHES
