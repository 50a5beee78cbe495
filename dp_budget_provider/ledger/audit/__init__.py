"""Audit: proving that the tables agree with the history, and who may change what.

- ``replay``: the facts every table must agree with, proven by replaying the history.
- ``auditing``: verify, checkpoint, quarantine and the chain key, as the ledger offers them.
- ``checkpoints``: chain heads of a verified ledger, kept where its database cannot reach.
- ``authority``: the administrator's key, which no task holds, and what it signs.

Import the modules themselves; this ``__init__`` imports nothing.
"""
