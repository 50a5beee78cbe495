"""Read models: the ledger as the CLI, the UI and the privacy report read it (no writes).

- ``reading``: receipts, accounts, history and open reservations, as the ledger offers them.
- ``pages``: what every page shares: filters, a page with its total, policies and epsilons
  looked up once.
- ``queries``: the accounts page (filtered, sorted, paginated subjects with totals) and one
  account's status; the CLI and the UI reach every page through it.
- ``account_history``: one account over time: its history entries, its cumulative epsilon.
- ``release_pages``: what a release held, and the reservations that held a key.
- ``spend_classes``: the subjects of a window that hold the same spend, as one row.
- ``schedule``: history entries as the rows of a release schedule.
- ``report``: the privacy report, complete enough to be checked; ``report_markdown``
  renders it for people; ``privacy_unit`` says what a subject's guarantee covers, scope by
  scope a cap bounds.

Import the modules themselves; this ``__init__`` imports nothing.
"""
