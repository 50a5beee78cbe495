"""Audit: proving that the tables agree with the history, and who may change what.

- ``verification``: verify, the facts every table must agree with, proven in order: the
  history's links, its replay, then each table against the replay.
- ``replay``: the history read in order and applied, entry by entry, by the acts or the
  charges its action names.
- ``replay_acts``: the configuration and authority acts (creation, keys, policies,
  quarantines) as the history makes them.
- ``replay_charges``: the charges (reserve, commit, release, correction, re-scope, reset)
  as the history makes them: spend, reservations, windows, classes, the cap.
- ``replay_state``: what the replay holds (per account, open reservation and window), what
  it finds, and the verifier's settings.
- ``table_checks``: configuration, policies, reservations, accounts and windows against the
  replay.
- ``class_checks``: cohorts, listings and members against the replay.
- ``auditing``: verify, checkpoint, quarantine and the chain key, as the ledger offers them.
- ``checkpoints``: chain heads of a verified ledger, kept where its database cannot reach.
- ``authority``: the administrator's key, which no task holds, and what it signs.

Import the modules themselves; this ``__init__`` imports nothing.
"""
