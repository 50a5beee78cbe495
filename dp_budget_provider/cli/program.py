"""``dp-budget``'s entry point: parse, run the command, turn its errors into one line on
stderr and an exit code."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence

from sqlalchemy.exc import SQLAlchemyError

from dp_budget_provider.cli.errors import CommandError, UsageError
from dp_budget_provider.cli.parser import build_parser
from dp_budget_provider.ledger import LedgerError

# The ledger's errors name its Python API; a shell user wrote these options and commands.
_CLI_WORDS = (
    (re.compile(r"\bcap_epsilon\b"), "--epsilon"),
    (re.compile(r"\bwarn_fraction\b"), "--warn-fraction"),
    (re.compile(r"\blength_seconds\b"), "--length-seconds"),
    (re.compile(r"\bmin_window\b"), "--min-window-seconds"),
    (re.compile(r"\bcompliance_clause\b"), "--clause"),
    (re.compile(r"\bhorizon_windows\b"), "--horizon-windows"),
    (re.compile(r"\bacross='windows'"), "--across windows"),
    (re.compile(r"\bquery_type\b"), "--query-type"),
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
