"""The persistent privacy budget ledger: SQLite embedded, PostgreSQL in production.

Imports SQLAlchemy and the accounting layer, never Airflow: the CLI, notebooks and the
Airflow adapters all use this same API.
"""

from dp_budget_provider.ledger.accounts.classes import Cohort, CohortKeys, covered_by, subjects_in
from dp_budget_provider.ledger.accounts.keys import (
    LedgerKey,
    SubjectSource,
    canonical_subject_ids,
    key_for,
    keys_for,
    subject_ids,
)
from dp_budget_provider.ledger.audit.authority import AdminKey, AdminPublicKey
from dp_budget_provider.ledger.audit.checkpoints import (
    Checkpoint,
    CheckpointFile,
    CheckpointStore,
    CheckpointUnreadable,
    verify_and_checkpoint,
)
from dp_budget_provider.ledger.errors import (
    AdminAuthorityError,
    AttemptReused,
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
from dp_budget_provider.ledger.gate import ReleaseGate, ReleaseReceipt, ReleaseRefused
from dp_budget_provider.ledger.ledger import PrivacyBudgetLedger
from dp_budget_provider.ledger.records import (
    AccountStatus,
    BudgetCheck,
    Reservation,
    SpendReceipt,
    VerifyReport,
)
from dp_budget_provider.ledger.releases.filtering import ContributionTable, unit_digest
from dp_budget_provider.ledger.releases.guarantee import CohortSizeBucket, ReleaseGuarantee
from dp_budget_provider.ledger.releases.identity import (
    ReleaseIdentity,
    ReleaseSlot,
    query_digest,
)
from dp_budget_provider.ledger.releases.lease import lease_of_seconds
from dp_budget_provider.ledger.releases.service import (
    DeclaredRelease,
    ReleaseOutcome,
    ReleaseResult,
    make_release,
)
from dp_budget_provider.ledger.storage.database import POSTGRES_DRIVER
from dp_budget_provider.ledger.storage.history import CHAIN_KEY_ENV, ChainKey
from dp_budget_provider.ledger.windows.calendar import (
    WindowCalendar,
    display_window,
    is_closed,
    window_bounds,
)
from dp_budget_provider.ledger.windows.maintenance import (
    MaintenanceState,
    job_intervals,
    overdue_warning,
)
from dp_budget_provider.ledger.windows.policy import ANY, BudgetCap, Policy
from dp_budget_provider.ledger.windows.shares import Share

__all__ = [
    "ANY",
    "AccountStatus",
    "AdminAuthorityError",
    "AdminKey",
    "AdminPublicKey",
    "AttemptReused",
    "BudgetCap",
    "BudgetCheck",
    "BudgetExhausted",
    "CHAIN_KEY_ENV",
    "ChainKey",
    "Checkpoint",
    "CheckpointFile",
    "CheckpointStore",
    "CheckpointUnreadable",
    "ClockSkew",
    "Cohort",
    "CohortKeys",
    "CohortSizeBucket",
    "DeclaredRelease",
    "LedgerConfigMismatch",
    "LedgerCorrupt",
    "LedgerError",
    "LedgerKey",
    "LedgerQuarantined",
    "LedgerSchemaError",
    "LedgerUnavailable",
    "MaintenanceState",
    "POSTGRES_DRIVER",
    "Policy",
    "Share",
    "PrivacyBudgetLedger",
    "ReleaseGate",
    "ReleaseGuarantee",
    "ReleaseIdentity",
    "ReleaseOutcome",
    "ReleaseReceipt",
    "ReleaseRefused",
    "ReleaseResult",
    "ReleaseSlot",
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
    "ContributionTable",
    "canonical_subject_ids",
    "covered_by",
    "display_window",
    "is_closed",
    "job_intervals",
    "key_for",
    "keys_for",
    "lease_of_seconds",
    "make_release",
    "overdue_warning",
    "query_digest",
    "subject_ids",
    "subjects_in",
    "unit_digest",
    "verify_and_checkpoint",
    "window_bounds",
]
