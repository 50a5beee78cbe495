"""The privacy report: what a ledger's guarantees are, stated completely enough to be checked.

An epsilon on its own is a misleading one-number assurance. Following the accounting
notes this project grew from, a report states, for every account: epsilon *and* delta;
the privacy unit (which neighbouring datasets the guarantee is about); the contribution
bounds each release declared; the accountant and its grid of Rényi orders; the
conversion to (epsilon, delta) with its formula and citation; the full release
schedule (every reserve, commit, release, reap, correction, rescope and reset, with
time, mechanism, count, cost and attempt id); corrections separately; the policies with
the compliance clauses they implement; whether the audit chain verifies; and the code
version that produced it. :func:`build_report` returns all of that as one JSON-ready
dict; ``report_markdown`` renders it for people and ``schedule`` makes its rows.

Two reads the ledger API does not offer (the keys of a resolved multi-key reservation,
and a count of the subjects in scope) run here, inside the ledger package, on the
ledger's own engine.

The CLI and the UI's routes (``plugins/app.py``) reach the report through this module
alone (their reach into the ledger is fixed in ``tests/test_layering.py``), so it hands on
the names they use of the schedule and of the Markdown rendering.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import select

import dp_budget_provider
from dp_budget_provider.ledger.accounts.keys import canonical_part, whole_number
from dp_budget_provider.ledger.accounts.subject_rows import LIVE, STORES, subjects_of
from dp_budget_provider.ledger.audit.checkpoints import CheckpointStore, verify_and_checkpoint
from dp_budget_provider.ledger.errors import LedgerUnavailable
from dp_budget_provider.ledger.ledger import PrivacyBudgetLedger
from dp_budget_provider.ledger.records import AccountStatus
from dp_budget_provider.ledger.storage import statements
from dp_budget_provider.ledger.storage.schema import ReservationKey
from dp_budget_provider.ledger.views.pages import AccountFilter
from dp_budget_provider.ledger.views.privacy_unit import privacy_unit
from dp_budget_provider.ledger.views.report_markdown import render_markdown
from dp_budget_provider.ledger.views.schedule import (
    EpsilonAlone,
    SubjectNames,
    describe_mechanism,
    entry_record,
    entry_summary,
    entry_target,
    key_label,
    mechanisms_by_reservation,
)
from dp_budget_provider.ledger.views.spend_classes import SpendClass, every_class
from dp_budget_provider.ledger.windows.policy import ANY, lookup_order

__all__ = [
    # the report
    "ACCOUNTANT",
    "CONTRIBUTION_BOUNDS",
    "CONVERSIONS",
    "DELTA_INTERPRETATION",
    "INTEGRITY",
    "MAX_SUBJECTS_PAGE_SIZE",
    "REPORT_FORMAT",
    "SCHEDULE_ACTIONS",
    "SUBJECTS_PAGE_SIZE",
    "account_record",
    "build_report",
    "class_record",
    "code_version",
    "count_accounts",
    "integrity_record",
    "mechanism_meaning",
    "verification_record",
    # handed on from the schedule and the Markdown rendering
    "EpsilonAlone",
    "SubjectNames",
    "describe_mechanism",
    "entry_record",
    "entry_summary",
    "entry_target",
    "key_label",
    "mechanisms_by_reservation",
    "render_markdown",
]

REPORT_FORMAT = 2  # 2: classes by default; the per-subject listing opt-in and paged
SUBJECTS_PAGE_SIZE = 1000  # subjects per page of the per-subject listing, by default
MAX_SUBJECTS_PAGE_SIZE = 100_000
SCHEDULE_ACTIONS = ("reserve", "commit", "release", "reap", "correction", "rescope", "reset")

CONTRIBUTION_BOUNDS = (
    "Every release declares its noise relative to its sensitivity to one subject's "
    "contributions (the mechanism spec below: a noise multiplier sigma/Delta_2 or an epsilon0 "
    "Delta_1/scale). The ledger never sees the data: it cannot check that the release code "
    "enforced the declared bound (contribution clipping, deduplication, a cap on records per "
    "subject). The guarantees in this report hold only if every release's actual sensitivity to "
    "one subject's contributions within the window was at most the declared one."
)

ACCOUNTANT = {
    "name": "Rényi differential privacy (RDP) accountant",
    "composition": (
        "The RDP curves of all releases charged to an account add up, order by order "
        "(Mironov 2017, Prop. 1); the sum is converted to (epsilon, delta) once, at the "
        "ledger's fixed delta, minimising over the ledger's fixed grid of orders."
    ),
    "citation": "I. Mironov, Rényi Differential Privacy, IEEE CSF 2017.",
    "curves": {
        "gaussian": "RDP(a) = a / (2 z^2), z = sigma / L2 sensitivity (Mironov 2017)",
        "laplace": (
            "exact Laplace RDP, eps0 = L1 sensitivity / scale "
            "(Mironov 2017, Prop. 6; evaluated in log space)"
        ),
        "pure_dp": "RDP(a) = a eps0^2 / 2 (eps0-DP implies eps0^2/2-zCDP; Bun-Steinke 2016)",
        "zcdp": "RDP(a) = rho a (rho-zCDP)",
        "poisson_subsampled_gaussian": (
            "Poisson-subsampled Gaussian RDP (Mironov-Talwar-Zhang 2019), as dp_accounting"
        ),
    },
    "composition_model": (
        "Adaptive choice of queries is covered by composition. A policy with a filter order "
        "checks its cap as a privacy filter at that one Rényi order (Feldman and Zrnic 2021, "
        "Theorems 3.1 and 4.3): its cap holds although each release's parameters were chosen "
        "from earlier outputs. A policy without one checks the cap on the reported epsilon: "
        "valid for parameters fixed in advance, and a filter only where every release has a "
        "zCDP curve (docs/accounting.md). Each policy's filter order is in the policies."
    ),
}

CONVERSIONS = {
    "improved": {
        "name": "improved",
        "formula": (
            "epsilon = min over orders a > 1.01 of RDP(a) + log1p(-1/a) - (log(delta) + log(a)) "
            "/ (a - 1); epsilon = 0 when delta^2 + expm1(-RDP(a)) > 0 (Bretagnolle-Huber)"
        ),
        "citation": (
            "C. Canonne, G. Kamath, T. Steinke, The Discrete Gaussian for Differential Privacy, "
            "NeurIPS 2020, Prop. 12; S. Asoodeh et al., 2020. The conversion used by Google "
            "dp_accounting, Opacus and OpenDP."
        ),
        "analytic_gaussian": (
            "While every release charged to an account is Gaussian, the composition is exactly "
            "one Gaussian mechanism with mu = sqrt(sum 1/z_i^2) (Dong-Roth-Su 2019), and the "
            "exact analytical epsilon (Balle-Wang 2018) is reported when it is smaller "
            "(method 'analytic-gaussian')."
        ),
    },
    "classic": {
        "name": "classic",
        "formula": "epsilon = min over orders a of RDP(a) + log(1/delta) / (a - 1)",
        "citation": "I. Mironov, Rényi Differential Privacy, IEEE CSF 2017, Prop. 3.",
        "analytic_gaussian": None,
    },
}

DELTA_INTERPRETATION = (
    "delta is the additive slack allowed between the output distributions on neighbouring "
    "datasets; it is not the probability that the whole dataset is exposed. What an (epsilon, "
    "delta) pair means in practice depends on the mechanism, the privacy unit and what an "
    "adversary already knows. Two epsilons are comparable only when delta, the privacy unit, the "
    "contribution bounds and the accountant are the same: a smaller epsilon for one row can be "
    "weaker than a larger epsilon for one person's whole bounded contribution."
)

_MECHANISM_MEANING = {
    "gaussian": "Gaussian noise, sigma = {noise_multiplier:g} x the L2 sensitivity to one subject",
    "laplace": "continuous Laplace noise, scale = L1 sensitivity to one subject / {epsilon0:g}",
    "pure_dp": "an epsilon0 = {epsilon0:g} pure-DP release with respect to one subject",
    "zcdp": "a rho = {rho:g} zCDP release with respect to one subject",
    "poisson_subsampled_gaussian": (
        "Gaussian noise, sigma = {noise_multiplier:g} x the per-subject clipping norm, on a "
        "Poisson subsample with rate {sampling_rate:g}"
    ),
}


# ---------------------------------------------------------------------- small pieces


def account_record(status: AccountStatus, delta: float) -> dict[str, Any]:
    """One account as plain JSON values."""
    return {
        **status.key.as_dict(),
        "epsilon": status.epsilon,
        "delta": delta,
        "cap_epsilon": status.cap_epsilon,
        "remaining": status.remaining,
        "fraction": status.fraction,
        "held_epsilon": status.held_epsilon,
        "remaining_after_held": status.remaining_after_held,
        "state": status.state,
        "releases": status.releases,
        "open_reservations": status.open_reservations,
        "method": status.method,
        "updated_at": status.updated_at,
        "rescoped_to": status.rescoped_to,
        "sealed_at": status.sealed_at,
        "account": status.account,
        "subjects": status.subjects,
    }


def class_record(spend_class: SpendClass, delta: float) -> dict[str, Any]:
    """One spend class as plain JSON values: its id, size, least subject and status."""
    return {
        **account_record(spend_class.status, delta),
        "id": spend_class.id,
        "subjects": spend_class.subjects,
        "first_subject": spend_class.status.key.subject,
    }


def mechanism_meaning(spec: Mapping[str, Any]) -> str:
    """What a mechanism spec says about its sensitivity, in words."""
    template = _MECHANISM_MEANING.get(str(spec.get("kind")))
    if template is None:
        return f"{describe_mechanism(spec)}: sensitivity as declared by its parameters"
    try:
        return template.format(**spec)
    except (KeyError, ValueError):
        return describe_mechanism(spec)


def _canonical(name: str, value: str | None) -> str | None:
    return None if value is None else canonical_part(name, value)


# ---------------------------------------------------------------------- reads the API lacks


def count_accounts(
    ledger: PrivacyBudgetLedger,
    *,
    window: str | None = None,
    tenant: str | None = None,
    sealed: bool = False,
    subject: str | None = None,
) -> int:
    """How many subjects match (``status`` says how many it did not show): of live
    accounts, and of sealed ones as :meth:`accounts` includes them (a window named, or
    ``sealed``), counted by class: one row read per account; one subject's accounts
    (``subject``) are counted on its own rows."""
    stores = STORES if sealed or window is not None else (LIVE,)
    total = 0
    if subject is not None:
        return len(ledger.accounts(window=window, tenant=tenant, sealed=sealed, subject=subject))
    with ledger.reading() as connection:
        for store in stores:
            accounts = store.accounts
            query = select(subjects_of(accounts)).select_from(accounts)
            if window is not None:
                query = query.where(accounts.window == canonical_part("window", window))
            if tenant is not None:
                query = query.where(accounts.tenant == canonical_part("tenant", tenant))
            total += int(connection.execute(query).scalar_one())
    return total


def _reservation_keys(
    ledger: PrivacyBudgetLedger, reservation_ids: Sequence[str]
) -> dict[str, list[dict[str, str]]]:
    keys: dict[str, list[dict[str, str]]] = {rid: [] for rid in reservation_ids}
    with ledger.reading() as connection:
        for chunk in statements.chunks(reservation_ids):
            rows = connection.execute(
                select(ReservationKey)
                .where(ReservationKey.reservation_id.in_(chunk))
                .order_by(ReservationKey.reservation_id, ReservationKey.position)
            )
            for row in rows:
                keys[row.reservation_id].append(
                    {
                        "tenant": row.tenant,
                        "subject": row.subject,
                        "query_type": row.query_type,
                        "window": row.window,
                    }
                )
    return keys


# ---------------------------------------------------------------------- code version


def code_version() -> dict[str, Any]:
    """Package version, and the git commit when the package runs from a git checkout."""
    return {
        "package": "dp-budget-provider",
        "version": dp_budget_provider.__version__,
        "git_commit": _git_commit(Path(dp_budget_provider.__file__).resolve().parent.parent),
    }


def _git_commit(root: Path) -> str | None:
    """HEAD of the checkout at ``root`` (read from .git, without running git), else None."""
    dot_git = root / ".git"
    try:
        if dot_git.is_file():
            line = dot_git.read_text().strip()
            if not line.startswith("gitdir:"):
                return None
            git_dir = (root / line.removeprefix("gitdir:").strip()).resolve()
        elif dot_git.is_dir():
            git_dir = dot_git
        else:
            return None
        head = (git_dir / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head if re.fullmatch(r"[0-9a-f]{40,64}", head) else None
        ref = head.removeprefix("ref:").strip()
        common = git_dir
        if (git_dir / "commondir").is_file():
            common = (git_dir / (git_dir / "commondir").read_text().strip()).resolve()
        for base in (git_dir, common):
            if (base / ref).is_file():
                sha = (base / ref).read_text().strip()
                return sha if re.fullmatch(r"[0-9a-f]{40,64}", sha) else None
        packed = common / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                sha, _, name = line.partition(" ")
                if name == ref and re.fullmatch(r"[0-9a-f]{40,64}", sha):
                    return sha
    except OSError:
        return None
    return None


# ---------------------------------------------------------------------- the report


def verification_record(
    ledger: PrivacyBudgetLedger, store: CheckpointStore | None = None
) -> dict[str, Any]:
    """:meth:`PrivacyBudgetLedger.verify` as plain values, failing closed.

    With ``store``, the verify is against its last checkpoint, and a passing one is
    checkpointed there. A verifier that stops on a damaged entry must not read as a
    pass, nor hide the damage behind a crash: if verification cannot complete, the record
    says so as a problem. Only an unreachable database is raised (nothing was checked).
    """
    try:
        result = ledger.verify() if store is None else verify_and_checkpoint(ledger, store)
    except LedgerUnavailable:
        raise
    except Exception as error:
        return {
            "ok": False,
            "entries": None,
            "accounts": None,
            "keyed": ledger.chain_key.keyed,
            "problems": [f"verification could not complete: {type(error).__name__}: {error}"],
            "notes": [],
        }
    return {
        "ok": result.ok,
        "entries": result.entries,
        "accounts": result.accounts,
        "keyed": result.keyed,
        "problems": list(result.problems),
        "notes": list(result.notes),
    }


def _finite(value: Any) -> Any:
    """JSON has no inf/NaN: write them as strings rather than emit invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _matches(key: Mapping[str, str], window: str | None, tenant: str | None) -> bool:
    return (window is None or key["window"] == window) and (
        tenant is None or key["tenant"] == tenant
    )


def _page_size(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"page size must be a whole number, got {value!r}")
    if not 1 <= value <= MAX_SUBJECTS_PAGE_SIZE:
        raise ValueError(f"page size must be between 1 and {MAX_SUBJECTS_PAGE_SIZE}, got {value}")
    return value


def build_report(
    ledger: PrivacyBudgetLedger,
    *,
    window: str | None = None,
    tenant: str | None = None,
    now: datetime | None = None,
    subjects: bool = False,
    page: int = 1,
    page_size: int = SUBJECTS_PAGE_SIZE,
) -> dict[str, Any]:
    """The privacy report of ``ledger`` (optionally one window and/or tenant) as one dict.

    Guarantees are stated per spend class, live and sealed (every member's guarantee is
    its class's): one row per class, whatever the population. The per-subject listing
    (``subjects``) is one page of ``page_size`` subjects in key order, page ``page``
    counted from 1; the report says which page of how many it holds.

    Everything in it is plain JSON (``json.dumps`` works on it). Verification always
    covers the whole ledger: a chain cannot be checked in part.
    """
    window = _canonical("window", window)
    tenant = _canonical("tenant", tenant)
    if not isinstance(subjects, bool):
        raise ValueError(f"subjects must be True or False, got {subjects!r}")
    page_size = _page_size(page_size)
    page = whole_number("page", page)
    generated = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
    delta = ledger.delta
    policies = ledger.policies()
    scopes = {policy.scope: policy for policy in policies}
    classes = [
        class_record(c, delta)
        for c in every_class(ledger, AccountFilter(tenant=tenant, window=window, sealed=True))
    ]
    total = sum(c["subjects"] for c in classes)
    pages = max(1, -(-total // page_size))
    if not 1 <= page <= pages:
        raise ValueError(f"page {page} does not exist: the listing has {pages} page(s)")
    accounts = []
    listed = (
        ledger.accounts(
            window=window,
            tenant=tenant,
            limit=page_size,
            offset=(page - 1) * page_size,
            sealed=True,
        )
        if subjects
        else []
    )
    for status in listed:
        record = account_record(status, delta)
        scope = next(
            s for s in lookup_order(status.key.tenant, status.key.query_type) if s in scopes
        )
        record["policy_scope"] = {"tenant": scope[0], "query_type": scope[1]}
        record["compliance_clause"] = scopes[scope].compliance_clause
        accounts.append(record)

    entries = ledger.history()
    mechanisms = mechanisms_by_reservation(entries)
    epsilon_alone = EpsilonAlone(ledger)
    names = SubjectNames(ledger, entries)
    filtered = window is not None or tenant is not None
    multi_key = sorted(
        {
            e["reservation_id"]
            for e in entries
            if filtered and e["key"] is None and e.get("reservation_id")
        }
    )
    keys_of = _reservation_keys(ledger, multi_key) if multi_key else {}

    def in_scope(entry: Mapping[str, Any]) -> bool:
        if not filtered:
            return True
        if entry["action"] == "reset":
            return window is None or entry["payload"].get("window") == window
        if entry["key"] is not None:
            return _matches(entry["key"], window, tenant)
        return any(_matches(k, window, tenant) for k in keys_of.get(entry["reservation_id"], []))

    schedule = []
    policy_changes = []
    created_at = None
    for entry in entries:
        if entry["action"] == "create":
            created_at = entry["at"]
        elif entry["action"] == "policy":
            if tenant is None or entry["payload"].get("tenant") in (ANY, tenant):
                policy_changes.append(entry_record(entry, mechanisms))
        elif entry["action"] in SCHEDULE_ACTIONS and in_scope(entry):
            record = entry_record(entry, mechanisms, epsilon_alone, names)
            if filtered and record["key"] is None and entry.get("reservation_id"):
                record["keys_in_scope"] = sum(
                    _matches(k, window, tenant) for k in keys_of.get(entry["reservation_id"], [])
                )
            schedule.append(record)
    corrections = [record for record in schedule if record["action"] == "correction"]

    mechanism_uses: dict[str, dict[str, Any]] = {}
    for record in schedule:
        if record["action"] not in ("commit", "reap", "correction") or not record["mechanism"]:
            continue
        signature = json.dumps(record["mechanism"], sort_keys=True)
        use = mechanism_uses.setdefault(
            signature,
            {
                "mechanism": record["mechanism"],
                "meaning": mechanism_meaning(record["mechanism"]),
                "invocations_charged": 0,
                "entries": [],
            },
        )
        use["invocations_charged"] += record["count"] or 0
        use["entries"].append(record["seq"])

    verification = verification_record(ledger)
    orders = [float(order) for order in np.asarray(ledger.orders)]
    report = {
        "report_format": REPORT_FORMAT,
        "generated_at": generated.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "code_version": code_version(),
        "ledger": {
            "url": ledger.url,
            "created_at": created_at,
            "delta": delta,
            "conversion": ledger.conversion,
            "history_head": entries[-1]["hash"] if entries else None,
            "history_entries": len(entries),
        },
        "scope": {"window": window, "tenant": tenant},
        "delta": delta,
        "delta_interpretation": DELTA_INTERPRETATION,
        "privacy_unit": privacy_unit(policies, tenant),
        "contribution_bounds": {
            "statement": CONTRIBUTION_BOUNDS,
            "mechanisms": list(mechanism_uses.values()),
        },
        "accountant": {**ACCOUNTANT, "order_count": len(orders)},
        "conversion": CONVERSIONS[ledger.conversion],
        "orders": orders,
        "classes": classes,
        "subjects": {
            "listed": subjects,
            "total": total,
            "page": page,
            "pages": pages,
            "page_size": page_size,
        },
        "accounts": accounts,
        "schedule": schedule,
        "corrections": corrections,
        "policies": [
            p.as_record() for p in policies if tenant is None or p.tenant in (ANY, tenant)
        ],
        "policy_changes": policy_changes,
        "verification": verification,
        "integrity": integrity_record(ledger, verification),
    }
    return _finite(report)


INTEGRITY = (
    "Budget windows are the ledger's: a release is charged to every window of its scope's "
    "calendar that its data interval overlaps, and a window closed past its grace period is "
    "sealed, never charged again, so closing a window never refunds. The history is the "
    "source of truth; verify proves every table from it (caps never passed at any grant, "
    "costs, seals, policies, configuration). With a chain key kept outside the ledger "
    "database, every history link is an HMAC that nobody who can only write the database "
    "can forge; checkpoints of the verified chain heads, kept outside the database, make "
    "erasing or rewriting checkpointed history detectable. A failed verify quarantines the "
    "ledger: no release until an operator clears it, an audited act. What an insider can "
    "still do: roll the ledger database back to a state after the last checkpoint, or, "
    "holding the key, forge history after it; between a tampering and the next verify, "
    "releases run on what the tables say."
)


def integrity_record(ledger: PrivacyBudgetLedger, verification: Mapping[str, Any]) -> dict:
    """How far the figures can be trusted: key, quarantine, and what protects them."""
    quarantine = ledger.quarantine_status()
    return {
        "history_keyed": bool(verification.get("keyed")),
        "chain_key_id": ledger.chain_key.key_id,
        "quarantined_since": None if quarantine is None else quarantine[0],
        "quarantine_reason": None if quarantine is None else quarantine[1],
        "statement": INTEGRITY,
    }
