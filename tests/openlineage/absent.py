"""An interpreter environment without the OpenLineage packages, for a process of its own.

Blocking imports is not enough: Airflow loads every installed provider through its
distribution's entry points, and fails where one of them does not import. So the process
gets a view of site-packages in which those distributions are not installed at all: a
mirror of symlinks that leaves out their modules and their ``.dist-info`` metadata,
on ``sys.path`` in place of the real directory (``PRELUDE``, run first in the process).
"""

from __future__ import annotations

import fnmatch
import site
from pathlib import Path

#: What ``pip install apache-airflow-providers-openlineage`` adds to site-packages.
HIDDEN = (
    "openlineage",
    "openlineage_sql",
    "openlineage_python-*.dist-info",
    "openlineage_sql-*.dist-info",
    "openlineage_integration_common-*.dist-info",
    "apache_airflow_providers_openlineage-*.dist-info",
    "airflow/providers/openlineage",
)

PRELUDE = """
import site, sys
sys.path[:] = [p for p in sys.path if p != {real!r}]
site.addsitedir({mirror!r})
"""


def _hidden(relative: str) -> bool:
    return any(fnmatch.fnmatch(relative, pattern) for pattern in HIDDEN)


def _on_the_way(relative: str) -> bool:
    """Whether a hidden path lies inside ``relative`` (so it is copied as a directory)."""
    return any(pattern.startswith(relative + "/") for pattern in HIDDEN)


def _mirror(source: Path, target: Path, relative: str = "") -> None:
    target.mkdir(parents=True, exist_ok=True)
    for entry in source.iterdir():
        name = f"{relative}/{entry.name}" if relative else entry.name
        if _hidden(name):
            continue
        if entry.is_dir() and _on_the_way(name):
            _mirror(entry, target / entry.name, name)
        else:
            (target / entry.name).symlink_to(entry)


def without_openlineage(mirror: Path) -> str:
    """Build the mirror under ``mirror``; the prelude that puts it in place of the real
    site-packages."""
    (real,) = site.getsitepackages()
    _mirror(Path(real), mirror)
    return PRELUDE.format(real=real, mirror=str(mirror))
