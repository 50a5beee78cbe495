"""The values ``dp-budget`` options take, checked as argparse parses them: a bad value
is a usage error naming the option, before any ledger is opened."""

from __future__ import annotations

import argparse
import math
import os
import re
from datetime import timedelta
from pathlib import Path

from dp_budget_provider.ledger import Share
from dp_budget_provider.ledger.accounts.keys import MAX_STORED_INT, canonical_part
from dp_budget_provider.ledger.audit.checkpoints import CheckpointFile, CheckpointUnreadable
from dp_budget_provider.ledger.windows.calendar import window_bounds

WINDOW_LABELS = (
    "a window label of the scope's calendar: ISO week 2026-w49, month 2026-12, day "
    "2026-12-01, or a fixed calendar's label"
)


DEFAULT_STATUS_LIMIT = 50


DEFAULT_HISTORY_LIMIT = 100


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


_DURATION = re.compile(r"(?:\d+(?:\.\d+)?[smhdw])+")


_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


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


def whole_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    if value > MAX_STORED_INT:
        raise argparse.ArgumentTypeError(f"expected a number up to {MAX_STORED_INT}, got {text!r}")
    return value


def page_number(text: str) -> int:
    """A page number: a whole number from 1."""
    value = whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"pages are numbered from 1, got {text!r}")
    return value


def finite_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_number(text: str) -> float:
    value = finite_number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def filter_order_value(text: str) -> float | str:
    """A Rényi order above 1, ``auto`` (the cap's own order) or ``reported`` (the cap
    checked on the reported epsilon: not a privacy filter)."""
    if text.strip().lower() in ("auto", "reported"):
        return text.strip().lower()
    value = finite_number(text)
    if value <= 1:
        raise argparse.ArgumentTypeError(
            f"expected a Rényi order > 1, 'auto' or 'reported', got {text!r}"
        )
    return value


def share_value(text: str) -> Share:
    """``PRINCIPAL=FRACTION:DAG[,DAG...]``: a principal's share of a cap and the DAGs that
    act for it (:meth:`Share.parse`)."""
    try:
        return Share.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def fraction(text: str) -> float:
    value = positive_number(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


# The longest span a timedelta (and so a window or a minimum window) can hold, in seconds.
_MAX_SECONDS = timedelta.max.days * 86400


def duration_seconds(text: str) -> int:
    value = whole_number(text)
    if not 0 < value <= _MAX_SECONDS:
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds from 1 to {_MAX_SECONDS}, got {text!r}"
        )
    return value


def window_label(text: str) -> str:
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


def window_filter(text: str) -> str:
    """A window label, or a pattern with ``*`` (any run of characters) matching labels."""
    return text if "*" in text else window_label(text)


def checkpoint_file(text: str) -> CheckpointFile:
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


def window_and_tenant(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The --window (canonical already: ``window_label``) and --tenant filters."""
    tenant = None if args.tenant is None else canonical_part("tenant", args.tenant)
    return args.window, tenant
