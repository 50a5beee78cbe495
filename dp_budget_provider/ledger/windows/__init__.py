"""Windows and policies: which epoch a release belongs to, what it may spend there.

- ``calendar``: budget windows, their bounds, and when one is closed.
- ``policy``: caps, warning thresholds, grace periods and where each comes from;
  ``policy_store``: the policies as stored, read and written audited.
- ``changes``: reset of closed windows, rescope and correction of accounts.
- ``maintenance``: when the ledger's maintenance last ran, and whether it is overdue.

Import the modules themselves; this ``__init__`` imports nothing.
"""
