"""How commands print: aligned tables, one JSON document, an account's standing, history
lines."""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any

from dp_budget_provider.ledger import PrivacyBudgetLedger
from dp_budget_provider.ledger.records import AccountStatus
from dp_budget_provider.ledger.views import report


def columns(
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


def print_lines(lines: Sequence[str]) -> None:
    for line in lines:
        print(line)


def percent(fraction: float) -> str:
    return f"{fraction * 100:.1f}%"


def shortest(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def header(ledger: PrivacyBudgetLedger) -> str:
    return (
        f"ledger {ledger.url}  delta={shortest(ledger.delta)}  conversion={ledger.conversion}  "
        f"orders={ledger.orders.size}"
    )


def print_json(document: Any) -> None:
    """One JSON document on stdout (strict: a NaN or infinity is a bug, never printed)."""
    print(json.dumps(document, indent=2, ensure_ascii=False, allow_nan=False))


def entry_records(
    ledger: PrivacyBudgetLedger, entries: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """History entries as the schedule rows that ``history`` and ``show`` print or emit."""
    mechanisms = report.mechanisms_by_reservation(entries)
    epsilon_alone = report.EpsilonAlone(ledger)
    names = report.SubjectNames(ledger, entries)
    return [report.entry_record(e, mechanisms, epsilon_alone, names) for e in entries]


def history_lines(ledger: PrivacyBudgetLedger, entries: Sequence[dict[str, Any]]) -> list[str]:
    records = entry_records(ledger, entries)
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
    return columns(["SEQ", "TIME", "ACTION", "ACTOR", "KEY", "DETAILS"], rows, right=(0,))


HELD_LEGEND = (
    "EPS is committed; HELD also counts the OPEN reservations as charged, and REMAINING "
    "is the cap minus HELD"
)


STANDING_HEADERS = ("EPS", "HELD", "CAP", "REMAINING", "USED", "OPEN", "RELEASES", "STATE")


def standing(status: AccountStatus) -> tuple[Any, ...]:
    """An account's numbers and state, the columns under ``STANDING_HEADERS``."""
    return (
        f"{status.epsilon:.4f}",
        f"{status.held_epsilon:.4f}",
        f"{status.cap_epsilon:.4f}",
        f"{status.remaining_after_held:.4f}",
        percent(status.fraction),
        status.open_reservations,
        status.releases,
        status.state,
    )


def status_lines(status: AccountStatus, delta: float) -> list[str]:
    """An account's state, committed and held spend, and headroom, as ``show`` prints them."""
    return [
        f"state     {status.state}",
        f"epsilon   {status.epsilon:.6g} at delta {shortest(delta)} ({status.method})",
        f"cap       {shortest(status.cap_epsilon)}: remaining {status.remaining:.6g}, "
        f"{percent(status.fraction)} used",
        f"held      {status.held_epsilon:.6g} with its open reservations charged: remaining "
        f"{status.remaining_after_held:.6g}",
        f"releases  {status.releases} charged, {status.open_reservations} open "
        f"reservation(s), updated {status.updated_at}",
    ]
