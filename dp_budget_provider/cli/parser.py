"""The ``dp-budget`` command line: every command, its options and their value types."""

from __future__ import annotations

import argparse
from typing import Any

from dp_budget_provider import __version__
from dp_budget_provider.accounting import CONVERSIONS
from dp_budget_provider.cli.arguments import (
    DEFAULT_HISTORY_LIMIT,
    DEFAULT_STATUS_LIMIT,
    WINDOW_LABELS,
    checkpoint_file,
    duration_seconds,
    filter_order_value,
    finite_number,
    fraction,
    page_number,
    parse_duration,
    positive_number,
    share_value,
    whole_number,
    window_filter,
    window_label,
)
from dp_budget_provider.cli.inspection import (
    cmd_classes,
    cmd_history,
    cmd_policy_list,
    cmd_quarantine_show,
    cmd_refusal,
    cmd_report,
    cmd_show,
    cmd_status,
)
from dp_budget_provider.cli.target import (
    URL_ENV,
)
from dp_budget_provider.cli.upkeep import (
    cmd_admin_init,
    cmd_admin_keygen,
    cmd_db_adopt_key,
    cmd_db_upgrade,
    cmd_init,
    cmd_policy_set,
    cmd_quarantine_clear,
    cmd_reap,
    cmd_reset,
    cmd_verify,
)
from dp_budget_provider.ledger import ANY
from dp_budget_provider.ledger.audit.authority import ADMIN_KEY_ENV
from dp_budget_provider.ledger.storage import history
from dp_budget_provider.ledger.views import report
from dp_budget_provider.ledger.windows.calendar import CALENDAR_KINDS

_SEALED_HELP = "include sealed windows' final spend (state SEALED); a named --window does"


_JSON_HELP = "machine-readable: one JSON document instead of the table"


def _table_options(parser: argparse.ArgumentParser) -> None:
    """--limit, --offset and --json of the commands that list a table of rows."""
    parser.add_argument(
        "--limit",
        type=whole_number,
        default=DEFAULT_STATUS_LIMIT,
        help=f"rows to show (default {DEFAULT_STATUS_LIMIT}; 0 for all)",
    )
    parser.add_argument("--offset", type=whole_number, default=0, help="rows to skip")
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
    init.add_argument(
        "--epsilon", type=positive_number, required=True, help="default cap per account"
    )
    init.add_argument(
        "--delta",
        type=finite_number,
        required=True,
        help="the ledger's fixed delta (never changes)",
    )
    init.set_defaults(cli_words=True)  # its errors name Python parameters
    init.add_argument("--warn-fraction", type=fraction, default=0.8, help="default 0.8")
    init.add_argument(
        "--conversion", choices=CONVERSIONS, default="improved", help="default improved"
    )
    init.add_argument(
        "--filter-order",
        type=filter_order_value,
        default="auto",
        help="how the default cap is checked: at one Rényi order, a privacy filter (default "
        "auto, the cap's own order), or 'reported', on the reported epsilon (not a filter)",
    )

    status = command(commands, "status", cmd_status, "spend and headroom of every account")
    status.add_argument("--window", type=window_label, help=f"only this window ({WINDOW_LABELS})")
    status.add_argument("--tenant", help="only this tenant")
    status.add_argument("--sealed", action="store_true", help=_SEALED_HELP)
    status.add_argument(
        "--subject",
        help="only this subject's accounts: each query type's, and its totals across query "
        "types and windows where a cap keeps them",
    )
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
        "--window", type=window_filter, help=f"only this window ({WINDOW_LABELS}; * for any text)"
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
    show.add_argument("window", metavar="WINDOW", type=window_label, help=WINDOW_LABELS)
    show.add_argument("--tenant", default="default", help="default: 'default'")
    show.add_argument("--json", action="store_true", help=_JSON_HELP)

    history_command = command(
        commands, "history", cmd_history, "the audit history, one line per entry"
    )
    history_command.add_argument(
        "--limit",
        type=whole_number,
        default=DEFAULT_HISTORY_LIMIT,
        help=f"entries to show (default {DEFAULT_HISTORY_LIMIT}; 0 for all)",
    )
    history_command.add_argument(
        "--after", type=whole_number, default=0, metavar="SEQ", help="start after SEQ"
    )
    history_command.add_argument(
        "--before", type=whole_number, default=None, metavar="SEQ", help="only entries before SEQ"
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
        type=checkpoint_file,
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
        "--window", type=window_label, help="one closed window (an open one is refused)"
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
        type=positive_number,
        default=None,
        help="cap per account (required for a new scope; default: the scope's current cap)",
    )
    policy_set.add_argument(
        "--warn-fraction",
        type=fraction,
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
        "--length-seconds",
        type=duration_seconds,
        default=None,
        help="window length of a fixed calendar",
    )
    policy_set.add_argument(
        "--min-window-seconds",
        type=duration_seconds,
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
    policy_set.add_argument(
        "--across",
        choices=("query_types", "windows"),
        default=None,
        help="a cap on each subject's total across all the tenant's query types in a window "
        "(query_types), or across all of them over a horizon of windows (windows); such a "
        "policy takes no --query-type",
    )
    policy_set.add_argument(
        "--filter-order",
        type=filter_order_value,
        default=None,
        help="the one Rényi order the cap is checked at, a privacy filter (valid when "
        "releases are chosen from earlier outputs); 'auto' is the cap's own order. "
        "'reported' checks the cap on the reported epsilon, which is not a filter. A charged "
        "scope keeps how its cap is checked. Left out, it is auto: a charged scope keeps its "
        "rule, and an uncharged one is checked at its (new) cap's own order",
    )
    policy_set.add_argument(
        "--share",
        dest="shares",
        type=share_value,
        action="append",
        default=None,
        metavar="PRINCIPAL=FRACTION:DAG[,DAG...]",
        help="divide the cap among principals (repeat for each): the principal's fraction "
        "of the scope's Rényi budget at its filter order, and the DAG ids whose releases "
        "are the principal's. A DAG no share names is refused at the scope. Given, the "
        "shares replace the scope's; needs a filter order",
    )
    policy_set.add_argument(
        "--no-shares",
        action="store_true",
        help="stop dividing the scope's cap (the scope's own cap still holds)",
    )
    policy_set.add_argument(
        "--horizon-windows",
        type=page_number,
        default=None,
        help="with --across windows: how many consecutive windows the horizon spans (e.g. 52 "
        "weeks; 12 months from January is a calendar year)",
    )

    privacy_report = command(commands, "report", cmd_report, "the privacy report")
    privacy_report.add_argument(
        "--format", choices=("md", "json"), default="md", help="Markdown (default) or JSON"
    )
    privacy_report.add_argument("--window", type=window_label, help="only this window")
    privacy_report.add_argument("--tenant", help="only this tenant")
    privacy_report.add_argument(
        "--subjects",
        action="store_true",
        help="list every subject's guarantee too, one page of them (default: per class only)",
    )
    privacy_report.add_argument(
        "--page", type=page_number, default=1, help="which page of subjects, from 1 (default 1)"
    )
    privacy_report.add_argument(
        "--page-size",
        dest="page_size",
        type=page_number,
        default=report.SUBJECTS_PAGE_SIZE,
        help=f"subjects per page (default {report.SUBJECTS_PAGE_SIZE})",
    )
    return parser
