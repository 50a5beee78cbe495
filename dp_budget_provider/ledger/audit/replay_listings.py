"""dp_cohort_accounts as the replay makes it, kept in a scratch file instead of in memory.

A refinement lists the accounts a cohort covers in its window, and a later split lists
the new part wherever its parent is listed. Those listings are one row per (cohort,
account): as many as the key rows of releases over plain key lists (each list a cohort
of its own), which makes them the one part of the replay that grows with the history
rather than with the accounts. verify keeps them in a private SQLite file in the
temporary directory, with a small page cache, so its memory stays bounded by the
accounts and open reservations whatever the shape of the releases. Cohort digests and
account labels are stored as numbers (interned per scope in the file, and the labels of
a scope's accounts in memory, which are as many as its accounts).

The file is the verifier's own: created empty for one verify, never shared, deleted when
the verify ends (or its process does).
"""

from __future__ import annotations

import sqlite3
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

_SCHEMA = """
PRAGMA journal_mode = OFF;
PRAGMA synchronous = OFF;
PRAGMA temp_store = FILE;
PRAGMA cache_size = -16384;
CREATE TABLE cohort (
    id INTEGER PRIMARY KEY,
    scope INTEGER NOT NULL,
    digest TEXT NOT NULL,
    seen INTEGER NOT NULL DEFAULT 0,
    UNIQUE (scope, digest)
);
CREATE TABLE listing (
    cohort INTEGER NOT NULL,
    account INTEGER NOT NULL,
    PRIMARY KEY (cohort, account)
) WITHOUT ROWID;
CREATE INDEX listing_by_account ON listing (account, cohort);
"""


class ListingStore:
    """The listings of every scope the replay charges, in one scratch SQLite file.

    Account numbers are unique across scopes (each scope numbers its labels from its own
    range), so a listing row needs no scope of its own.
    """

    def __init__(self) -> None:
        self._directory = tempfile.TemporaryDirectory(prefix="dp-budget-verify-")
        self._db = sqlite3.connect(Path(self._directory.name) / "listings.db", isolation_level=None)
        self._db.executescript(_SCHEMA)
        # One transaction for the whole verify, never committed: a statement outside one
        # would be a transaction of its own, each a round of page writes.
        self._db.execute("BEGIN")
        self._scopes = 0
        self._accounts = 0

    def scope(self) -> ScopeListings:
        """The listings of a new scope."""
        self._scopes += 1
        return ScopeListings(self, self._scopes)

    def account_number(self) -> int:
        self._accounts += 1
        return self._accounts

    def execute(self, statement: str, parameters: Iterable = ()) -> sqlite3.Cursor:
        return self._db.execute(statement, tuple(parameters))

    def executemany(self, statement: str, rows: Iterable[tuple]) -> None:
        self._db.executemany(statement, rows)

    def close(self) -> None:
        """Delete the file (idempotent)."""
        self._db.close()
        self._directory.cleanup()


class ScopeListings:
    """One (tenant, query type, window)'s listings: cohort digest -> the labels of the
    accounts partitioning it there, and the reverse, which a split follows."""

    def __init__(self, store: ListingStore, scope: int) -> None:
        self._store = store
        self._scope = scope
        self._numbers: dict[str, int] = {}
        self._labels: dict[int, str] = {}

    def _number(self, label: str) -> int:
        number = self._numbers.get(label)
        if number is None:
            number = self._numbers[label] = self._store.account_number()
            self._labels[number] = label
        return number

    def _cohort(self, digest: str) -> int | None:
        row = self._store.execute(
            "SELECT id FROM cohort WHERE scope = ? AND digest = ?", (self._scope, digest)
        ).fetchone()
        return None if row is None else row[0]

    def record(self, digest: str, labels: set[str]) -> None:
        """A cohort refined here is listed with its accounts."""
        cohort = self._store.execute(
            "INSERT INTO cohort (scope, digest) VALUES (?, ?)", (self._scope, digest)
        ).lastrowid
        self._store.executemany(
            "INSERT INTO listing (cohort, account) VALUES (?, ?)",
            ((cohort, self._number(label)) for label in labels),
        )

    def split(self, parent: str, child: str) -> None:
        """Every cohort listing ``parent`` lists its new part ``child`` too."""
        if parent not in self._numbers:
            return
        self._store.execute(
            "INSERT INTO listing (cohort, account) SELECT cohort, ? FROM listing WHERE account = ?",
            (self._number(child), self._numbers[parent]),
        )

    def labels(self, digest: str) -> set[str] | None:
        """The accounts ``digest`` is listed with here, None when it is not listed."""
        cohort = self._cohort(digest)
        if cohort is None:
            return None
        rows = self._store.execute("SELECT account FROM listing WHERE cohort = ?", (cohort,))
        return {self._labels[number] for (number,) in rows}

    def __contains__(self, digest: object) -> bool:
        return isinstance(digest, str) and self._cohort(digest) is not None

    def __len__(self) -> int:
        """How many cohorts are listed here."""
        return self._store.execute(
            "SELECT count(*) FROM cohort WHERE scope = ?", (self._scope,)
        ).fetchone()[0]

    def see(self, digest: str) -> set[str] | None:
        """:meth:`labels`, and the cohort is marked as found in the table checked."""
        self._store.execute(
            "UPDATE cohort SET seen = 1 WHERE scope = ? AND digest = ?", (self._scope, digest)
        )
        return self.labels(digest)

    def unseen(self) -> Iterator[str]:
        """The cohorts listed here that :meth:`see` never found, in code point order."""
        rows = self._store.execute(
            "SELECT digest FROM cohort WHERE scope = ? AND seen = 0 ORDER BY digest",
            (self._scope,),
        )
        return (digest for (digest,) in rows)

    def cohorts_of(self, label: str) -> set[str]:
        """The cohorts listing the account ``label`` here."""
        number = self._numbers.get(label)
        if number is None:
            return set()
        rows = self._store.execute(
            "SELECT c.digest FROM listing l JOIN cohort c ON c.id = l.cohort WHERE l.account = ?",
            (number,),
        )
        return {digest for (digest,) in rows}

    def lists_account(self, label: str) -> bool:
        """Whether some cohort lists the account ``label`` here."""
        number = self._numbers.get(label)
        return number is not None and (
            self._store.execute(
                "SELECT 1 FROM listing WHERE account = ? LIMIT 1", (number,)
            ).fetchone()
            is not None
        )

    def drop(self) -> None:
        """A reset: the scope's listings are gone (its cohorts stay named)."""
        self._store.execute(
            "DELETE FROM listing WHERE cohort IN (SELECT id FROM cohort WHERE scope = ?)",
            (self._scope,),
        )
        self._store.execute("DELETE FROM cohort WHERE scope = ?", (self._scope,))
        self._numbers.clear()
        self._labels.clear()
