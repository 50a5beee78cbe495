"""Accounts, classes and cohorts: who a charge goes to, and what each account holds.

- ``keys``: the account a cost is charged to (tenant, subject, query type, window).
- ``spend``: an amount of privacy spend as stored; ``standing``: where an account stands
  against its cap, committed and held.
- ``classes``: cohorts and spend classes (a release over many subjects costs one row per
  class); ``memberships``: the one reading of which class holds each subject.
- ``subject_rows``: the accounts as one row per subject, live or sealed;
  ``holdings``: the account each key is charged to, read, and its receipt.
- ``grouped``: the one grouped read of stored spend (the distinct spends some subjects
  hold, and how many hold each); ``held``: what many keys hold, read as distinct states;
  ``concerning``: which history entries and reservations concern a key.
- ``covered``: what a release covers, validated and in lock order; ``pricing``: what a
  release costs and what a spend is worth in eps.

Import the modules themselves; this ``__init__`` imports nothing.
"""
