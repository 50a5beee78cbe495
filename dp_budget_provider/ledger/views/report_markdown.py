"""The privacy report for people: the same content as its JSON, rendered as Markdown.

:func:`~report.build_report` states everything as plain values, complete enough to be
checked by a program; :func:`render_markdown` writes the same report for a reader, in
sections (guarantees per spend class and per subject, privacy unit, contribution bounds,
accountant, conversion, orders, policies, schedule, corrections, verification,
integrity), each table in a fixed column order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dp_budget_provider.ledger.views.schedule import (
    describe_mechanism,
    entry_summary,
    entry_target,
    number_text,
)
from dp_budget_provider.ledger.windows.calendar import calendar_label, display_window
from dp_budget_provider.ledger.windows.policy import checked_at


def _cell(value: Any) -> str:
    text = "-" if value is None or value == "" else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return lines


def _eps(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float | int) else _cell(value)


def _orders_text(orders: Sequence[float]) -> str:
    return ", ".join(number_text(float(order)) for order in orders)


def render_markdown(report: Mapping[str, Any]) -> str:
    """The report for people: the same content as the JSON, as Markdown."""
    version = report["code_version"]
    ledger = report["ledger"]
    verification = report["verification"]
    scope = report["scope"]
    conversion = report["conversion"]
    accountant = report["accountant"]
    commit = f" (git commit {version['git_commit']})" if version.get("git_commit") else ""
    scope_text = (
        ", ".join(
            f"{name} `{display_window(value) if name == 'window' else value}`"
            for name, value in scope.items()
            if value is not None
        )
        or "the whole ledger"
    )
    if verification["ok"]:
        verified = (
            f"**Verification: OK**: {verification['entries']} history entries and "
            f"{verification['accounts']} accounts check out (links, and every table proven "
            "from the history: caps never passed, costs, seals, policies, configuration)."
        )
    else:
        verified = (
            f"**Verification: FAILED**: {len(verification['problems'])} problem(s); the figures "
            "below come from a ledger whose audit trail does not check out."
        )
    out = [
        "# Privacy report",
        "",
        f"- Generated: {report['generated_at']}",
        f"- Ledger: `{ledger['url']}`, created {ledger['created_at'] or '-'}, "
        f"{ledger['history_entries']} history entries, head hash `{ledger['history_head']}`",
        f"- Scope: {scope_text}",
        f"- Code: {version['package']} {version['version']}{commit}",
        f"- {verified}",
        "",
        "## Guarantee per spend class",
        "",
        "The subjects of a window that hold the same spend (the same releases covered them), "
        f"one row each: every member's guarantee is the row's, an (epsilon, delta)-DP "
        f"statement at delta = {number_text(report['delta'])}. A sealed window's classes hold "
        "their final spend (state SEALED).",
        "",
    ]
    if report["classes"]:
        out += _table(
            ["tenant", "query type", "window", "subjects", "first subject", "epsilon", "cap",
             "held (open reservations charged)", "state", "releases", "class"],
            (
                (c["tenant"], c["query_type"], display_window(c["window"]), f"{c['subjects']:,}",
                 c["first_subject"], _eps(c["epsilon"]), _eps(c["cap_epsilon"]),
                 _eps(c["held_epsilon"]), c["state"], c["releases"], c["id"])
                for c in report["classes"]
            ),
        )  # fmt: skip
    else:
        out.append("No accounts in scope.")
    listing = report["subjects"]
    out += ["", "## Guarantee per subject", ""]
    if not listing["listed"]:
        out.append(
            f"Not listed: each of the {listing['total']:,} subjects in scope holds its class's "
            "guarantee above. `dp-budget report --subjects` lists them, "
            f"{listing['page_size']:,} per page (`--page N`, `--page-size M`)."
        )
    else:
        out += [
            f"Page {listing['page']} of {listing['pages']} ({listing['page_size']:,} subjects "
            f"per page, {listing['total']:,} in scope), in key order. Each row is an "
            f"(epsilon, delta)-DP statement at delta = {number_text(report['delta'])} for the "
            "releases charged to that key, with respect to the privacy unit below.",
            "",
        ]
    if report["accounts"]:
        out += _table(
            [
                "tenant",
                "subject",
                "query type",
                "window",
                "epsilon",
                "delta",
                "cap",
                "remaining",
                "held (open reservations charged)",
                "used",
                "state",
                "releases",
                "open reservations",
                "method",
            ],
            (
                (
                    a["tenant"],
                    a["subject"],
                    a["query_type"],
                    display_window(a["window"]),
                    _eps(a["epsilon"]),
                    number_text(a["delta"]),
                    _eps(a["cap_epsilon"]),
                    _eps(a["remaining"]),
                    _eps(a["held_epsilon"]),
                    f"{a['fraction'] * 100:.1f}%",
                    a["state"],
                    a["releases"],
                    a["open_reservations"],
                    a["method"],
                )
                for a in report["accounts"]
            ),
        )
    elif listing["listed"]:
        out.append("No accounts in scope.")
    out += [
        "",
        "## Privacy unit (adjacency)",
        "",
        report["privacy_unit"]["statement"],
        "",
        "## Contribution bounds and sensitivity",
        "",
        report["contribution_bounds"]["statement"],
        "",
    ]
    uses = report["contribution_bounds"]["mechanisms"]
    if uses:
        out += _table(
            ["mechanism", "meaning", "invocations charged", "entries"],
            (
                (
                    f"`{describe_mechanism(u['mechanism'])}`",
                    u["meaning"],
                    u["invocations_charged"],
                    ", ".join(str(s) for s in u["entries"]),
                )
                for u in uses
            ),
        )
    else:
        out.append("No release has been charged in scope.")
    out += [
        "",
        "## Accountant",
        "",
        f"{accountant['name']}. {accountant['composition']} {accountant['citation']}",
        "",
        *(f"- `{kind}`: {curve}" for kind, curve in accountant["curves"].items()),
        "",
        accountant["composition_model"],
        "",
        "## Conversion to (epsilon, delta)",
        "",
        f"- Name: `{conversion['name']}`",
        f"- Formula: {conversion['formula']}",
        f"- Citation: {conversion['citation']}",
    ]
    if conversion.get("analytic_gaussian"):
        out.append(f"- Gaussian-only accounts: {conversion['analytic_gaussian']}")
    out += [
        "",
        f"## Orders grid ({len(report['orders'])} orders)",
        "",
        _orders_text(report["orders"]),
        "",
        "## Policies",
        "",
    ]
    out += _table(
        [
            "tenant",
            "query type",
            "cap epsilon",
            "warn at",
            "calendar",
            "min window",
            "cap checked",
            "clause",
        ],  # fmt: skip
        (
            (
                p["tenant"],
                p["query_type"],
                _eps(p["cap_epsilon"]),
                f"{p['warn_fraction'] * 100:g}%",
                calendar_label(p["calendar"], p["calendar_length_seconds"], p.get("calendar_span")),
                f"{p['min_window_seconds']}s",
                checked_at(p.get("filter_order")),
                p["compliance_clause"],
            )
            for p in report["policies"]
        ),
    )
    if report["policy_changes"]:
        out += ["", "Policy changes:", ""]
        out += [
            f"- #{c['seq']} {c['at']} by {c['actor']}: {entry_summary(c)}"
            for c in report["policy_changes"]
        ]
    out += [
        "",
        "## Release schedule",
        "",
        "Every reserve, commit, release, reap, correction, rescope and reset in scope. "
        "'eps alone' is the epsilon of that entry's cost on its own; accounts compose "
        "curves, so these do not add up to the account's epsilon.",
        "",
    ]
    if report["schedule"]:
        out += _table(
            ["seq", "time", "action", "actor", "key", "mechanism", "count", "eps alone", "attempt"],
            (
                (
                    r["seq"],
                    r["at"],
                    r["action"],
                    r["actor"],
                    entry_target(r),
                    f"`{describe_mechanism(r['mechanism'])}`" if r["mechanism"] else "-",
                    r["count"],
                    _eps(r["epsilon_alone"]) if r["epsilon_alone"] is not None else "-",
                    r["attempt_id"],
                )
                for r in report["schedule"]
            ),
        )
    else:
        out.append("No entries in scope.")
    out += ["", "## Corrections", ""]
    if report["corrections"]:
        out += _table(
            ["seq", "time", "actor", "key", "mechanism", "count", "eps alone", "reason"],
            (
                (
                    c["seq"],
                    c["at"],
                    c["actor"],
                    entry_target(c),
                    f"`{describe_mechanism(c['mechanism'])}`",
                    c["count"],
                    _eps(c["epsilon_alone"]) if c["epsilon_alone"] is not None else "-",
                    c["reason"],
                )
                for c in report["corrections"]
            ),
        )
    else:
        out.append("None.")
    out += ["", "## Verification", "", verified]
    if verification["problems"]:
        out += ["", *(f"- {problem}" for problem in verification["problems"])]
    integrity = report["integrity"]
    keyed = (
        f"keyed (HMAC-SHA256, key id `{integrity['chain_key_id'][:16]}`)"
        if integrity["history_keyed"]
        else "**not keyed**: whoever can write the ledger database could rewrite it"
    )
    quarantined = (
        f"**quarantined** since {integrity['quarantined_since']}: {integrity['quarantine_reason']}"
        if integrity["quarantined_since"]
        else "not quarantined"
    )
    out += [
        "",
        "## Integrity",
        "",
        f"- History: {keyed}",
        f"- Releases: {quarantined}",
        "",
        integrity["statement"],
    ]
    out += ["", "## How to read this report", "", report["delta_interpretation"], ""]
    return "\n".join(out)
