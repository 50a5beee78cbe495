"""The administrator of the tests' ledgers: one key, and ledgers opened with it.

A ledger created by :data:`AdminLedger` records :data:`ADMIN` as its administrator, so its
tests may set policies and clear quarantines; a plain ``PrivacyBudgetLedger`` opened on
the same database is what a task holds (no administrator's act succeeds there).
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

from dp_budget_provider.ledger import AdminKey, PrivacyBudgetLedger

ADMIN = AdminKey.generate()
AdminLedger = functools.partial(PrivacyBudgetLedger, admin=ADMIN)


@functools.cache
def admin_key_file() -> Path:
    """:data:`ADMIN` in a key file only its owner can read (for the CLI's --admin-key)."""
    folder = Path(tempfile.mkdtemp(prefix="dp-budget-admin-"))
    path = folder / "admin.key"
    ADMIN.write(path)
    os.chmod(folder, 0o700)
    return path
