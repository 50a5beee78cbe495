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
dict, :func:`render_markdown` renders it for people.

Two read-only lookups the ledger API does not offer (an account's row, the keys of a
resolved multi-key reservation) and an account count run here, inside the ledger
package, on the ledger's own engine.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import select, tuple_

import dp_budget_provider
from dp_budget_provider.ledger.accounts.keys import LedgerKey, canonical_part, whole_number
from dp_budget_provider.ledger.accounts.spend import Spend
from dp_budget_provider.ledger.accounts.subject_rows import LIVE, STORES, subjects_of
from dp_budget_provider.ledger.audit.checkpoints import CheckpointStore, verify_and_checkpoint
from dp_budget_provider.ledger.errors import LedgerUnavailable
from dp_budget_provider.ledger.ledger import PrivacyBudgetLedger
from dp_budget_provider.ledger.records import AccountStatus
from dp_budget_provider.ledger.storage import statements
from dp_budget_provider.ledger.storage.schema import (
    Cohort,
    CohortMember,
    ReservationKey,
)
from dp_budget_provider.ledger.views.queries import AccountFilter, reserve_cohorts
from dp_budget_provider.ledger.views.spend_classes import SpendClass, every_class
from dp_budget_provider.ledger.windows.calendar import display_window
from dp_budget_provider.ledger.windows.policy import ANY, lookup_order

REPORT_FORMAT = 2  # 2: classes by default; the per-subject listing opt-in and paged
SUBJECTS_PAGE_SIZE = 1000  # subjects per page of the per-subject listing, by default
MAX_SUBJECTS_PAGE_SIZE = 100_000
SCHEDULE_ACTIONS = ("reserve", "commit", "release", "reap", "correction", "rescope", "reset")

PRIVACY_UNIT = {
    "unit": "subject",
    "statement": (
        "The privacy unit is the `subject` part of the ledger key (tenant, subject, query_type, "
        "window). Two datasets are neighbouring when they differ in one subject's contributions "
        "within a window: all records of that subject that feed the releases charged to one key. "
        "An account's (epsilon, delta) bounds what the releases charged to that key reveal about "
        "one subject. Releases charged to the same subject under another query type, tenant or "
        "window are accounted in other accounts; their losses compose on top of each other and "
        "this report does not bound the sum. A reset drops the accounts of a closed window, not "
        "the privacy loss those releases caused."
    ),
}

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
        "Mechanism parameters are fixed by pipeline code. Adaptive choice of queries is covered "
        "by composition; parameters chosen from earlier private outputs would need a privacy "
        "filter, which this accountant is not."
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


def describe_mechanism(spec: Mapping[str, Any] | None) -> str:
    """``gaussian(noise_multiplier=4)``: kind and parameters in one token."""
    if not spec:
        return "-"
    params = ", ".join(f"{k}={_number(v)}" for k, v in sorted(spec.items()) if k != "kind")
    return f"{spec.get('kind', '?')}({params})"


def mechanism_meaning(spec: Mapping[str, Any]) -> str:
    """What a mechanism spec says about its sensitivity, in words."""
    template = _MECHANISM_MEANING.get(str(spec.get("kind")))
    if template is None:
        return f"{describe_mechanism(spec)}: sensitivity as declared by its parameters"
    try:
        return template.format(**spec)
    except (KeyError, ValueError):
        return describe_mechanism(spec)


def key_label(key: Mapping[str, str] | LedgerKey | None) -> str:
    """``tenant/subject/query_type/window``, the window as people read it."""
    if key is None:
        return "-"
    if isinstance(key, LedgerKey):
        key = key.as_dict()
    return f"{key['tenant']}/{key['subject']}/{key['query_type']}/{display_window(key['window'])}"


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _canonical(name: str, value: str | None) -> str | None:
    return None if value is None else canonical_part(name, value)


class EpsilonAlone:
    """Epsilon of one entry's cost on its own, at the ledger's delta (cached per cost)."""

    def __init__(self, ledger: PrivacyBudgetLedger) -> None:
        self._orders = np.asarray(ledger.orders)
        self._delta = ledger.delta
        self._conversion = ledger.conversion
        self._cache: dict[str, float] = {}

    def __call__(self, cost: Mapping[str, Any] | None) -> float | None:
        if not cost:
            return None
        signature = json.dumps(cost, sort_keys=True)
        if signature not in self._cache:
            spend = Spend.from_payload(dict(cost), self._orders.size)
            bound = spend.epsilon(self._orders, self._delta, self._conversion)
            self._cache[signature] = bound.epsilon
        return self._cache[signature]


# ---------------------------------------------------------------------- history entries


def entry_record(
    entry: Mapping[str, Any],
    mechanisms: Mapping[str, Mapping[str, Any]],
    epsilon_alone: Any = None,
    names: SubjectNames | None = None,
) -> dict[str, Any]:
    """A history entry as a schedule row.

    ``mechanisms`` maps reservation ids to the mechanism spec of their ``reserve`` entry
    (commit, release and reap entries do not repeat it). ``epsilon_alone`` (a callable on a
    cost payload) adds what the entry's cost would be on its own; epsilons do not add up,
    accounts compose curves. ``account`` is the key the entry names (an account's);
    with ``names``, ``key`` is the subject's where that account is a class of one, and
    ``subjects`` counts the subjects the entry covered (None for entries made before
    spend classes, whose keys are subjects).
    """
    payload = entry["payload"]
    reservation_id = entry.get("reservation_id")
    mechanism = payload.get("mechanism")
    if mechanism is None and reservation_id is not None:
        mechanism = mechanisms.get(reservation_id)
    cost = payload.get("cost") or payload.get("carried")
    record: dict[str, Any] = {
        "seq": entry["seq"],
        "at": entry["at"],
        "action": entry["action"],
        "actor": entry["actor"],
        "key": entry.get("key"),
        "account": entry.get("key"),
        "subjects": None,
        "key_count": payload.get("key_count", 1 if entry.get("key") else 0),
        "reservation_id": reservation_id,
        "attempt_id": payload.get("attempt_id"),
        "mechanism": mechanism,
        "count": payload.get("count"),
        "cost": cost,
        "epsilon_alone": epsilon_alone(cost) if epsilon_alone is not None else None,
        "reason": payload.get("reason"),
        "hash": entry.get("hash"),
    }
    if entry["action"] == "reserve":
        prospective = payload.get("prospective_epsilon")
        if prospective is None and payload.get("prospective") and epsilon_alone is not None:
            # decided by the server (dp_reserve), which records the prospective spend
            prospective = epsilon_alone(payload["prospective"])
        record["prospective_epsilon"] = prospective
    if entry["action"] in ("reserve", "commit", "reap") and "keys_digest" in payload:
        record["keys_digest"] = payload["keys_digest"]
    if entry["action"] == "rescope":
        record["from"] = payload.get("from")
    if entry["action"] == "reset":
        record["window"] = payload.get("window")
        record["accounts_dropped"] = payload.get("accounts")
        record["closed_at"] = payload.get("closed_at")
    if entry["action"] in ("create", "policy"):
        record["settings"] = payload
    if names is not None:
        names.name(entry, record)
    return record


def entry_summary(record: Mapping[str, Any]) -> str:
    """What happened in one schedule row, in one line."""
    action = record["action"]
    settings = record.get("settings") or {}
    if action == "create":
        return (
            f"ledger created: delta {_number(settings.get('delta'))}, "
            f"{settings.get('conversion')} conversion, {len(settings.get('orders', []))} orders"
        )
    if action == "policy":
        clause = settings.get("compliance_clause") or ""
        text = (
            f"policy {settings.get('tenant')}/{settings.get('query_type')}: cap "
            f"{_number(settings.get('cap_epsilon'))}, warn {_number(settings.get('warn_fraction'))}"
            f", {(settings.get('calendar') or {}).get('kind')}"
        )
        return text + (f", clause: {clause}" if clause else "")
    if action == "reset":
        return (
            f"window {display_window(str(record.get('window')))} reset, "
            f"{record.get('accounts_dropped')} account(s) "
            "dropped (history kept)"
        )
    parts = []
    if record.get("mechanism"):
        count = record.get("count")
        parts.append(describe_mechanism(record["mechanism"]) + (f" x{count}" if count else ""))
    elif record.get("count"):
        parts.append(f"x{record['count']}")
    if action == "rescope" and record.get("from"):
        parts.append(f"from {key_label(record['from'])}")
    if record.get("epsilon_alone") is not None:
        label = "carried eps alone" if action == "rescope" else "eps alone"
        parts.append(f"{label} {record['epsilon_alone']:.4g}")
    if record.get("attempt_id"):
        parts.append(f"attempt {record['attempt_id']}")
    if record.get("reason"):
        parts.append(f"reason: {record['reason']}")
    return ", ".join(parts) or "-"


def entry_target(record: Mapping[str, Any]) -> str:
    """The key an entry concerns, ``N subjects`` for a multi-key one (``N keys`` before
    spend classes, when each key was a subject), ``-`` for none."""
    if record.get("key"):
        return key_label(record["key"])
    if record.get("subjects"):
        return f"{record['subjects']:,} subjects"
    if record.get("key_count"):
        return f"{record['key_count']} keys"
    if record.get("window"):
        return f"window {display_window(record['window'])}"
    return "-"


def mechanisms_by_reservation(entries: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Reservation id -> mechanism spec, from the ``reserve`` entries."""
    return {
        entry["reservation_id"]: entry["payload"]["mechanism"]
        for entry in entries
        if entry["action"] == "reserve" and entry.get("reservation_id")
    }


# ---------------------------------------------------------------------- reads the API lacks


def count_accounts(
    ledger: PrivacyBudgetLedger,
    *,
    window: str | None = None,
    tenant: str | None = None,
    sealed: bool = False,
) -> int:
    """How many subjects match (``status`` says how many it did not show): of live
    accounts, and of sealed ones as :meth:`accounts` includes them (a window named, or
    ``sealed``), counted by class: one row read per account."""
    stores = STORES if sealed or window is not None else (LIVE,)
    total = 0
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


KeyParts = tuple[str, str, str, str]


def _parts(key: Mapping[str, str]) -> KeyParts:
    return key["tenant"], key["subject"], key["query_type"], key["window"]


class SubjectNames:
    """The subject behind each class of one that some history entries name.

    Entries name the accounts they charged (``Class-...`` labels); a person reading a
    schedule wants the subject. A charge over one subject in a window is made to an
    account of that subject alone (a class of one, so it names that subject for good),
    and the charge's history entry records the subject's cohort (``cohorts`` in its
    payload, a commit's, reap's or release's in its reservation's ``reserve`` entry); the
    cohort's one member is read from ``dp_cohort_members``. Labels of bigger classes and
    keys of entries written before classes stay as they are.
    """

    def __init__(self, ledger: PrivacyBudgetLedger, entries: Sequence[Mapping[str, Any]]) -> None:
        self._cohorts: dict[str, list[dict[str, Any]]] = {}  # reservation id -> its cohorts
        wanted = set()
        for entry in entries:
            cohorts = entry["payload"].get("cohorts")
            if entry["action"] == "reserve" and cohorts is not None:
                self._cohorts[entry["reservation_id"]] = cohorts
            if cohorts is None and entry.get("reservation_id") and entry["action"] != "reserve":
                wanted.add(entry["reservation_id"])
        with ledger.reading() as connection:
            self._cohorts.update(reserve_cohorts(connection, wanted - self._cohorts.keys()))
            singles = [
                cohort
                for entry in entries
                for cohort in self.cohorts_of(entry)
                if cohort["size"] == 1 and len(cohort["accounts"]) == 1
            ]
            self._names = self._read_names(connection, singles)

    @staticmethod
    def _read_names(connection: Any, singles: Sequence[Mapping[str, Any]]) -> dict[KeyParts, str]:
        by_digest: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
        for cohort in singles:
            by_digest.setdefault((cohort["tenant"], cohort["cohort"]), []).append(cohort)
        names: dict[KeyParts, str] = {}
        digests = sorted(by_digest)
        for chunk in statements.chunks(digests):
            rows = connection.execute(
                select(Cohort.tenant, Cohort.digest, CohortMember.subject)
                .join(CohortMember, CohortMember.cohort_id == Cohort.id)
                .where(tuple_(Cohort.tenant, Cohort.digest).in_(chunk))
            )
            for tenant, digest, subject in rows:
                for cohort in by_digest[(tenant, digest)]:
                    label = cohort["accounts"][0]
                    names[(tenant, label, cohort["query_type"], cohort["window"])] = subject
        return names

    def cohorts_of(self, entry: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The cohorts an entry charged (or reserved, released): its own or its reserve's."""
        cohorts = entry["payload"].get("cohorts")
        if cohorts is None and entry.get("reservation_id"):
            cohorts = self._cohorts.get(entry["reservation_id"])
        return cohorts or []

    def subject_key(self, key: Mapping[str, str] | None) -> Mapping[str, str] | None:
        """``key`` with its subject in place of a class-of-one label (else ``key``)."""
        if key is None:
            return None
        subject = self._names.get(_parts(key))
        return key if subject is None else {**key, "subject": subject}

    def subjects(self, entry: Mapping[str, Any]) -> int | None:
        """How many subjects an entry covered; None when its history does not say (an
        entry made before spend classes, or one that charges nothing)."""
        cohorts = self.cohorts_of(entry)
        return sum(cohort["size"] for cohort in cohorts) if cohorts else None

    def name(self, entry: Mapping[str, Any], record: dict[str, Any]) -> None:
        """Make ``record`` (of ``entry``) name subjects: ``key`` and a rescope's ``from``
        become subject keys where they are a class of one, and ``subjects`` counts the
        subjects the entry covered."""
        record["key"] = self.subject_key(record["key"])
        if record.get("from") is not None:
            record["from"] = self.subject_key(record["from"])
        record["subjects"] = self.subjects(entry)


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
        "privacy_unit": PRIVACY_UNIT,
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


# ---------------------------------------------------------------------- Markdown


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
    return ", ".join(_number(float(order)) for order in orders)


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
        f"statement at delta = {_number(report['delta'])}. A sealed window's classes hold "
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
            f"(epsilon, delta)-DP statement at delta = {_number(report['delta'])} for the "
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
                    _number(a["delta"]),
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
        ["tenant", "query type", "cap epsilon", "warn at", "calendar", "min window", "clause"],
        (
            (
                p["tenant"],
                p["query_type"],
                _eps(p["cap_epsilon"]),
                f"{p['warn_fraction'] * 100:g}%",
                p["calendar"]
                + (f" ({p['calendar_length_seconds']}s)" if p["calendar_length_seconds"] else ""),
                f"{p['min_window_seconds']}s",
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
