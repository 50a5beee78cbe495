"""Read models: the ledger as the CLI, the UI and the privacy report read it (no writes).

- ``reading``: receipts, accounts, history and open reservations, as the ledger offers them.
- ``spend_classes``: the subjects of a window that hold the same spend, as one row.
- ``queries``: filtered, sorted, paginated pages with totals, for browsing.
- ``report``: the privacy report, complete enough to be checked.

Import the modules themselves; this ``__init__`` imports nothing.
"""
