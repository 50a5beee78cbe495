"""Storage: where the ledger keeps what it knows, and how it writes it.

- ``schema``: the tables (SQLAlchemy models); ``migrations``: how a database reaches them.
- ``database``: engines, transactions, schema checks; ``clock``: the ledger's time.
- ``history``: the append-only history, a chain of keyed links, written with every change;
  ``entries``: its kinds of entries as typed records (``payloads``: how a record is written
  and read back); ``journal``: how the ledger appends them.
- ``statements``: the write path's hand-written SQL; ``pipeline``: write transactions in
  as few round trips as the database allows; ``dialects``: what the write path does
  differently on PostgreSQL and SQLite (locks, upserts, batching), behind one interface.
- ``transactions``: the ledger's database as its parts use it (``LedgerDatabase``);
  ``journal``: how every part appends to the history under the chain key.

Nothing here decides a budget: these modules store and read back what the packages above
decide. Import the modules themselves; this ``__init__`` imports nothing.
"""
