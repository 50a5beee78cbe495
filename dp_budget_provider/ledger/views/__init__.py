"""Read models: the ledger as the CLI, the UI and the privacy report read it (no writes).

- ``reading``: receipts, accounts, history and open reservations, as the ledger offers them.
- ``subject_rows``: the accounts as one row per subject, over stored spend classes;
  ``spend_classes``: the subjects of a window that hold the same spend, as one row.
- ``queries``: filtered, sorted, paginated pages with totals, for browsing.
- ``report``: the privacy report, complete enough to be checked.

Import the modules themselves; this ``__init__`` imports nothing.
"""
