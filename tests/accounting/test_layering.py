"""The accounting layer is pure: standard library and numpy, nothing else."""

import ast
import pkgutil
import sys
from pathlib import Path

import dp_budget_provider.accounting as accounting

ALLOWED_ROOTS = {"numpy", "dp_budget_provider"}


def test_accounting_imports_only_stdlib_numpy_and_itself():
    for module in pkgutil.iter_modules(accounting.__path__):
        path = Path(accounting.__path__[0]) / f"{module.name}.py"
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                root = name.split(".")[0]
                assert root in sys.stdlib_module_names or root in ALLOWED_ROOTS, (path, name)
                if root == "dp_budget_provider":
                    assert name.startswith("dp_budget_provider.accounting"), (path, name)
