"""Releases: the two-phase spend that gates every release.

- ``reservations``: reserve (the prospective check and the hold, one transaction), commit,
  release, renew, reap, one-step spend.
- ``budget_checks``: would a release fit, and with how much noise (no writes).
- ``lease``: how a running attempt is told from an abandoned one.

Import the modules themselves; this ``__init__`` imports nothing.
"""
