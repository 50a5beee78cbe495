"""The commands that read the ledger: status, spend classes, one account, the history, the
report, the policies, the quarantine, a refusal reference."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dp_budget_provider.cli.arguments import (
    window_and_tenant,
)
from dp_budget_provider.cli.errors import CommandError, UsageError
from dp_budget_provider.cli.output import (
    HELD_LEGEND,
    STANDING_HEADERS,
    columns,
    entry_records,
    header,
    history_lines,
    print_json,
    print_lines,
    shortest,
    standing,
    status_lines,
)
from dp_budget_provider.cli.target import (
    admin_key_of,
    ledger_target,
    opened,
)
from dp_budget_provider.ledger import PrivacyBudgetLedger, key_for
from dp_budget_provider.ledger.accounts import classes
from dp_budget_provider.ledger.accounts.keys import MAX_STORED_INT
from dp_budget_provider.ledger.audit.authority import ADMIN_KEY_ENV
from dp_budget_provider.ledger.views import queries, report, spend_classes
from dp_budget_provider.ledger.views.queries import MAX_PAGE
from dp_budget_provider.ledger.windows import maintenance
from dp_budget_provider.ledger.windows.calendar import display_window


def cmd_status(args: argparse.Namespace) -> int:
    """Every live account: spend, cap, headroom, reservations, state; a window named (or
    ``--sealed``) includes sealed windows' final spend, state SEALED. A warning on stderr
    when a maintenance job (reap, reset, verify) is overdue (``--json``: ``maintenance``)."""
    window, tenant = window_and_tenant(args)
    limit = None if args.limit == 0 else args.limit
    with opened(args) as ledger:
        statuses = ledger.accounts(
            window=window,
            tenant=tenant,
            limit=limit,
            offset=args.offset,
            sealed=args.sealed,
            subject=args.subject,
        )
        total = report.count_accounts(
            ledger, window=window, tenant=tenant, sealed=args.sealed, subject=args.subject
        )
        upkeep = ledger.maintenance(ledger_target(args).maintenance_intervals)
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
                "filters": {
                    "window": window,
                    "tenant": tenant,
                    "sealed": args.sealed,
                    "subject": args.subject,
                },
                "total": total,
                "offset": args.offset,
                "limit": limit,
                "accounts": [report.account_record(s, ledger.delta) for s in statuses],
                "maintenance": [state.as_record() for state in upkeep],
            }
            print_json(document)
            return 0
        print(header(ledger))
        if not statuses:
            print("no accounts" + ("" if total == 0 else f" at offset {args.offset}"))
        else:
            rows = [
                (
                    s.key.tenant,
                    s.key.subject,
                    s.key.query_type,
                    display_window(s.key.window),
                    *standing(s),
                )
                for s in statuses
            ]
            headers = ["TENANT", "SUBJECT", "QUERY TYPE", "WINDOW", *STANDING_HEADERS]
            print_lines(columns(headers, rows, right=range(4, 11)))
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
            print(HELD_LEGEND)
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
    with opened(args) as ledger:
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
            print_json(
                {
                    "total": total,
                    "offset": args.offset,
                    "classes": [report.class_record(c, ledger.delta) for c in found],
                }
            )
            return 0
        print(header(ledger))
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
                *standing(c.status),
                c.id,
            )
            for c in found
        ]
        headers = ["TENANT", "QUERY TYPE", "WINDOW", "SUBJECTS", "FIRST", *STANDING_HEADERS]
        print_lines(columns([*headers, "CLASS"], rows, right=(3, *range(5, 12))))
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
        print_json(
            {
                "class": args.members,
                "total": total,
                "offset": args.offset,
                "accounts": [report.account_record(s, ledger.delta) for s in members],
            }
        )
        return 0
    print_lines([s.key.subject for s in members])
    print(f"showing {args.offset + 1}-{args.offset + len(members)} of {total} subject(s)")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """One account: its state, its policy and its history."""
    if classes.is_label(args.subject):  # an account (spend class), as receipts name them
        key = classes.account_key(args.tenant, args.subject, args.query_type, args.window)
    else:
        key = key_for(args.subject, args.query_type, args.window, tenant=args.tenant)
    with opened(args) as ledger:
        status = queries.account_status(ledger, key)
        entries = ledger.history(key)
        if status is None and not entries:
            raise CommandError(f"no account and no history for {key}")
        policy = ledger.policy_for(key)
        if args.json:
            print_json(
                {
                    "key": key.as_dict(),
                    "delta": ledger.delta,
                    "account": None
                    if status is None
                    else report.account_record(status, ledger.delta),
                    "policy": policy.as_record(),
                    "history": entry_records(ledger, entries),
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
            lines += status_lines(status, ledger.delta)
        calendar = policy.calendar.label
        lines += [
            f"policy    scope {policy.tenant}/{policy.query_type}: cap "
            f"{shortest(policy.cap_epsilon)}, warning at {policy.warn_fraction:.0%}, "
            f"calendar {calendar}, minimum window "
            f"{int(policy.min_window.total_seconds())}s",
            f"clause    {policy.compliance_clause or '(none recorded)'}",
            "",
            f"history ({len(entries)} entries)",
        ]
        print_lines(lines)
        print_lines(history_lines(ledger, entries))
    return 0


def cmd_history(args: argparse.Namespace) -> int:
    """The audit history, one line per entry."""
    limit = None if args.limit == 0 else args.limit
    with opened(args) as ledger:
        # One more than asked says whether more follow (never past what a count can hold).
        probe = None if limit is None else min(limit + 1, MAX_STORED_INT)
        entries = ledger.history(
            after_seq=args.after, before_seq=args.before, limit=probe, newest_first=args.newest
        )
        more = limit is not None and len(entries) > limit
        entries = entries[:limit] if limit is not None else entries
        if args.json:
            print_json({"entries": entry_records(ledger, entries), "more": more})
            return 0
        if not entries:
            print(f"no history entries after seq {args.after}")
            return 0
        print_lines(history_lines(ledger, entries))
        if more and args.newest:
            print(f"older entries: --newest-first --before {entries[-1]['seq']}")
        elif more:
            print(f"more entries follow: --after {entries[-1]['seq']}")
    return 0


def cmd_quarantine_show(args: argparse.Namespace) -> int:
    """Say whether releases are stopped, since when and why."""
    with opened(args) as ledger:
        status = ledger.quarantine_status()
    if status is None:
        print("not quarantined: releases run")
        return 0
    since, reason = status
    print(f"QUARANTINED since {since}: {reason}")
    print("no release runs until `dp-budget quarantine clear --reason TEXT`")
    return 1


def cmd_refusal(args: argparse.Namespace) -> int:
    """Open a refusal reference a task logged: which account refused, and why."""
    admin = admin_key_of(args)
    if admin is None:
        raise UsageError(f"a refusal reference opens with --admin-key or ${ADMIN_KEY_ENV}")
    try:
        facts = admin.open(args.reference)
    except ValueError as error:
        raise UsageError(str(error)) from None
    print_json(facts)
    return 0


def cmd_policy_list(args: argparse.Namespace) -> int:
    """Every policy with its compliance clause."""
    with opened(args) as ledger:
        policies = ledger.policies()
    if args.json:
        print_json([policy.as_record() for policy in policies])
        return 0
    rows = [
        (
            p.tenant,
            p.query_type,
            shortest(p.cap_epsilon),
            f"{p.warn_fraction:.0%}",
            p.calendar.label,
            f"{int(p.min_window.total_seconds())}s",
            f"{int(p.grace.total_seconds())}s",
            "reported" if p.filter_order is None else f"{p.filter_order:g}",
            " ".join(f"{s.principal}={s.fraction:g}" for s in p.shares) or "-",
            p.compliance_clause or "-",
        )
        for p in policies
    ]
    headers = [
        "TENANT", "QUERY TYPE", "CAP", "WARN", "CALENDAR", "MIN WINDOW", "GRACE", "FILTER",
        "SHARES", "CLAUSE",
    ]  # fmt: skip
    print_lines(columns(headers, rows, right=(2, 3, 5, 6, 7)))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """The privacy report (JSON for machines, Markdown for people)."""
    window, tenant = window_and_tenant(args)
    with opened(args) as ledger:
        document = report.build_report(
            ledger,
            window=window,
            tenant=tenant,
            subjects=args.subjects,
            page=args.page,
            page_size=args.page_size,
        )
    if args.format == "json":
        print_json(document)
    else:
        print(report.render_markdown(document))
    return 0
