"""Stored releases, replayed and proven: the answers the history's commits kept, every
reuse of one, and ``dp_stored_releases`` against them.

A commit that kept its release's answer records the release's identity and the digest of
its identity document, answer and receipt (``CommitEntry.stored``). The replay remembers
each, and which commit kept each identity's answer last. Then:

* a reap keeps no answer (its attempt died before it had one);
* a keeping commit replaces the identity's last kept answer (its mark names it): a row
  deleted or rolled back before a commit shows here, as a commit that replaced another;
* a reuse hands out the identity's last kept answer, as that commit recorded it (a row
  rolled back to an answer a refresh replaced is served once, and named here);
* each stored row is the answer that its identity's last keeping commit recorded: its
  digests made again from its columns (an answer, receipt or document edited in the
  database no longer makes them), the reservation, digest and time of that commit; and
  every identity a commit kept an answer for still has its row.

What the replay holds grows with the number of releases whose answers were kept, never
with their size or the number of subjects.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, select

from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.audit.replay_state import ENTRY_BATCH, Findings, Handler
from dp_budget_provider.ledger.releases.stored import row_problem
from dp_budget_provider.ledger.storage.entries import CommitEntry, ReapEntry, ReuseEntry
from dp_budget_provider.ledger.storage.payloads import Entry
from dp_budget_provider.ledger.storage.schema import StoredRelease


class KeptAnswers:
    """The answers the history's commits kept, as the replay reaches them."""

    def __init__(self, findings: Findings) -> None:
        self.findings = findings
        # reservation -> (identity, digest, when its commit kept it)
        self.kept: dict[str, tuple[str, str, str]] = {}
        self.last: dict[str, str] = {}  # identity -> the reservation that kept it last

    def handlers(self) -> dict[type[Entry], Handler]:
        """The reuses (a commit's kept answer is noted by :meth:`note`)."""
        return {ReuseEntry: self._on_reuse}

    def note(self, entry: Any, record: Entry) -> None:
        """Note the answer a commit kept (any other entry keeps none)."""
        if not isinstance(record, CommitEntry) or record.stored is None:
            return
        if isinstance(record, ReapEntry):
            self.findings.problem(entry, "a reap keeps no answer (its attempt never had one)")
            return
        mark = record.stored
        last = self.last.get(mark.identity)
        if mark.replaces != last:
            self.findings.problem(
                entry,
                f"its answer for release {mark.identity} replaced reservation "
                f"{mark.replaces}'s, but the last kept was {last}'s (a stored answer deleted "
                "or rolled back before it?)",
            )
        self.kept[entry.reservation_id] = (mark.identity, mark.digest, entry.at)
        self.last[mark.identity] = entry.reservation_id

    def _on_reuse(self, entry: Any, reused: ReuseEntry, keys: list[LedgerKey]) -> None:
        if self.kept.get(reused.reservation, ())[:2] != (reused.identity, reused.digest):
            self.findings.problem(
                entry,
                f"it hands out an answer of release {reused.identity} that no commit of "
                f"reservation {reused.reservation} before it kept",
            )
        elif self.last.get(reused.identity) != reused.reservation:
            self.findings.problem(
                entry,
                f"it hands out reservation {reused.reservation}'s answer of release "
                f"{reused.identity}, not the last kept ({self.last.get(reused.identity)}'s): "
                "a stored answer rolled back?",
            )


def check_stored_releases(connection: Connection, kept: KeptAnswers, problems: list[str]) -> None:
    """Each ``dp_stored_releases`` row against the commit that kept its answer last."""
    rows = connection.execution_options(yield_per=ENTRY_BATCH).execute(
        select(StoredRelease).order_by(StoredRelease.identity)
    )
    unseen = dict(kept.last)
    for row in rows:
        name = f"dp_stored_releases: release {row.identity}"
        unseen.pop(row.identity, None)
        problem = row_problem(row)
        if problem is not None:
            problems.append(f"{name}: {problem} (edited?)")
        elif kept.kept.get(row.reservation_id) != (row.identity, row.digest, row.stored_at):
            problems.append(
                f"{name}: its answer is not the one the commit of reservation "
                f"{row.reservation_id} kept (edited?)"
            )
        elif kept.last.get(row.identity) != row.reservation_id:
            problems.append(
                f"{name}: its answer is reservation {row.reservation_id}'s, not that of the "
                f"identity's last commit {kept.last.get(row.identity)}"
            )
    for identity, reservation in sorted(unseen.items()):
        problems.append(
            f"dp_stored_releases: release {identity}: the answer the commit of reservation "
            f"{reservation} kept is missing"
        )
