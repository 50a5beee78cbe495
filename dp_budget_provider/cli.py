"""``dp-budget``: create, inspect, audit and maintain a privacy budget ledger from a shell.

The ledger database comes from ``--url`` or the ``DP_BUDGET_URL`` environment variable
(``sqlite:////path/ledger.db`` or ``postgresql://user@host/db``), its chain key
(the secret its history is linked with) from ``DP_BUDGET_CHAIN_KEY``. Or ``--conn-id ID``
names the Airflow connection the tasks use: its URL and chain key are read through
Airflow's secrets backends by :class:`~dp_budget_provider.hooks.dp_budget.DPBudgetHook`,
so the CLI opens exactly the ledger the tasks open. Every command goes through the same
:mod:`dp_budget_provider.ledger` API the Airflow operators use; Airflow is imported only
for ``--conn-id``.

Exit codes: 0 success; 1 the ledger refused or failed (one ``dp-budget: error:`` line on
stderr), or ``verify`` found problems; 2 a usage error (bad arguments or values, no ledger
URL).

Commands (each takes ``--url URL`` or ``--conn-id ID``)::

    dp-budget admin keygen --out FILE
    dp-budget admin init                 (administrator: needs --admin-key FILE)
    dp-budget refusal REFERENCE          (administrator)
    dp-budget db upgrade
    dp-budget db adopt-key               (administrator)
    dp-budget init --epsilon E --delta D [--warn-fraction F] [--conversion improved|classic]
    dp-budget status [--window W] [--tenant T] [--limit N] [--offset N] [--json]
    dp-budget classes [--tenant T] [--query-type Q] [--window W] [--subject S] [--state S]
                      [--members CLASS] [--limit N] [--offset N] [--json]
    dp-budget show SUBJECT QUERY_TYPE WINDOW [--tenant T] [--json]
    dp-budget history [--limit N] [--after SEQ] [--before SEQ] [--newest-first] [--json]
    dp-budget verify [--checkpoint FILE]
    dp-budget quarantine show | clear --reason TEXT    (clear: administrator)
    dp-budget reset --window W | --closed
    dp-budget reap [--older-than DURATION]
    dp-budget policy list [--json]
    dp-budget policy set --epsilon E [--tenant T] [--query-type Q] [--warn-fraction F]
                         [--calendar iso_week|month|day|fixed] [--length-seconds N]
                         [--min-window-seconds N] [--grace DURATION] [--clause TEXT]
                                         (administrator)
    dp-budget report [--format md|json] [--window W] [--tenant T]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import sys
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from dp_budget_provider import __version__
from dp_budget_provider.accounting import CONVERSIONS
from dp_budget_provider.ledger import ANY, BudgetCap, LedgerError, PrivacyBudgetLedger, key_for
from dp_budget_provider.ledger.accounts import classes
from dp_budget_provider.ledger.accounts.keys import MAX_STORED_INT, canonical_part
from dp_budget_provider.ledger.audit.authority import ADMIN_KEY_ENV, AdminKey, AdminPublicKey
from dp_budget_provider.ledger.audit.checkpoints import CheckpointFile, CheckpointUnreadable
from dp_budget_provider.ledger.records import AccountStatus
from dp_budget_provider.ledger.storage import database, history
from dp_budget_provider.ledger.storage.schema import LedgerConfig
from dp_budget_provider.ledger.views import queries, report, spend_classes
from dp_budget_provider.ledger.views.queries import MAX_PAGE
from dp_budget_provider.ledger.windows import maintenance
from dp_budget_provider.ledger.windows.calendar import CALENDAR_KINDS, display_window, window_bounds
from dp_budget_provider.ledger.windows.policy import revised_policy

URL_ENV = "DP_BUDGET_URL"
WINDOW_LABELS = (
    "a window label of the scope's calendar: ISO week 2026-w49, month 2026-12, day "
    "2026-12-01, or a fixed calendar's label"
)
DEFAULT_STATUS_LIMIT = 50
DEFAULT_HISTORY_LIMIT = 100
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_DURATION = re.compile(r"(?:\d+(?:\.\d+)?[smhdw])+")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class CommandError(Exception):
    """The command cannot do what was asked (exit 1)."""


class UsageError(Exception):
    """The command line is incomplete (exit 2)."""


# ---------------------------------------------------------------------- argument types


def parse_duration(text: str) -> timedelta:
    """``30s``, ``30m``, ``2h``, ``1d``, ``1w`` or combinations like ``1h30m``."""
    compact = text.strip().lower().replace(" ", "")
    if not _DURATION.fullmatch(compact):
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: use a number and a unit s, m, h, d or w (e.g. 2h, 30m)"
        )
    seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(compact))
    try:
        # total_seconds() of timedelta.max rounds up to a float timedelta cannot hold,
        # so the bound is checked by building it.
        return timedelta(seconds=seconds)
    except (OverflowError, ValueError):
        raise argparse.ArgumentTypeError(
            f"duration {text!r} is too long: at most {timedelta.max.days} days"
        ) from None


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    if value > MAX_STORED_INT:
        raise argparse.ArgumentTypeError(f"expected a number up to {MAX_STORED_INT}, got {text!r}")
    return value


def _page_number(text: str) -> int:
    """A page number: a whole number from 1."""
    value = _count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"pages are numbered from 1, got {text!r}")
    return value


_SEALED_HELP = "include sealed windows' final spend (state SEALED); a named --window does"


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _positive(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = _positive(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


# The longest span a timedelta (and so a window or a minimum window) can hold, in seconds.
_MAX_SECONDS = timedelta.max.days * 86400


def _seconds(text: str) -> int:
    value = _count(text)
    if not 0 < value <= _MAX_SECONDS:
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds from 1 to {_MAX_SECONDS}, got {text!r}"
        )
    return value


def _window_label(text: str) -> str:
    """A calendar window label, canonical: a label no calendar produces names no window, so
    a command filtered by it would answer "nothing" for a typo."""
    try:
        label = canonical_part("window", text)
        window_bounds(label)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a window label: use {WINDOW_LABELS}"
        ) from None
    return label


def _window_filter(text: str) -> str:
    """A window label, or a pattern with ``*`` (any run of characters) matching labels."""
    return text if "*" in text else _window_label(text)


def _checkpoint_file(text: str) -> CheckpointFile:
    """A file verify can read and append to; checked before the verify, whose failure
    would otherwise read as a problem of the ledger."""
    try:
        path = Path(text).expanduser().resolve() if text.strip() else None
        if path is not None and path.exists():
            usable = path.is_file() and os.access(path, os.R_OK | os.W_OK)
        elif path is not None:
            folder = next(parent for parent in path.parents if parent.exists())
            usable = folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)
            usable = usable and all(len(part.encode()) <= 255 for part in path.parts)
        else:
            usable = False
    except (OSError, ValueError):  # a NUL byte, an unencodable or over-long name
        usable = False
    if not usable:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a file verify can read and append checkpoints to"
        )
    store = CheckpointFile(path)
    try:
        store.check()  # the wrong file is the user's mistake, not tampering to quarantine for
    except (CheckpointUnreadable, OSError) as error:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a checkpoint file ({error}); name the file earlier verifies "
            "appended to, or a new one"
        ) from None
    return store


# ---------------------------------------------------------------------- opening the ledger


@dataclass(frozen=True)
class LedgerTarget:
    """The ledger a command works on: its database URL and its history's chain key."""

    url: str
    chain_key: str | None
    admin_pin: str | None = None  # the administrator key the connection pins
    # The maintenance jobs' intervals under the deployment's schedules (``--conn-id``
    # reads them from Airflow's configuration); None: the shipped DAGs' defaults.
    maintenance_intervals: Mapping[str, timedelta] | None = None


def _target_from_environment(args: argparse.Namespace) -> LedgerTarget:
    url = getattr(args, "url", None) or os.environ.get(URL_ENV)
    if not url:
        raise UsageError(
            f"no ledger database given: pass --url URL, set {URL_ENV} or pass --conn-id ID"
        )
    return LedgerTarget(url, os.environ.get(history.CHAIN_KEY_ENV) or None)


def _target_from_connection(conn_id: str) -> LedgerTarget:
    """The URL and chain key of an Airflow connection, read by the tasks' own hook (so
    every secrets backend, and the embedded default for ``dp_budget_default``, apply).

    Airflow's logging writes to the stdout it finds when it is set up (on import) and when
    a logger is first used; the CLI's stdout is the command's output (``--json``, a report
    redirected to a file). So Airflow is imported and asked here with stderr as its stdout,
    and the CLI uses no Airflow after that.
    """
    with contextlib.redirect_stdout(sys.stderr):
        return _read_connection(conn_id)


def _read_connection(conn_id: str) -> LedgerTarget:
    try:
        from airflow.sdk.exceptions import AirflowNotFoundException

        from dp_budget_provider.hooks.dp_budget import DPBudgetHook
        from dp_budget_provider.hooks.maintenance import maintenance_intervals
    except ImportError as error:
        raise UsageError(
            f"--conn-id needs Apache Airflow, which cannot be imported here ({error}); "
            f"install apache-airflow or pass --url URL / set {URL_ENV}"
        ) from None
    # Outside a task the Task SDK searches the metadata database only in a "server"
    # process; this is an administrator's tool, like `airflow connections get`, which
    # declares itself one the same way.
    os.environ.setdefault("_AIRFLOW_PROCESS_CONTEXT", "server")
    # Airflow's logging config shows INFO; the schema migrations' chatter is not output.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    hook = DPBudgetHook(conn_id)
    try:
        return LedgerTarget(
            hook.ledger_url(), hook.chain_key(), hook.admin_public_key(), maintenance_intervals()
        )
    except AirflowNotFoundException:
        raise CommandError(
            f"--conn-id {conn_id}: no such Airflow connection in any secrets backend "
            f"(AIRFLOW_CONN_{conn_id.upper()}, the metadata database or the configured backend)"
        ) from None
    except ValueError as error:
        raise CommandError(f"--conn-id {conn_id}: {error}") from None


def _target(args: argparse.Namespace) -> LedgerTarget:
    """Where the ledger is, resolved once per command: a command that asks twice (e.g.
    ``db upgrade``) must not look the connection up twice."""
    if getattr(args, "ledger_target", None) is None:
        conn_id = getattr(args, "conn_id", None)
        if conn_id is None:
            args.ledger_target = _target_from_environment(args)
        elif getattr(args, "url", None) or os.environ.get(URL_ENV):
            raise UsageError(
                f"--conn-id and --url/{URL_ENV} name the ledger twice: give only one "
                f"(unset {URL_ENV} to use --conn-id)"
            )
        else:
            args.ledger_target = _target_from_connection(conn_id)
    return args.ledger_target


def _url(args: argparse.Namespace) -> str:
    return _target(args).url


def _chain_key(args: argparse.Namespace) -> str | None:
    return _target(args).chain_key


def _admin(args: argparse.Namespace) -> AdminKey | None:
    """The administrator's key, from --admin-key or $DP_BUDGET_ADMIN_KEY_FILE (None
    without either: the commands that need it say so)."""
    path = getattr(args, "admin_key", None) or os.environ.get(ADMIN_KEY_ENV)
    if not path:
        return None
    try:
        return AdminKey.load(path)
    except ValueError as error:
        raise UsageError(f"--admin-key: {error}") from None


def _sqlite_file(url: str) -> Path | None:
    parsed = database.parse_url(url)
    return database.sqlite_path(parsed) if parsed.get_backend_name() == "sqlite" else None


def _refuse_missing_sqlite_file(url: str) -> None:
    """Reading commands must not create an empty SQLite file at a mistyped path."""
    path = _sqlite_file(url)
    if path is not None and not path.exists():
        missing = "" if path.parent.is_dir() else f" (its folder {path.parent} does not exist)"
        raise CommandError(
            f"no ledger database file {path}{missing}: create one with `dp-budget init`"
        )


def _make_sqlite_folder(url: str) -> None:
    """The commands that create a ledger create its SQLite file's folder, and say so."""
    path = _sqlite_file(url)
    if path is not None and not path.parent.is_dir():
        path.parent.mkdir(parents=True)
        print(f"created folder {path.parent}")


def open_ledger(
    url: str,
    *,
    chain_key: str | None,
    admin: AdminKey | None = None,
    admin_pin: str | None = None,
) -> PrivacyBudgetLedger:
    """Open an existing ledger with the grid and conversion it was created with (and
    with the administrator's key, where one is given)."""
    _refuse_missing_sqlite_file(url)
    engine = database.make_engine(url)
    try:
        with database.transaction(engine, write=False) as connection:
            missing = database.is_empty(connection)
            if not missing:
                database.check_schema(connection)
                missing = not database.is_initialised(connection)
            if missing:
                raise CommandError(
                    f"no ledger in {database.safe_url(engine)}: create one with "
                    "`dp-budget init --epsilon E --delta D`"
                )
            config = connection.execute(
                select(LedgerConfig.orders, LedgerConfig.conversion).where(LedgerConfig.id == 1)
            ).one()
    finally:
        engine.dispose()
    return PrivacyBudgetLedger(
        url=url,
        orders=json.loads(config.orders),
        conversion=config.conversion,
        chain_key=chain_key,
        admin=admin,
        admin_public_key=admin_pin,
    )


@contextlib.contextmanager
def _ledger(args: argparse.Namespace) -> Iterator[PrivacyBudgetLedger]:
    target = _target(args)
    ledger = open_ledger(
        target.url, chain_key=target.chain_key, admin=_admin(args), admin_pin=target.admin_pin
    )
    try:
        yield ledger
    finally:
        ledger.close()


def _is_initialised(url: str) -> bool:
    engine = database.make_engine(url)
    try:
        with database.transaction(engine, write=False) as connection:
            return not database.is_empty(connection) and database.is_initialised(connection)
    finally:
        engine.dispose()


# ---------------------------------------------------------------------- output helpers


def _columns(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Collection[int] = ()
) -> list[str]:
    """Aligned columns; column indexes listed in ``right`` are right-aligned (numbers)."""
    cells = [[str(h) for h in headers]] + [["-" if v is None else str(v) for v in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [
            value.rjust(width) if i in right else value.ljust(width)
            for i, (value, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
    return lines


def _print(lines: Sequence[str]) -> None:
    for line in lines:
        print(line)


def _pct(fraction: float) -> str:
    return f"{fraction * 100:.1f}%"


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _filters(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The --window (canonical already: ``_window_label``) and --tenant filters."""
    tenant = None if args.tenant is None else canonical_part("tenant", args.tenant)
    return args.window, tenant


def _header(ledger: PrivacyBudgetLedger) -> str:
    return (
        f"ledger {ledger.url}  delta={_g(ledger.delta)}  conversion={ledger.conversion}  "
        f"orders={ledger.orders.size}"
    )


_JSON_HELP = "machine-readable: one JSON document instead of the table"


def _print_json(document: Any) -> None:
    """One JSON document on stdout (strict: a NaN or infinity is a bug, never printed)."""
    print(json.dumps(document, indent=2, ensure_ascii=False, allow_nan=False))


def _entry_records(
    ledger: PrivacyBudgetLedger, entries: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """History entries as the schedule rows that ``history`` and ``show`` print or emit."""
    mechanisms = report.mechanisms_by_reservation(entries)
    epsilon_alone = report.EpsilonAlone(ledger)
    names = report.SubjectNames(ledger, entries)
    return [report.entry_record(e, mechanisms, epsilon_alone, names) for e in entries]


def _history_lines(ledger: PrivacyBudgetLedger, entries: Sequence[dict[str, Any]]) -> list[str]:
    records = _entry_records(ledger, entries)
    rows = [
        (
            r["seq"],
            r["at"],
            r["action"],
            r["actor"],
            report.entry_target(r),
            report.entry_summary(r),
        )
        for r in records
    ]
    return _columns(["SEQ", "TIME", "ACTION", "ACTOR", "KEY", "DETAILS"], rows, right=(0,))


# ---------------------------------------------------------------------- commands


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    """Create or upgrade the ledger schema (Alembic)."""
    _make_sqlite_folder(_url(args))
    engine = database.make_engine(_url(args))
    try:
        revision = database.upgrade(engine)
        print(f"ledger schema of {database.safe_url(engine)} is at revision {revision}")
    finally:
        engine.dispose()
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    """Create a ledger with its default cap, fixed delta and conversion."""
    url = _url(args)
    cap = BudgetCap(args.epsilon, args.delta, args.warn_fraction)
    _make_sqlite_folder(url)
    existed = _is_initialised(url)
    admin = _admin(args)
    ledger = PrivacyBudgetLedger(
        cap,
        url=url,
        conversion=args.conversion,
        chain_key=_chain_key(args),
        admin=admin,
        admin_public_key=_target(args).admin_pin,
    )
    try:
        verb = "exists already with this configuration" if existed else "created"
        print(
            f"ledger {ledger.url} {verb}: delta={_g(ledger.delta)}, default cap "
            f"eps={_g(cap.epsilon)} (warning at {cap.warn_fraction:.0%}), "
            f"conversion={ledger.conversion}, {ledger.orders.size} Rényi orders"
        )
        if admin is None:
            print(
                "warning: no administrator key (--admin-key): this ledger's policies cannot "
                "change until one is recorded with `dp-budget admin init`",
                file=sys.stderr,
            )
    finally:
        ledger.close()
    return 0


_HELD_LEGEND = (
    "EPS is committed; HELD also counts the OPEN reservations as charged, and REMAINING "
    "is the cap minus HELD"
)


_STANDING_HEADERS = ("EPS", "HELD", "CAP", "REMAINING", "USED", "OPEN", "RELEASES", "STATE")


def _standing(status: AccountStatus) -> tuple[Any, ...]:
    """An account's numbers and state, the columns under ``_STANDING_HEADERS``."""
    return (
        f"{status.epsilon:.4f}",
        f"{status.held_epsilon:.4f}",
        f"{status.cap_epsilon:.4f}",
        f"{status.remaining_after_held:.4f}",
        _pct(status.fraction),
        status.open_reservations,
        status.releases,
        status.state,
    )


def cmd_status(args: argparse.Namespace) -> int:
    """Every live account: spend, cap, headroom, reservations, state; a window named (or
    ``--sealed``) includes sealed windows' final spend, state SEALED. A warning on stderr
    when a maintenance job (reap, reset, verify) is overdue (``--json``: ``maintenance``)."""
    window, tenant = _filters(args)
    limit = None if args.limit == 0 else args.limit
    with _ledger(args) as ledger:
        statuses = ledger.accounts(
            window=window, tenant=tenant, limit=limit, offset=args.offset, sealed=args.sealed
        )
        total = report.count_accounts(ledger, window=window, tenant=tenant, sealed=args.sealed)
        upkeep = ledger.maintenance(_target(args).maintenance_intervals)
        overdue = [state for state in upkeep if state.overdue]
        if overdue:  # on stderr: stdout stays the command's output
            print(f"dp-budget: warning: {maintenance.overdue_warning(overdue)}", file=sys.stderr)
        if args.json:
            document = {
                "ledger": {
                    "url": ledger.url,
                    "delta": ledger.delta,
                    "conversion": ledger.conversion,
                },
                "filters": {"window": window, "tenant": tenant, "sealed": args.sealed},
                "total": total,
                "offset": args.offset,
                "limit": limit,
                "accounts": [report.account_record(s, ledger.delta) for s in statuses],
                "maintenance": [state.as_record() for state in upkeep],
            }
            _print_json(document)
            return 0
        print(_header(ledger))
        if not statuses:
            print("no accounts" + ("" if total == 0 else f" at offset {args.offset}"))
        else:
            rows = [
                (
                    s.key.tenant,
                    s.key.subject,
                    s.key.query_type,
                    display_window(s.key.window),
                    *_standing(s),
                )
                for s in statuses
            ]
            headers = ["TENANT", "SUBJECT", "QUERY TYPE", "WINDOW", *_STANDING_HEADERS]
            _print(_columns(headers, rows, right=range(4, 11)))
        shown = args.offset + len(statuses)
        if shown < total:
            print(
                f"showing {args.offset + 1}-{shown} of {total} accounts; {total - shown} more "
                "not shown (--offset N for the next page, --limit 0 for all)"
            )
        elif statuses:
            first = "" if args.offset == 0 else f"showing {args.offset + 1}-{shown} of "
            print(f"{first}{total} account(s)")
        if any(s.open_reservations for s in statuses):
            print(_HELD_LEGEND)
    return 0


def _every_page(fetch: Any, limit: int, offset: int) -> tuple[int, list[Any]]:
    """``limit`` items from ``offset`` (0: all of them) of a paged query, and the total."""
    items: list[Any] = []
    while True:
        size = MAX_PAGE if limit == 0 else min(MAX_PAGE, limit - len(items))
        page = fetch(limit=size, offset=offset + len(items))
        if page is None:
            return 0, []
        items += page.items
        if not page.items or len(items) >= page.total - offset or len(items) == limit:
            return page.total, items


def cmd_classes(args: argparse.Namespace) -> int:
    """Spend classes: the subjects of a window holding the same spend, one row each; or,
    with ``--members``, one class's subjects."""
    with _ledger(args) as ledger:
        if args.members is not None:
            return _class_members(args, ledger)
        filters = queries.AccountFilter(
            tenant=args.tenant, query_type=args.query_type, window=args.window,
            subject=args.subject, state=args.state, sealed=args.sealed,
        )  # fmt: skip
        every = spend_classes.every_class(ledger, filters)  # grouped once, then sliced
        total = len(every)
        found = every[args.offset :] if args.limit == 0 else every[args.offset :][: args.limit]
        if args.json:
            _print_json(
                {
                    "total": total,
                    "offset": args.offset,
                    "classes": [report.class_record(c, ledger.delta) for c in found],
                }
            )
            return 0
        print(_header(ledger))
        if not found:
            print("no spend classes" + ("" if total == 0 else f" at offset {args.offset}"))
            return 0
        rows = [
            (
                c.status.key.tenant,
                c.status.key.query_type,
                display_window(c.status.key.window),
                f"{c.subjects:,}",
                c.status.key.subject,
                *_standing(c.status),
                c.id,
            )
            for c in found
        ]
        headers = ["TENANT", "QUERY TYPE", "WINDOW", "SUBJECTS", "FIRST", *_STANDING_HEADERS]
        _print(_columns([*headers, "CLASS"], rows, right=(3, *range(5, 12))))
        shown = args.offset + len(found)
        print(
            f"showing {args.offset + 1}-{shown} of {total} spend class(es); members: "
            "dp-budget classes --members CLASS --tenant T --query-type Q --window W"
        )
    return 0


def _class_members(args: argparse.Namespace, ledger: PrivacyBudgetLedger) -> int:
    if args.query_type is None or args.window is None:
        raise UsageError("--members needs the class's --query-type and --window (and --tenant)")
    total, members = _every_page(
        lambda **page: spend_classes.class_members(
            ledger, args.tenant or "default", args.query_type, args.window, args.members, **page
        ),
        args.limit,
        args.offset,
    )
    if total == 0:
        raise CommandError(
            f"no spend class {args.members} in that window (a release since may have changed "
            "its members' spend: list the classes again)"
        )
    if args.json:
        _print_json(
            {
                "class": args.members,
                "total": total,
                "offset": args.offset,
                "accounts": [report.account_record(s, ledger.delta) for s in members],
            }
        )
        return 0
    _print([s.key.subject for s in members])
    print(f"showing {args.offset + 1}-{args.offset + len(members)} of {total} subject(s)")
    return 0


def _status_lines(status: AccountStatus, delta: float) -> list[str]:
    """An account's state, committed and held spend, and headroom, as ``show`` prints them."""
    return [
        f"state     {status.state}",
        f"epsilon   {status.epsilon:.6g} at delta {_g(delta)} ({status.method})",
        f"cap       {_g(status.cap_epsilon)}: remaining {status.remaining:.6g}, "
        f"{_pct(status.fraction)} used",
        f"held      {status.held_epsilon:.6g} with its open reservations charged: remaining "
        f"{status.remaining_after_held:.6g}",
        f"releases  {status.releases} charged, {status.open_reservations} open "
        f"reservation(s), updated {status.updated_at}",
    ]


def cmd_show(args: argparse.Namespace) -> int:
    """One account: its state, its policy and its history."""
    if classes.is_label(args.subject):  # an account (spend class), as receipts name them
        key = classes.account_key(args.tenant, args.subject, args.query_type, args.window)
    else:
        key = key_for(args.subject, args.query_type, args.window, tenant=args.tenant)
    with _ledger(args) as ledger:
        status = queries.account_status(ledger, key)
        entries = ledger.history(key)
        if status is None and not entries:
            raise CommandError(f"no account and no history for {key}")
        policy = ledger.policy_for(key)
        if args.json:
            _print_json(
                {
                    "key": key.as_dict(),
                    "delta": ledger.delta,
                    "account": None
                    if status is None
                    else report.account_record(status, ledger.delta),
                    "policy": policy.as_record(),
                    "history": _entry_records(ledger, entries),
                }
            )
            return 0
        lines = [
            f"account   {report.key_label(key)}",
            f"          tenant={key.tenant} subject={key.subject} query_type={key.query_type} "
            f"window={display_window(key.window)}",
        ]
        if status is None:
            lines.append("state     no live account (window reset or account rescoped)")
        else:
            lines += _status_lines(status, ledger.delta)
        calendar = policy.calendar.kind + (
            f" ({policy.calendar.length_seconds}s)" if policy.calendar.length_seconds else ""
        )
        lines += [
            f"policy    scope {policy.tenant}/{policy.query_type}: cap {_g(policy.cap_epsilon)}, "
            f"warning at {policy.warn_fraction:.0%}, calendar {calendar}, minimum window "
            f"{int(policy.min_window.total_seconds())}s",
            f"clause    {policy.compliance_clause or '(none recorded)'}",
            "",
            f"history ({len(entries)} entries)",
        ]
        _print(lines)
        _print(_history_lines(ledger, entries))
    return 0


def cmd_history(args: argparse.Namespace) -> int:
    """The audit history, one line per entry."""
    limit = None if args.limit == 0 else args.limit
    with _ledger(args) as ledger:
        # One more than asked says whether more follow (never past what a count can hold).
        probe = None if limit is None else min(limit + 1, MAX_STORED_INT)
        entries = ledger.history(
            after_seq=args.after, before_seq=args.before, limit=probe, newest_first=args.newest
        )
        more = limit is not None and len(entries) > limit
        entries = entries[:limit] if limit is not None else entries
        if args.json:
            _print_json({"entries": _entry_records(ledger, entries), "more": more})
            return 0
        if not entries:
            print(f"no history entries after seq {args.after}")
            return 0
        _print(_history_lines(ledger, entries))
        if more and args.newest:
            print(f"older entries: --newest-first --before {entries[-1]['seq']}")
        elif more:
            print(f"more entries follow: --after {entries[-1]['seq']}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Prove the ledger's tables from its history; quarantine the ledger if they disagree."""
    store = args.checkpoint
    with _ledger(args) as ledger:
        result = report.verification_record(ledger, store)
    if not result["keyed"]:
        print(
            f"warning: the history is not keyed ({history.CHAIN_KEY_ENV} unset): whoever can "
            "write the ledger database can rewrite it unnoticed after the last checkpoint",
            file=sys.stderr,
        )
    for note in result["notes"]:
        print(f"note: {note}", file=sys.stderr)
    if result["ok"]:
        checkpointed = "" if store is None else f"; checkpointed in {store.path}"
        print(
            f"OK: {result['entries']} history entries, {result['accounts']} accounts; links, "
            f"reservations, accounts, windows, policies and caps check out{checkpointed}"
        )
        return 0
    counted = (
        f" in {result['entries']} history entries and {result['accounts']} accounts"
        if result["entries"] is not None
        else ""
    )
    print(f"FAILED: {len(result['problems'])} problem(s){counted}; the ledger is quarantined")
    _print([f"  {problem}" for problem in result["problems"]])
    return 1


def cmd_quarantine_show(args: argparse.Namespace) -> int:
    """Say whether releases are stopped, since when and why."""
    with _ledger(args) as ledger:
        status = ledger.quarantine_status()
    if status is None:
        print("not quarantined: releases run")
        return 0
    since, reason = status
    print(f"QUARANTINED since {since}: {reason}")
    print("no release runs until `dp-budget quarantine clear --reason TEXT`")
    return 1


def cmd_quarantine_clear(args: argparse.Namespace) -> int:
    """Let releases run again (an audited entry naming you and the reason)."""
    with _ledger(args) as ledger:
        ledger.clear_quarantine(args.reason)
        print(f"quarantine cleared by {ledger.actor}: {args.reason.strip()}")
    return 0


def cmd_db_adopt_key(args: argparse.Namespace) -> int:
    """Key an unkeyed ledger's history with $DP_BUDGET_CHAIN_KEY from now on."""
    key = _chain_key(args)
    if key is None:
        raise UsageError(
            f"set {history.CHAIN_KEY_ENV} (or the --conn-id connection's extra "
            "chain_key_secret) to the new chain key first"
        )
    ledger = open_ledger(
        _url(args), chain_key=None, admin=_admin(args), admin_pin=_target(args).admin_pin
    )
    try:
        ledger.adopt_chain_key(key)
        print(
            f"the history of {ledger.url} is keyed from now on: open it with "
            f"{history.CHAIN_KEY_ENV} (and the Airflow connection's extra chain_key_secret) "
            "everywhere"
        )
    finally:
        ledger.close()
    return 0


def cmd_admin_keygen(args: argparse.Namespace) -> int:
    """Write a new administrator key to a new file only its owner can read."""
    key = AdminKey.generate()
    try:
        key.write(args.out)
    except FileExistsError:
        raise CommandError(f"{args.out} exists: an admin key is never overwritten") from None
    print(f"administrator key written to {args.out} (keep it off every Airflow worker)")
    print(f"public key: {key.public.text}")
    return 0


def cmd_admin_init(args: argparse.Namespace) -> int:
    """Make --admin-key the ledger's administrator key (once); print the pin for the
    connections."""
    if _admin(args) is None:
        raise UsageError(
            f"admin init needs the administrator's key: --admin-key or ${ADMIN_KEY_ENV}"
        )
    with _ledger(args) as ledger:
        public = ledger.record_admin_key()
    print(f"the ledger's administrator key is {AdminPublicKey(public).key_id}")
    print("pin it in every dp_budget connection's extra (workers refuse another key):")
    print(json.dumps({"admin_public_key": public}))
    return 0


def cmd_refusal(args: argparse.Namespace) -> int:
    """Open a refusal reference a task logged: which account refused, and why."""
    admin = _admin(args)
    if admin is None:
        raise UsageError(f"a refusal reference opens with --admin-key or ${ADMIN_KEY_ENV}")
    try:
        facts = admin.open(args.reference)
    except ValueError as error:
        raise UsageError(str(error)) from None
    _print_json(facts)
    return 0


def cmd_reset(args: argparse.Namespace) -> int:
    """Drop the live accounts of closed windows (history is kept)."""
    with _ledger(args) as ledger:
        if args.closed:
            dropped = ledger.reset_closed()
            if not dropped:
                print("no closed window has live accounts")
            for window, count in dropped.items():
                print(
                    f"reset window {display_window(window)}: {count} account(s) dropped, "
                    "history kept"
                )
        else:
            count = ledger.reset(args.window)
            print(
                f"reset window {display_window(args.window)}: {count} account(s) dropped, "
                "history kept"
            )
    return 0


def cmd_reap(args: argparse.Namespace) -> int:
    """Charge reservations left open by dead workers: their lease ran out (or, with
    ``--older-than``, they are older than that)."""
    with _ledger(args) as ledger:
        reaped = ledger.reap(args.older_than)
    if not reaped:
        older = "" if args.older_than is None else f" and none is older than {args.older_than}"
        print(f"no open reservation's lease has run out{older}")
        return 0
    _print([f"reaped {reservation_id}" for reservation_id in reaped])
    print(f"{len(reaped)} reservation(s) charged (never refunded)")
    return 0


def cmd_policy_list(args: argparse.Namespace) -> int:
    """Every policy with its compliance clause."""
    with _ledger(args) as ledger:
        policies = ledger.policies()
    if args.json:
        _print_json([policy.as_record() for policy in policies])
        return 0
    rows = [
        (
            p.tenant,
            p.query_type,
            _g(p.cap_epsilon),
            f"{p.warn_fraction:.0%}",
            p.calendar.kind
            + (f" ({p.calendar.length_seconds}s)" if p.calendar.length_seconds else ""),
            f"{int(p.min_window.total_seconds())}s",
            f"{int(p.grace.total_seconds())}s",
            p.compliance_clause or "-",
        )
        for p in policies
    ]
    headers = ["TENANT", "QUERY TYPE", "CAP", "WARN", "CALENDAR", "MIN WINDOW", "GRACE", "CLAUSE"]
    _print(_columns(headers, rows, right=(2, 3, 5, 6)))
    return 0


def cmd_policy_set(args: argparse.Namespace) -> int:
    """Create or replace one scope's policy; options not given keep the scope's current values."""
    with _ledger(args) as ledger:
        policy, created = revised_policy(
            ledger.policies(),
            args.tenant,
            args.query_type,
            cap_epsilon=args.epsilon,
            warn_fraction=args.warn_fraction,
            calendar=args.calendar,
            length_seconds=args.length_seconds,
            min_window=None
            if args.min_window_seconds is None
            else timedelta(seconds=args.min_window_seconds),
            grace=args.grace,
            compliance_clause=args.clause,
        )
        ledger.set_policy(policy)
    print(
        f"policy {policy.tenant}/{policy.query_type} {'created' if created else 'updated'}: cap "
        f"{_g(policy.cap_epsilon)}, warning at {policy.warn_fraction:.0%}, calendar "
        f"{policy.calendar.kind}, minimum window {int(policy.min_window.total_seconds())}s, "
        f"grace {int(policy.grace.total_seconds())}s, "
        f"clause: {policy.compliance_clause or '(none)'}"
    )
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """The privacy report (JSON for machines, Markdown for people)."""
    window, tenant = _filters(args)
    with _ledger(args) as ledger:
        document = report.build_report(
            ledger,
            window=window,
            tenant=tenant,
            subjects=args.subjects,
            page=args.page,
            page_size=args.page_size,
        )
    if args.format == "json":
        _print_json(document)
    else:
        print(report.render_markdown(document))
    return 0


# ---------------------------------------------------------------------- parser


def _table_options(parser: argparse.ArgumentParser) -> None:
    """--limit, --offset and --json of the commands that list a table of rows."""
    parser.add_argument(
        "--limit",
        type=_count,
        default=DEFAULT_STATUS_LIMIT,
        help=f"rows to show (default {DEFAULT_STATUS_LIMIT}; 0 for all)",
    )
    parser.add_argument("--offset", type=_count, default=0, help="rows to skip")
    parser.add_argument("--json", action="store_true", help=_JSON_HELP)


def build_parser() -> argparse.ArgumentParser:
    """The ``dp-budget`` argument parser."""
    url_help = f"ledger database URL (default: ${URL_ENV})"
    conn_help = (
        "read the ledger URL and chain key from this Airflow connection, the one the tasks "
        f"use (needs Airflow; not with --url/${URL_ENV})"
    )
    admin_help = (
        "the administrator's key file, for what only administrators may do (policy set, "
        f"quarantine clear, db adopt-key, admin init, refusal; default: ${ADMIN_KEY_ENV})"
    )
    parser = argparse.ArgumentParser(
        prog="dp-budget",
        description="Inspect, audit and maintain a differential-privacy budget ledger.",
        epilog=f"The ledger comes from --url, ${URL_ENV} or --conn-id.",
    )
    parser.add_argument("--url", default=None, help=url_help)
    parser.add_argument("--conn-id", default=None, metavar="ID", help=conn_help)
    parser.add_argument("--admin-key", default=None, metavar="FILE", help=admin_help)
    parser.add_argument("--version", action="version", version=f"dp-budget {__version__}")
    # --url and --conn-id are accepted after the command too; SUPPRESS keeps a global one
    # from being reset by the subcommand's default.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS, help=url_help)
    common.add_argument("--conn-id", default=argparse.SUPPRESS, metavar="ID", help=conn_help)
    common.add_argument("--admin-key", default=argparse.SUPPRESS, metavar="FILE", help=admin_help)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        group: Any, name: str, handler: Any, help_text: str, **kwargs: Any
    ) -> argparse.ArgumentParser:
        sub = group.add_parser(
            name, parents=[common], help=help_text, description=help_text, **kwargs
        )
        sub.set_defaults(run=handler, cli_words=False)
        return sub

    db = commands.add_parser("db", help="schema management")
    db_commands = db.add_subparsers(dest="db_command", required=True, metavar="COMMAND")
    command(db_commands, "upgrade", cmd_db_upgrade, "create or upgrade the ledger schema")
    command(
        db_commands,
        "adopt-key",
        cmd_db_adopt_key,
        f"key an unkeyed ledger's history with ${history.CHAIN_KEY_ENV} from now on",
    )

    admin = commands.add_parser("admin", help="the administrator's key")
    admin_commands = admin.add_subparsers(dest="admin_command", required=True, metavar="COMMAND")
    keygen = command(admin_commands, "keygen", cmd_admin_keygen, "write a new administrator key")
    keygen.add_argument("--out", required=True, metavar="FILE", help="a new file (mode 600)")
    command(
        admin_commands,
        "init",
        cmd_admin_init,
        "make --admin-key the ledger's administrator key (once; prints the connections' pin)",
    )
    refusal = command(
        commands, "refusal", cmd_refusal, "open a refusal reference from a task's log"
    )
    refusal.add_argument("reference", metavar="REFERENCE", help="the dpb-ref-1.... text")

    init = command(commands, "init", cmd_init, "create a ledger with its default cap")
    init.add_argument("--epsilon", type=_positive, required=True, help="default cap per account")
    init.add_argument(
        "--delta", type=_number, required=True, help="the ledger's fixed delta (never changes)"
    )
    init.set_defaults(cli_words=True)  # its errors name Python parameters
    init.add_argument("--warn-fraction", type=_fraction, default=0.8, help="default 0.8")
    init.add_argument(
        "--conversion", choices=CONVERSIONS, default="improved", help="default improved"
    )

    status = command(commands, "status", cmd_status, "spend and headroom of every account")
    status.add_argument("--window", type=_window_label, help=f"only this window ({WINDOW_LABELS})")
    status.add_argument("--tenant", help="only this tenant")
    status.add_argument("--sealed", action="store_true", help=_SEALED_HELP)
    _table_options(status)

    classes = command(
        commands,
        "classes",
        cmd_classes,
        "spend classes: the subjects of a window holding the same spend, one row each",
        epilog="Search for one person with --subject; list a class's subjects with --members.",
    )
    classes.add_argument("--tenant", help="only this tenant")
    classes.add_argument("--sealed", action="store_true", help=_SEALED_HELP)
    classes.add_argument("--query-type", dest="query_type", help="only this query type")
    classes.add_argument(
        "--window", type=_window_filter, help=f"only this window ({WINDOW_LABELS}; * for any text)"
    )
    classes.add_argument("--subject", help="only the classes of this subject (* for any text)")
    classes.add_argument("--state", help="only classes in this state: ok, warning or exhausted")
    classes.add_argument(
        "--members", metavar="CLASS", help="list this class's subjects (the CLASS column)"
    )
    _table_options(classes)

    show = command(
        commands,
        "show",
        cmd_show,
        "one account's state, policy and history",
        epilog="The key is (TENANT, SUBJECT, QUERY_TYPE, WINDOW); TENANT defaults to 'default'.",
    )
    show.add_argument(
        "subject",
        metavar="SUBJECT",
        help="the privacy unit (as released), or an account's Class-... label",
    )
    show.add_argument("query_type", metavar="QUERY_TYPE", help="the release family")
    show.add_argument("window", metavar="WINDOW", type=_window_label, help=WINDOW_LABELS)
    show.add_argument("--tenant", default="default", help="default: 'default'")
    show.add_argument("--json", action="store_true", help=_JSON_HELP)

    history_command = command(
        commands, "history", cmd_history, "the audit history, one line per entry"
    )
    history_command.add_argument(
        "--limit",
        type=_count,
        default=DEFAULT_HISTORY_LIMIT,
        help=f"entries to show (default {DEFAULT_HISTORY_LIMIT}; 0 for all)",
    )
    history_command.add_argument(
        "--after", type=_count, default=0, metavar="SEQ", help="start after SEQ"
    )
    history_command.add_argument(
        "--before", type=_count, default=None, metavar="SEQ", help="only entries before SEQ"
    )
    history_command.add_argument(
        "--newest-first",
        dest="newest",
        action="store_true",
        help="the latest entries first (default: oldest first)",
    )
    history_command.add_argument("--json", action="store_true", help=_JSON_HELP)

    verify = command(
        commands,
        "verify",
        cmd_verify,
        "prove every table from the history (links, caps, seals); quarantine on failure",
    )
    verify.add_argument(
        "--checkpoint",
        metavar="FILE",
        type=_checkpoint_file,
        default=None,
        help="verify against the last checkpoint in FILE and append one if the verify passes "
        "(keep FILE away from the ledger database's users)",
    )
    quarantine = commands.add_parser("quarantine", help="releases stopped by a failed verify")
    quarantine_commands = quarantine.add_subparsers(
        dest="quarantine_command", required=True, metavar="COMMAND"
    )
    command(quarantine_commands, "show", cmd_quarantine_show, "since when and why (exit 1 if so)")
    clear = command(
        quarantine_commands, "clear", cmd_quarantine_clear, "let releases run again (audited)"
    )
    clear.set_defaults(cli_words=True)  # its errors name Python parameters
    clear.add_argument("--reason", required=True, help="what was found and done (recorded)")

    reset = command(commands, "reset", cmd_reset, "drop the accounts of closed windows")
    which = reset.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--window", type=_window_label, help="one closed window (an open one is refused)"
    )
    which.add_argument("--closed", action="store_true", help="every closed window")

    reap = command(
        commands,
        "reap",
        cmd_reap,
        "charge reservations abandoned by dead workers (their lease ran out; never refunded)",
    )
    reap.add_argument(
        "--older-than",
        type=parse_duration,
        default=None,
        metavar="DURATION",
        help="also charge every open reservation older than this, even one whose lease is "
        "still renewed (e.g. 30m, 2h, 1d)",
    )
    reap.set_defaults(cli_words=True)  # its errors name Python parameters

    policy = commands.add_parser("policy", help="caps per tenant and query type")
    policy_commands = policy.add_subparsers(dest="policy_command", required=True, metavar="COMMAND")
    policy_list = command(
        policy_commands, "list", cmd_policy_list, "every policy and its compliance clause"
    )
    policy_list.add_argument("--json", action="store_true", help=_JSON_HELP)
    policy_set = command(
        policy_commands,
        "set",
        cmd_policy_set,
        "create or replace a policy (options not given keep the scope's current values)",
    )
    policy_set.set_defaults(cli_words=True)  # its errors name Python parameters
    policy_set.add_argument("--tenant", default=ANY, help="default '*' (any)")
    policy_set.add_argument("--query-type", default=ANY, help="default '*' (any)")
    policy_set.add_argument(
        "--epsilon",
        type=_positive,
        default=None,
        help="cap per account (required for a new scope; default: the scope's current cap)",
    )
    policy_set.add_argument(
        "--warn-fraction",
        type=_fraction,
        default=None,
        help="fraction of the cap at which releases warn (default: current, else 0.8)",
    )
    policy_set.add_argument(
        "--calendar",
        choices=CALENDAR_KINDS,
        default=None,
        help="how the scope's windows are cut (default: current, else iso_week); a charged "
        "scope keeps its calendar",
    )
    policy_set.add_argument(
        "--length-seconds", type=_seconds, default=None, help="window length of a fixed calendar"
    )
    policy_set.add_argument(
        "--min-window-seconds",
        type=_seconds,
        default=None,
        help="the shortest window a fixed calendar may have (default: current, else one day)",
    )
    policy_set.add_argument(
        "--grace",
        type=parse_duration,
        default=None,
        help="how long after a window ends late and backfilled runs may still charge it, "
        "before maintenance may seal it (e.g. 3d; default 3d)",
    )
    policy_set.add_argument(
        "--clause", default=None, help="the compliance clause the cap implements"
    )

    privacy_report = command(commands, "report", cmd_report, "the privacy report")
    privacy_report.add_argument(
        "--format", choices=("md", "json"), default="md", help="Markdown (default) or JSON"
    )
    privacy_report.add_argument("--window", type=_window_label, help="only this window")
    privacy_report.add_argument("--tenant", help="only this tenant")
    privacy_report.add_argument(
        "--subjects",
        action="store_true",
        help="list every subject's guarantee too, one page of them (default: per class only)",
    )
    privacy_report.add_argument(
        "--page", type=_page_number, default=1, help="which page of subjects, from 1 (default 1)"
    )
    privacy_report.add_argument(
        "--page-size",
        dest="page_size",
        type=_page_number,
        default=report.SUBJECTS_PAGE_SIZE,
        help=f"subjects per page (default {report.SUBJECTS_PAGE_SIZE})",
    )
    return parser


# The ledger's errors name its Python API; a shell user wrote these options and commands.
_CLI_WORDS = (
    (re.compile(r"\bcap_epsilon\b"), "--epsilon"),
    (re.compile(r"\bwarn_fraction\b"), "--warn-fraction"),
    (re.compile(r"\blength_seconds\b"), "--length-seconds"),
    (re.compile(r"\bmin_window\b"), "--min-window-seconds"),
    (re.compile(r"\bcompliance_clause\b"), "--clause"),
    (re.compile(r"\bset_policy\b"), "`dp-budget policy set`"),
    (re.compile(r"\bclear_quarantine\b"), "`dp-budget quarantine clear`"),
    (re.compile(r"datetime\.timedelta\((?:days=)?(\d+)\)"), r"\1 days"),
)


def _one_line(error: BaseException, cli_words: bool = False) -> str:
    """The error as one line; ``cli_words`` (commands whose values the ledger checks under
    its Python names) says it with the options the user typed. Only those commands: the
    words could be a subject's or a query type's name in any other error."""
    text = str(error)
    if isinstance(error, SQLAlchemyError):
        text = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    for pattern, words in _CLI_WORDS if cli_words else ():
        text = pattern.sub(words, text)
    return " ".join(text.split()) or type(error).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``dp-budget`` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except UsageError as error:
        print(f"dp-budget: error: {error}", file=sys.stderr)
        return 2
    except ValueError as error:  # a value the ledger refuses to take: a usage error too
        print(f"dp-budget: error: {_one_line(error, args.cli_words)}", file=sys.stderr)
        return 2
    except (CommandError, LedgerError) as error:
        print(f"dp-budget: error: {_one_line(error, args.cli_words)}", file=sys.stderr)
        return 1
    except SQLAlchemyError as error:
        print(f"dp-budget: error: database: {_one_line(error)}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away; do not print a traceback about it.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except OSError as error:  # the filesystem refused the ledger's file (name too long, ...)
        print(f"dp-budget: error: {_one_line(error)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
