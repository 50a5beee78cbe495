"""Releases: the two-phase spend that gates every release.

- ``reservations``: reserve (the prospective check and the hold, one transaction), commit,
  release, renew, reap, one-step spend.
- ``budget_checks``: would a release fit, and with how much noise (no writes).
- ``lease``: how a running attempt is told from an abandoned one.
- ``locks``: the locks and refusals of every write that adds spend (``ChargeLocks``);
  ``reservation_rows``: stored reservations read back one way.
- ``service``: a release from plan to commit (``make_release``), Airflow-free, with one
  named result per outcome; the operator maps the results to Airflow.

Import the modules themselves; this ``__init__`` imports nothing.
"""
