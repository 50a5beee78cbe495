"""The spend classes' tables against the replay: the cohorts the history names, each
cohort's digest and size against its members, ``dp_cohort_accounts`` against the replayed
listings, and ``dp_members`` against the accounts the charges made of them (proven from
counts the server makes: work proportional to the listings, not to the subjects).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import operator
from collections.abc import Callable, Iterator
from typing import Any

from sqlalchemy import Connection, and_, func, select, tuple_
from sqlalchemy.dialects.postgresql import aggregate_order_by

from dp_budget_provider.ledger.accounts import classes
from dp_budget_provider.ledger.audit.replay_charges import Charges
from dp_budget_provider.ledger.audit.replay_state import BATCH, KeyState, ScopeState
from dp_budget_provider.ledger.storage.schema import (
    Account,
    ChargeCohort,
    Cohort,
    CohortAccount,
    CohortMember,
    HistoryEntry,
    Member,
    SealedAccount,
)

_MEMBER_BATCH = 50_000  # cohort members: one short text each
# Cohorts PostgreSQL hashes itself: those whose members' text (as stored, separators
# included) stays below its 1 GB limit on one text value, with a margin.
_SERVER_DIGEST_BYTES = 2**30 - 2**20
# Cohort names per query (an IN list of (tenant, digest) pairs).
_NAMES_PER_QUERY = 500


def _listed_nowhere(label: str) -> bool:
    """A scope the history never charged lists no account."""
    return False


def referred_cohort_ids(
    connection: Connection, charges: Charges
) -> dict[tuple[str, str | None], int]:
    """The ids of the cohorts the live accounts refer to, by (tenant, digest): what their
    ``cohort_id`` must be (a cohort's digest is proven from its members by
    :func:`check_cohorts`, so the id names those members)."""
    named = sorted(
        {
            (key.tenant, state.refers)
            for key, state in charges.keys.items()
            if state.refers and (not state.dropped or state.kept)
        }
    )
    ids: dict[tuple[str, str | None], int] = {}
    for start in range(0, len(named), _NAMES_PER_QUERY):
        rows = connection.execute(
            select(Cohort.tenant, Cohort.digest, Cohort.id).where(
                tuple_(Cohort.tenant, Cohort.digest).in_(named[start : start + _NAMES_PER_QUERY])
            )
        )
        ids.update(((row.tenant, row.digest), row.id) for row in rows)
    return ids


def _code_point_order(connection: Connection, column: Any) -> Any:
    """``column`` ordered by code point, as Python sorts (and as cohort digests are made):
    SQLite's binary collation does; PostgreSQL's "C" collation does (UTF-8 bytes)."""
    return column.collate("C") if connection.dialect.name == "postgresql" else column


def check_named(
    connection: Connection, named: dict[tuple[str, str], int], problems: list[str]
) -> None:
    """The cohorts the history named ((tenant, digest) -> size) are stored, of that size;
    the batch is emptied (the replay checks a batch whenever it is full: memory stays
    bounded however many cohorts the history names)."""
    stored: dict[tuple[str, str], int] = {}
    names = sorted(named)
    for start in range(0, len(names), _NAMES_PER_QUERY):
        chunk = names[start : start + _NAMES_PER_QUERY]
        rows = connection.execute(
            select(Cohort.tenant, Cohort.digest, Cohort.size).where(
                tuple_(Cohort.tenant, Cohort.digest).in_(chunk)
            )
        )
        stored.update(((row.tenant, row.digest), row.size) for row in rows)
    for (tenant, digest), size in sorted(named.items()):
        held = stored.get((tenant, digest))
        if held is None:
            problems.append(f"cohort {digest} of {tenant}: named by the history but not stored")
        elif held != size:
            problems.append(
                f"cohort {digest} of {tenant}: size {held}, but the history names {size}"
            )
    named.clear()


def check_cohorts(connection: Connection, problems: list[str]) -> None:
    """Each cohort's digest and size against its members (:func:`_cohort_contents`); no
    member row names a cohort, nor a charge link an entry, that does not exist."""
    for cohort, digest, count in _cohort_contents(connection):
        name = f"cohort {cohort.digest} of {cohort.tenant}"
        if digest != cohort.digest:
            problems.append(f"{name}: its digest is not that of its {count} members")
        if cohort.size != count:
            problems.append(f"{name}: size {cohort.size}, but it has {count} members")
    orphans = connection.execute(
        select(CohortMember.cohort_id)
        .distinct()
        .where(~CohortMember.cohort_id.in_(select(Cohort.id)))
    ).scalars()
    problems += [f"cohort {cid}: member rows of a cohort that does not exist" for cid in orphans]
    unlinked = connection.execute(
        select(ChargeCohort.seq)
        .distinct()
        .where(~ChargeCohort.seq.in_(select(HistoryEntry.seq)))
        .order_by(ChargeCohort.seq)
    ).scalars()
    problems += [
        f"dp_charge_cohorts: rows of entry {seq}, which is not in the history" for seq in unlinked
    ]


def _cohort_contents(connection: Connection) -> Iterator[tuple[Any, str, int]]:
    """Each cohort (id, tenant, digest, size as stored) with the digest and the count of
    its member rows, in cohort order: sha256 of its subjects in code point order, one per
    line (what :func:`classes.cohort_digest` makes of the ids).

    PostgreSQL hashes a cohort itself (one text of its members: none crosses the wire)
    when that text, measured on the member rows (never the cohort's editable ``size``),
    fits :data:`_SERVER_DIGEST_BYTES`; larger cohorts, and every cohort on SQLite (which
    has no sha256), are streamed here in bounded batches.
    """
    cohort = select(Cohort.id, Cohort.tenant, Cohort.digest, Cohort.size)
    streamed = cohort.order_by(Cohort.id)
    if connection.dialect.name == "postgresql":
        members = Cohort.__table__.outerjoin(CohortMember, CohortMember.cohort_id == Cohort.id)
        # One pass over the members for the few cohorts too large for one text (each over
        # a gigabyte of ids); every other cohort is hashed by the server.
        oversized = (
            connection.execute(
                select(CohortMember.cohort_id)
                .group_by(CohortMember.cohort_id)
                .having(
                    func.sum(func.octet_length(CohortMember.subject) + 1) > _SERVER_DIGEST_BYTES
                )
            )
            .scalars()
            .all()
        )
        ordered = _code_point_order(connection, CohortMember.subject)
        joined = func.string_agg(CohortMember.subject, aggregate_order_by("\n", ordered))
        text = func.coalesce(joined, "")
        hashed = (
            cohort.add_columns(
                func.encode(func.sha256(func.convert_to(text, "UTF8")), "hex"),
                func.count(CohortMember.subject),
            )
            .select_from(members)
            .where(Cohort.id.not_in(oversized))
            .group_by(Cohort.id)
            .order_by(Cohort.id)
        )
        for row in connection.execution_options(yield_per=BATCH).execute(hashed):
            yield row, row[4], row[5]
        streamed = streamed.where(Cohort.id.in_(oversized))
    for row in connection.execution_options(yield_per=BATCH).execute(streamed):
        digest, count, separator = hashlib.sha256(), 0, ""
        for text, lines in _member_texts(connection, row.id):
            digest.update((separator + text).encode())
            count, separator = count + lines, "\n"
        yield row, digest.hexdigest(), count


# SQLite: one page of a cohort's members, after a subject, joined into one text by the
# database, with its line count and last subject (plain SQL run by the driver: a statement
# object built per page would cost more than the page, for many cohorts of one subject).
_SQLITE_PAGE = (
    "SELECT group_concat(member, char(10)), count(*), max(member) FROM (SELECT subject "
    "AS member FROM dp_cohort_members WHERE cohort_id = :cohort AND subject > :after "
    "ORDER BY subject LIMIT :lines) AS page"
)


def _member_texts(connection: Connection, cohort_id: int) -> Iterator[tuple[str, int]]:
    """A cohort's subjects in code point order, as texts of up to ``_MEMBER_BATCH`` lines
    and their line counts (bounded memory, no row object per member).

    SQLite joins them itself, a page of its members' index at a time (its binary
    collation is code point order), each page after the last subject of the one before:
    ``group_concat`` joins the rows of the ordered page in the order it reads them; were
    it ever not, the digest would differ and verify fail, never pass. PostgreSQL (a cohort
    too large to hash in one text) streams them in one sort, through a server-side
    cursor: its index is in the database's collation, so pages would each sort anew.
    """
    if connection.dialect.name == "postgresql":
        cursor = connection.connection.cursor(name=f"dp_verify_cohort_{int(cohort_id)}")
        try:
            cursor.execute(
                "SELECT subject FROM dp_cohort_members WHERE cohort_id = %s "
                'ORDER BY subject COLLATE "C"',
                (cohort_id,),
            )
            while rows := cursor.fetchmany(_MEMBER_BATCH):
                yield "\n".join(subject for (subject,) in rows), len(rows)
        finally:
            cursor.close()
        return
    after = ""  # below every subject (none is empty)
    while True:
        named = {"cohort": cohort_id, "after": after, "lines": _MEMBER_BATCH}
        text, lines, last = connection.exec_driver_sql(_SQLITE_PAGE, named).one()
        if not lines:
            return
        yield text, lines
        if lines < _MEMBER_BATCH:
            return
        after = last


def check_cohort_accounts(connection: Connection, charges: Charges, problems: list[str]) -> None:
    """dp_cohort_accounts against the replayed listings of the live scopes."""
    statement = (
        select(
            CohortAccount.cohort_id,
            CohortAccount.query_type,
            CohortAccount.window,
            CohortAccount.account,
            Cohort.tenant,
            Cohort.digest,
        )
        .outerjoin(Cohort, Cohort.id == CohortAccount.cohort_id)
        .order_by(CohortAccount.cohort_id, CohortAccount.query_type, CohortAccount.window)
    )
    rows = connection.execution_options(yield_per=BATCH).execute(statement)
    for (cohort_id, query_type, window), group in itertools.groupby(
        rows, key=lambda row: (row.cohort_id, row.query_type, row.window)
    ):
        listed = list(group)  # one cohort's accounts in one scope: bounded by the classes
        first = listed[0]
        if first.tenant is None:
            problems.append(f"dp_cohort_accounts: rows of cohort {cohort_id}, which does not exist")
            continue
        scope = (first.tenant, query_type, window)
        name = f"cohort {first.digest} in window {window} of ({first.tenant}, {query_type})"
        known = charges.scopes.get(scope)
        listing = None if known is None else known.listings.see(first.digest)
        if listing is None:
            problems.append(
                f"{name}: has accounts in dp_cohort_accounts, but none in the history (or its "
                "window was reset)"
            )
            continue
        stored = {row.account for row in listed}
        for label in sorted(stored - listing):
            problems.append(f"{name}: dp_cohort_accounts lists {label}, the history does not")
        for label in sorted(listing - stored):
            problems.append(f"{name}: dp_cohort_accounts lacks its account {label}")
    for scope, known in charges.scopes.items():
        problems += [
            f"cohort {digest} in window {scope[2]} of ({scope[0]}, {scope[1]}): "
            "its accounts are missing from dp_cohort_accounts"
            for digest in known.listings.unseen()
        ]


def check_members(connection: Connection, charges: Charges, problems: list[str]) -> None:
    """Every live scope's membership, proven from counts the server makes, in work
    proportional to the listings (not to the subjects).

    In the history's model every account of a scope is an atom of its cohorts: an account
    listed for a cohort lies inside it, any other account lies outside it (a refinement
    lists the parts it covers, and a later split lists the child wherever the parent is).
    So dp_members is right when (1) each account has as many members as the replay gives
    it subjects (:func:`_check_sizes`), (2) for each cohort listed in the scope, an
    account has either all its members in it (listed there) or none (not listed), and
    (3) a legacy account (a subject's own, from before classes) holds only its subject.
    (2) is one count per (account, cohort) pair; the cohorts come from
    dp_cohort_accounts, which :func:`check_cohort_accounts` proves equal to the replay's
    listings. A class whose members are its cohort's has no dp_members row (1), and its
    pairs are counted over its cohort's members (:func:`_check_referring`): its
    reference is :func:`table_checks.check_accounts`'s, its cohort's members
    :func:`check_cohorts`'.
    """
    members = Member.__table__
    cohort_members = CohortMember.__table__.alias("cm")
    listed = (
        select(
            CohortAccount.cohort_id,
            Cohort.tenant,
            CohortAccount.query_type,
            CohortAccount.window,
            Cohort.digest,
        )
        .join(Cohort, Cohort.id == CohortAccount.cohort_id)
        .distinct()
        .subquery("listed")
    )
    scope_columns = (members.c.tenant, members.c.query_type, members.c.window)
    # Both streams in code point order, the order the merge below compares in.
    scope_order = [_code_point_order(connection, column) for column in scope_columns]
    counted = (
        select(*scope_columns, members.c.account, func.count().label("n"))
        .group_by(*scope_columns, members.c.account)
        .order_by(*scope_order)
    )
    paired = (
        select(
            *scope_columns,
            members.c.account,
            listed.c.digest,
            func.count().label("n"),
        )
        .select_from(
            members.join(cohort_members, cohort_members.c.subject == members.c.subject).join(
                listed,
                and_(
                    listed.c.cohort_id == cohort_members.c.cohort_id,
                    listed.c.tenant == members.c.tenant,
                    listed.c.query_type == members.c.query_type,
                    listed.c.window == members.c.window,
                ),
            )
        )
        .group_by(*scope_columns, members.c.account, listed.c.digest)
        .order_by(*scope_order, _code_point_order(connection, members.c.account))
    )
    of_scope = operator.itemgetter(0, 1, 2)
    # Streamed, one account's pairs at a time: a scope may list as many (account, cohort)
    # pairs as its releases had keys.
    pairs = itertools.groupby(
        connection.execution_options(yield_per=BATCH).execute(paired), key=of_scope
    )
    pending: tuple[Any, Iterator[Any]] | None = next(pairs, None)
    sizes = charges.sizes()
    counts_of = itertools.groupby(
        connection.execution_options(yield_per=BATCH).execute(counted), key=of_scope
    )
    taken = False  # pending's pairs went to a scope: the next scope's come after them
    for scope, rows in counts_of:
        counts = {row.account: row.n for row in rows}
        if taken:
            pending, taken = next(pairs, None), False
        while pending is not None and pending[0] < scope:
            pending = next(pairs, None)
        scope_pairs: Iterator[Any] = iter(())
        if pending is not None and pending[0] == scope:
            scope_pairs, taken = pending[1], True
        tenant, query_type, window = scope
        known = charges.scopes.get(scope)
        expected = sizes.pop(scope, {})
        if known is None or (known.sealed_at is not None and not known.kept):
            problems.append(
                f"dp_members: members of window {window} of ({tenant}, {query_type}), which "
                "the history never charged or has reset"
            )
            continue
        _check_sizes(scope, counts, expected, known.listings.lists_account, problems)
        _check_atoms(connection, scope, known, counts, scope_pairs, problems)
        problems += _check_referring(connection, scope, known, expected)
    for scope, expected in sizes.items():
        known = charges.scopes.get(scope)
        listed = _listed_nowhere if known is None else known.listings.lists_account
        _check_sizes(scope, {}, expected, listed, problems)
        if known is not None and (known.sealed_at is None or known.kept):
            problems += _check_referring(connection, scope, known, expected)
    _check_legacy_members(connection, problems)


def _check_atoms(
    connection: Connection,
    scope: classes.Scope,
    known: ScopeState,
    counts: dict[str, int],
    pairs: Iterator[Any],
    problems: list[str],
) -> None:
    """Each stored account of a scope against the cohorts listed there: all its members
    in those the history lists it in, none in the others (``pairs``: its members per
    cohort, as counted by the server, one account's after another)."""
    paired: set[str] = set()
    for account, rows in itertools.groupby(pairs, key=operator.attrgetter("account")):
        paired.add(account)
        found = {row.digest: row.n for row in rows}
        _check_account_atoms(connection, scope, known, account, counts[account], found, problems)
    for account in sorted(counts.keys() - paired):
        _check_account_atoms(connection, scope, known, account, counts[account], {}, problems)


def _check_account_atoms(
    connection: Connection,
    scope: classes.Scope,
    known: ScopeState,
    account: str,
    held: int,
    found: dict[str, int],
    problems: list[str],
) -> None:
    """One account of ``held`` members, of which ``found[digest]`` are in each cohort."""
    tenant, query_type, window = scope
    listed = known.listings.cohorts_of(account)
    for digest, n in sorted(found.items()):
        if digest not in listed:
            example = _example_member(connection, scope, account, digest, inside=True)
            others = f" (and {n - 1} more)" if n > 1 else ""
            problems.append(
                f"member {tenant}/{example}/{query_type}/{window}{others}: in account "
                f"{account}, and in cohort {digest}, but the history puts no subject of that "
                "account in that cohort"
            )
    for digest in sorted(listed):
        inside = found.get(digest, 0)
        if inside == held:
            continue
        example = _example_member(connection, scope, account, digest, inside=False)
        others = f" (and {held - inside - 1} more)" if held - inside > 1 else ""
        problems.append(
            f"member {tenant}/{example}/{query_type}/{window}{others}: in account "
            f"{account}, but not in cohort {digest}, where the history puts every "
            "subject of that account"
        )


def _example_member(
    connection: Connection,
    scope: classes.Scope,
    account: str,
    digest: str,
    *,
    inside: bool,
) -> str | None:
    """The least member of ``account`` inside (or outside) the scope's cohort ``digest``:
    what a problem names (only read when verify has found one)."""
    tenant, query_type, window = scope
    in_cohort = (
        select(CohortMember.subject)
        .join(Cohort, Cohort.id == CohortMember.cohort_id)
        .where(
            Cohort.tenant == tenant,
            Cohort.digest == digest,
            CohortMember.subject == Member.subject,
        )
        .exists()
    )
    return connection.execute(
        select(func.min(Member.subject)).where(
            Member.tenant == tenant,
            Member.query_type == query_type,
            Member.window == window,
            Member.account == account,
            in_cohort if inside else ~in_cohort,
        )
    ).scalar()


def _check_legacy_members(connection: Connection, problems: list[str]) -> None:
    """A legacy account (a subject's own, named by it) never splits: it holds at most its
    own subject. Any other member named in it is a problem (the first hundred listed)."""
    prefix = classes.LABEL_PREFIX
    strays = connection.execute(
        select(Member.tenant, Member.subject, Member.query_type, Member.window, Member.account)
        .where(
            func.substr(Member.account, 1, len(prefix)) != prefix,
            Member.account != Member.subject,
        )
        .order_by(Member.tenant, Member.query_type, Member.window, Member.subject)
        .limit(100)
    )
    problems += [
        f"member {row.tenant}/{row.subject}/{row.query_type}/{row.window}: in account "
        f"{row.account}, the legacy account of another subject"
        for row in strays
    ]


def _check_sizes(
    scope: tuple[str, str, str],
    counts: dict[str, int],
    expected: dict[str, KeyState],
    is_listed: Callable[[str], bool],
    problems: list[str],
) -> None:
    """Each account of a scope has as many dp_members rows as the replay gives it subjects,
    none when its members are its cohort's (they are counted with the cohort).

    Only a legacy account that holds nothing and no cohort lists may have no members (a
    reset before seals dropped its row). A listed one must keep its member: the cohort
    checks see an account only through its members, so an empty legacy account would
    otherwise hide its subject moved into a class sharing its cohorts."""
    tenant, query_type, window = scope
    for label in sorted(counts.keys() | expected.keys()):
        state = expected.get(label)
        held = counts.get(label, 0)
        size = 0 if state is None or state.refers else state.size
        if held != size and (held or state is None or state.required or is_listed(label)):
            refers = state.refers if state is not None else None
            referring = f" (its members are cohort {refers}'s)" if refers else ""
            problems.append(
                f"account {tenant}/{label}/{query_type}/{window}: {held} members in "
                f"dp_members, but the history gives it {size} subjects there{referring}"
            )


def _check_referring(
    connection: Connection, scope: classes.Scope, known: ScopeState, expected: dict[str, KeyState]
) -> list[str]:
    """The accounts of a scope whose members are their cohort's, against the other
    cohorts listed there: all of its members in those the history lists it in, none in
    the others. One count per (account, other cohort) pair, made by the server over the
    members of the accounts' cohorts, once per scope; nothing to count in a scope that
    lists one cohort (repeated releases over one population)."""
    referring = {label: state for label, state in expected.items() if state.refers}
    if not referring or len(known.listings) < 2:
        return []
    tenant, query_type, window = scope
    mine, theirs = CohortMember.__table__.alias("mine"), CohortMember.__table__.alias("theirs")
    listed_here = select(CohortAccount.cohort_id).where(
        CohortAccount.query_type == query_type, CohortAccount.window == window
    )
    digests = dict(
        connection.execute(
            select(Cohort.id, Cohort.digest).where(
                Cohort.tenant == tenant, Cohort.id.in_(listed_here)
            )
        ).all()
    )
    # From the accounts to their members, to the other cohorts holding each (by subject):
    # ``+ 0`` keeps a planner from reaching those cohorts through the listing instead (each
    # listed cohort probed for each member: quadratic in the window's small classes).
    counted: dict[tuple[str, str], int] = {}
    accounts = SealedAccount if known.kept else Account
    for label, cohort_id, n in connection.execute(
        select(accounts.subject, theirs.c.cohort_id, func.count())
        .select_from(accounts)
        .join(mine, mine.c.cohort_id == accounts.cohort_id)
        .join(
            theirs,
            and_(theirs.c.subject == mine.c.subject, theirs.c.cohort_id != mine.c.cohort_id),
        )
        .where(
            accounts.tenant == tenant,
            accounts.query_type == query_type,
            accounts.window == window,
            (theirs.c.cohort_id + 0).in_(listed_here),
        )
        .group_by(accounts.subject, theirs.c.cohort_id)
    ):
        if cohort_id in digests:  # (a cohort of another tenant shares the window's name)
            counted[(label, digests[cohort_id])] = n
    problems: list[str] = []

    def wrong(label: str, digest: str, inside: int, listed: bool) -> None:
        problems.append(
            f"account {tenant}/{label}/{query_type}/{window}: {inside} of its "
            f"{referring[label].size} members (cohort {referring[label].refers}'s) are in "
            f"cohort {digest}, where the history puts {'all' if listed else 'none'} of them"
        )

    # Pairs the server found, then listed pairs it did not: work in the pairs, not in
    # accounts x cohorts. (An account the replay has no reference for is named by the
    # accounts' check, a cohort listed nowhere here by the listings'.)
    listed_in = functools.cache(known.listings.cohorts_of)
    for (label, digest), inside in sorted(counted.items()):
        state = referring.get(label)
        if state is not None and digest in known.listings and digest != state.refers:
            listed = digest in listed_in(label)
            if inside != (state.size if listed else 0):
                wrong(label, digest, inside, listed)
    for label, state in sorted(referring.items()):
        for digest in sorted(listed_in(label) - {state.refers}):
            if (label, digest) not in counted:
                wrong(label, digest, 0, True)
    return problems
