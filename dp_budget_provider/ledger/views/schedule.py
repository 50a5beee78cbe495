"""The release schedule: history entries as rows that people and programs read.

The history stores what each act did in the ledger's terms: the account label a charge
went to, a cost as stored RDP spend, a commit that refers to its reservation for the
mechanism. A schedule row says it as a reader wants it: the mechanism of every charge
(:func:`mechanisms_by_reservation`), the epsilon of its cost on its own
(:class:`EpsilonAlone`), the subject behind a class of one and how many subjects an entry
covered (:class:`SubjectNames`), and one line of what happened (:func:`entry_summary`,
:func:`entry_target`). The CLI's ``history`` and ``show`` and the privacy report's schedule
print these rows (:func:`entry_record`); the UI's history tables are made of their parts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from sqlalchemy import select, tuple_

from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.accounts.spend import Spend
from dp_budget_provider.ledger.ledger import PrivacyBudgetLedger
from dp_budget_provider.ledger.storage import statements
from dp_budget_provider.ledger.storage.schema import Cohort, CohortMember
from dp_budget_provider.ledger.views.release_pages import reserve_cohorts
from dp_budget_provider.ledger.windows.calendar import display_window


def number_text(value: Any) -> str:
    """A number as the schedule and the report write it (a float in its shortest form)."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def describe_mechanism(spec: Mapping[str, Any] | None) -> str:
    """``gaussian(noise_multiplier=4)``: kind and parameters in one token."""
    if not spec:
        return "-"
    params = ", ".join(f"{k}={number_text(v)}" for k, v in sorted(spec.items()) if k != "kind")
    return f"{spec.get('kind', '?')}({params})"


def key_label(key: Mapping[str, str] | LedgerKey | None) -> str:
    """``tenant/subject/query_type/window``, the window as people read it."""
    if key is None:
        return "-"
    if isinstance(key, LedgerKey):
        key = key.as_dict()
    return f"{key['tenant']}/{key['subject']}/{key['query_type']}/{display_window(key['window'])}"


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
            f"ledger created: delta {number_text(settings.get('delta'))}, "
            f"{settings.get('conversion')} conversion, {len(settings.get('orders', []))} orders"
        )
    if action == "policy":
        clause = settings.get("compliance_clause") or ""
        text = (
            f"policy {settings.get('tenant')}/{settings.get('query_type')}: cap "
            f"{number_text(settings.get('cap_epsilon'))}, "
            f"warn {number_text(settings.get('warn_fraction'))}"
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
