"""The persistent privacy budget ledger: SQLite embedded, PostgreSQL in production.

Imports SQLAlchemy and the accounting layer, never Airflow: the CLI, notebooks and the
Airflow adapters all use this same API.
"""

from dp_budget_provider.ledger.authority import AdminKey, AdminPublicKey
from dp_budget_provider.ledger.classes import Cohort, CohortKeys
from dp_budget_provider.ledger.errors import (
    AdminAuthorityError,
    BudgetExhausted,
    ClockSkew,
    LedgerConfigMismatch,
    LedgerCorrupt,
    LedgerError,
    LedgerQuarantined,
    LedgerSchemaError,
    LedgerUnavailable,
    ReservationClosed,
    ReservationStateError,
    WindowBusy,
    WindowClosed,
    WindowSealed,
)
from dp_budget_provider.ledger.keys import LedgerKey, SubjectSource, key_for, keys_for, subject_ids
from dp_budget_provider.ledger.ledger import PrivacyBudgetLedger
from dp_budget_provider.ledger.policy import ANY, BudgetCap, Policy
from dp_budget_provider.ledger.records import (
    AccountStatus,
    BudgetCheck,
    Reservation,
    SpendReceipt,
    VerifyReport,
)
from dp_budget_provider.ledger.windows import (
    WindowCalendar,
    display_window,
    is_closed,
    window_bounds,
)

__all__ = [
    "ANY",
    "AdminAuthorityError",
    "AdminKey",
    "AdminPublicKey",
    "AccountStatus",
    "BudgetCap",
    "BudgetCheck",
    "BudgetExhausted",
    "ClockSkew",
    "Cohort",
    "CohortKeys",
    "LedgerConfigMismatch",
    "LedgerCorrupt",
    "LedgerError",
    "LedgerQuarantined",
    "LedgerKey",
    "LedgerSchemaError",
    "LedgerUnavailable",
    "Policy",
    "PrivacyBudgetLedger",
    "Reservation",
    "ReservationClosed",
    "ReservationStateError",
    "SpendReceipt",
    "SubjectSource",
    "VerifyReport",
    "WindowBusy",
    "WindowCalendar",
    "WindowClosed",
    "WindowSealed",
    "display_window",
    "is_closed",
    "key_for",
    "keys_for",
    "subject_ids",
    "window_bounds",
]
