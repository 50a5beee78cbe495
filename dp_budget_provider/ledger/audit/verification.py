"""Verifying a ledger: the facts every table must agree with, proven from the history.

The history is the ledger's only source of truth: every other table is what replaying
it must give. ``verify`` checks its links (keyed when the ledger has a chain key, and
against the last checkpoint kept outside the database), then replays it entry by entry
and compares every stored row, column by column, with what the replay says:

* the configuration with its creation (and key adoption) entry, each policy row with
  its latest policy entry, the quarantine with its last quarantine entry;
* each reservation with its reserve entry and its closing entry, each cost with what its
  mechanism costs (a cost an earlier version priced differently, for the mechanisms whose
  curves this version corrected, is noted and the cap proven with the higher price), each
  commit's cost with its reservation's, each key set with its digest;
* each account's committed and pending spend, counts, re-scope mark, time and size;
* each window's row: canonical for its calendar, first charged when the history says,
  sealed exactly when a reset sealed it;
* the spend classes (``classes``): a charge's entry records, per window, the cohort it
  charges and how it refined the window's classes. The replay applies each refinement
  before the entry's own effect: a split's child is a copy of its parent (committed,
  lifetime and pending spend, open reservations, releases, re-scope mark, re-pricing)
  holding the moved subjects, and each of the parent's open reservations holds the child
  as one more key (its later key rows: exactly those); a new account starts from zero.
  The entry's keys must be the accounts of its cohorts, and each cohort's accounts its
  listing as the replay makes it (kept + children + new when refined; a known cohort's
  listing, which every later split of a listed account extended by its child), holding
  exactly the cohort's subjects;
* each cohort's digest and size with its members (streamed in code-point order, as the
  digest is made), and every cohort the history names is stored, of the size it names;
* ``dp_cohort_accounts`` with the replayed listings of the live windows, and
  ``dp_charge_cohorts`` with the cohorts each charge entry names;
* ``dp_members``, from counts the server makes (work proportional to the listings, not
  to the subjects): every account of a live window lies inside each cohort listed with it
  and outside every other cohort listed in the window, a legacy account (a class of one
  charged before classes) holds only its own subject, and each account has as many
  members as its size. A class that refers to its cohort (``memberships``) refers to the
  one the replay made it of, has no ``dp_members`` row, and is counted against the
  window's other listed cohorts over its cohort's members. A reset moves the window's
  accounts to ``dp_sealed_accounts``, each proven like a live one and sealed when the
  reset sealed it, and keeps its members and listings, proven as before (a reset of an
  earlier version dropped all three; its cohorts stay);
* ``dp_stored_releases``: each answer kept for re-runs is the one its identity's last
  keeping commit recorded, unedited, and each reuse hands out an answer a commit kept
  (``replay_stored``);

and proves the cap: no key's lifetime spend in a window (across resets, re-scopes and
corrections) plus what was in flight ever passed the cap in force when a reservation was
granted, and nothing was charged to a sealed window or a re-scoped key.

A reservation's lease (``lease_expires_at``) is no fact of the history and is not checked:
renewals write no entry, and the lease only decides when an open reservation is charged
(the reap entry that charges it is a fact, checked like a commit), never whether.

Memory is bounded by the number of accounts and open reservations, never by the length
of the history or the number of subjects: every table is streamed, the history together
with each entry's reservation keys in one pass, the members one subject at a time, the
server's per-cohort counts one account at a time, and the cohorts the history names are
checked in batches. The windows' listings (one row per cohort and account, as many as
the key rows of releases over plain key lists) are kept in a scratch file
(``replay_listings``), deleted when verify ends.

The replay is ``replay`` (its acts in ``replay_acts``, its charges in ``replay_charges``,
what it holds in ``replay_state``); the tables are proven against it by ``table_checks``
and ``class_checks``. This module keeps the order: the links, the replay, then each table.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, select

from dp_budget_provider.ledger.audit.class_checks import (
    check_cohort_accounts,
    check_cohorts,
    check_members,
    check_named,
)
from dp_budget_provider.ledger.audit.replay import Replay, read_history
from dp_budget_provider.ledger.audit.replay_state import AuditSettings
from dp_budget_provider.ledger.audit.replay_stored import check_stored_releases
from dp_budget_provider.ledger.audit.table_checks import (
    check_accounts,
    check_config,
    check_policies,
    check_reservations,
    check_windows,
)
from dp_budget_provider.ledger.errors import LedgerCorrupt
from dp_budget_provider.ledger.records import VerifyReport
from dp_budget_provider.ledger.storage import history
from dp_budget_provider.ledger.storage.schema import ChainHead, HistoryEntry, LedgerConfig

# Cohorts the replay names before it checks them against dp_cohorts.
_NAMED_BATCH = 10_000


def _marks(connection: Connection, settings: AuditSettings, problems: list[str]) -> dict:
    """Entries that must be in the history unchanged: the checkpoint's, and the heads a key
    adoption sealed (its own keyed link vouches for them)."""
    marks: dict[int, tuple[int, str]] = {}
    adoptions = connection.execute(
        select(HistoryEntry.payload).where(HistoryEntry.action == "adopt-key")
    ).scalars()
    for payload in adoptions:
        try:
            marks.update(history.marks(json.loads(payload)["heads"]))
        except (ValueError, KeyError, TypeError) as error:
            problems.append(f"key adoption entry: unreadable heads ({error!r})")
    checkpoint = settings.checkpoint
    if checkpoint is not None:
        if checkpoint.ledger != history.ledger_identity(connection):
            problems.append(f"the checkpoint of {checkpoint.at} is of another ledger")
        marks.update(checkpoint.marks())
    return marks


def _guarded(problems: list[str], table: str, check: Callable[[], Any]) -> Any:
    """Run one table's check; a row it cannot even read is that table's problem, not a crash."""
    try:
        return check()
    except (ValueError, TypeError, KeyError, LedgerCorrupt) as error:
        problems.append(f"{table}: unreadable ({error!r}); edited?")
        return None


def verify(connection: Connection, settings: AuditSettings) -> VerifyReport:
    """Audit the ledger seen through ``connection`` (one consistent snapshot)."""
    if connection.dialect.name == "postgresql":
        # verify reads every row of every cursor it opens: plan them for the whole result,
        # not for the first tenth (PostgreSQL's default for cursors, which picks nested
        # loops that rescan the cohort members once per member).
        connection.exec_driver_sql("SET LOCAL cursor_tuple_fraction = 1.0")
    config = connection.execute(select(LedgerConfig.chains, LedgerConfig.keyed_from)).first()
    chains, keyed_from = (config.chains, config.keyed_from) if config else (1, None)
    heads = {row.id: (row.seq, row.hash) for row in connection.execute(select(ChainHead))}
    problems: list[str] = []
    marks = _marks(connection, settings, problems)
    problems += [
        f"entry {p.seq}: {p.problem}"
        for p in history.chain_problems(connection, chains, settings.key, keyed_from, marks)
    ]
    replay = Replay(settings)
    try:
        return _replayed(connection, settings, replay, problems, heads)
    finally:
        replay.charges.close()


def _replayed(
    connection: Connection,
    settings: AuditSettings,
    replay: Replay,
    problems: list[str],
    heads: dict[int, tuple[int, str]],
) -> VerifyReport:
    """The replay of the history, then each table against it."""
    configuration, charges = replay.configuration, replay.charges

    def named() -> None:
        _guarded(problems, "dp_cohorts", lambda: check_named(connection, charges.cohorts, problems))

    entries = 0
    for entry, keys, links in read_history(connection):
        entries += 1
        replay.apply(entry, keys, links)
        if len(charges.cohorts) >= _NAMED_BATCH:
            named()
    named()
    charges.finish()
    problems += replay.findings.problems
    _guarded(
        problems,
        "dp_ledger_config",
        lambda: check_config(connection, configuration, settings, problems),
    )
    _guarded(problems, "dp_policies", lambda: check_policies(connection, configuration, problems))
    _guarded(
        problems, "dp_reservations", lambda: check_reservations(connection, settings, problems)
    )
    accounts = _guarded(
        problems, "dp_accounts", lambda: check_accounts(connection, charges, problems)
    )
    _guarded(
        problems,
        "dp_windows",
        lambda: check_windows(connection, configuration, charges, problems),
    )
    _guarded(problems, "dp_cohorts", lambda: check_cohorts(connection, problems))
    _guarded(
        problems,
        "dp_cohort_accounts",
        lambda: check_cohort_accounts(connection, charges, problems),
    )
    _guarded(problems, "dp_members", lambda: check_members(connection, charges, problems))
    _guarded(
        problems,
        "dp_stored_releases",
        lambda: check_stored_releases(connection, replay.kept, problems),
    )
    return VerifyReport(
        entries=entries,
        accounts=accounts or 0,
        problems=problems,
        notes=replay.findings.notes,
        heads=tuple(sorted((chain, seq, link) for chain, (seq, link) in heads.items())),
        keyed=settings.key.keyed,
        ledger=history.ledger_identity(connection),
    )
