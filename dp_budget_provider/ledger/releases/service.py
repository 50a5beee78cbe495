"""The release service: one release through a :class:`ReleaseGate`, from its declaration
to a named outcome, without Airflow.

``make_release`` plans the mechanism (a declared one, or the least noise with which the
release alone fits its target), reserves its cost on the keys, runs the caller's query
under the reservation's lease (``keep_alive``), puts the exact answer through the declared
rule and adds the noise once, and commits. It raises nothing about the release itself;
it returns a :class:`ReleaseOutcome` whose :class:`ReleaseResult` names what happened,
one code per outcome (as TigerBeetle's result codes name theirs):

==========  =============================================================================
released    the query ran, the noise was added, the commit charged it: ``value`` and
            ``receipt``
invalid     the declaration cannot be released here (bad keys or windows, a release no
            noise fits): nothing ran, nothing was written; the same on every attempt
refused     the gate refused the reservation (``refusal``, one uniform message and a
            sealed reference): nothing ran, nothing was written
failed      the query or the noise raised after the reservation (``error``, whatever it
            was, a timeout included): the data was touched, so the attempt is charged
            (``receipt``) and nothing is released
withheld    the commit was refused (``refusal``: the ledger was quarantined meanwhile): no
            value; the reservation stays open and the reap charges it
reused      the release was made before (same identity: :mod:`identity`): ``value`` is its
            stored answer and ``receipt`` its receipt, marked reused; nothing ran, nothing
            was charged, the history records the reuse
==========  =============================================================================

A release made at a :class:`ReleaseSlot` (the operators give the task's) has an identity,
decided before the data is read: if that identity has a stored answer it is handed out
again (``reused``), unless ``refresh=True``, which makes a new release, charged in full,
whose answer then replaces the stored one. A released answer is kept with its commit.

What the caller does with an outcome (exceptions, XCom, metrics) is the caller's; the
service only logs its own steps (the resolved noise, the reservation, its lease).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from dp_budget_provider.accounting import (
    GaussianMechanism,
    Mechanism,
    plan_noise_multiplier_where,
)
from dp_budget_provider.accounting import validation as check
from dp_budget_provider.accounting.answer_rule import AnswerRule
from dp_budget_provider.accounting.release import NoiseKind, NoisePlan, plan_noise
from dp_budget_provider.ledger.accounts.classes import subjects_in
from dp_budget_provider.ledger.accounts.covered import Covered
from dp_budget_provider.ledger.gate import (
    GrantedRelease,
    ReleaseGate,
    ReleaseReceipt,
    ReleaseRefused,
)
from dp_budget_provider.ledger.releases.filtering import ContributionTable
from dp_budget_provider.ledger.releases.identity import ReleaseIdentity, ReleaseSlot
from dp_budget_provider.ledger.releases.stored import MAX_STORED_BYTES


class ReleaseResult(enum.Enum):
    """How a release ended (see the module docstring)."""

    released = "released"
    invalid = "invalid"
    refused = "refused"
    failed = "failed"
    withheld = "withheld"
    reused = "reused"


@dataclass(frozen=True)
class DeclaredRelease:
    """A release as its author declared it: the mechanism (or its spec; a Gaussian spec may
    say ``"noise_multiplier": "auto"``), its scope, and how the answer is noised.

    Checked when made (ValueError), so that a bad spec, sensitivity or granularity is
    found before any run.
    """

    mechanism: Mechanism | Mapping[str, Any]
    tenant: str
    query_type: str
    count: int = 1
    noise: NoiseKind = "lattice"
    l2_sensitivity: float | None = None
    l1_sensitivity: float | None = None
    granularity: float | None = None
    rule: AnswerRule = field(default_factory=AnswerRule)
    target_epsilon: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mechanism, Mechanism):
            object.__setattr__(self, "mechanism", dict(self.mechanism))
        if self.auto and self.l2_sensitivity is None:
            raise ValueError(
                'noise_multiplier="auto" is for Gaussian releases: give l2_sensitivity'
            )
        self.plan(GaussianMechanism(1.0) if self.auto else self.fixed_mechanism())

    @property
    def auto(self) -> bool:
        """Whether the noise is resolved at run time (``"noise_multiplier": "auto"``)."""
        return (
            isinstance(self.mechanism, dict)
            and self.mechanism.get("kind") == GaussianMechanism.kind
            and self.mechanism.get("noise_multiplier") == "auto"
        )

    def plan(self, mechanism: Mechanism) -> NoisePlan:
        """The noise ``mechanism`` adds at the declared sensitivity, and what it is charged
        as (ValueError if it cannot be added as declared)."""
        return plan_noise(
            mechanism,
            noise=self.noise,
            l2_sensitivity=self.l2_sensitivity,
            l1_sensitivity=self.l1_sensitivity,
            granularity=self.granularity,
            rule=self.rule,
        )

    def identity_part(self, plan: NoisePlan) -> dict[str, Any]:
        """What the release is, as its identity names it (:mod:`identity`): the scope, the
        mechanism declared and the one charged, and how the answer is noised."""
        declared, bounds = self.mechanism, self.rule.bounds

        def number(value: Any) -> float | None:  # numpy's numbers too, as JSON holds them
            return None if value is None else float(value)

        return {
            "tenant": self.tenant,
            "query_type": self.query_type,
            "declared": declared.to_spec() if isinstance(declared, Mechanism) else declared,
            "mechanism": plan.charged.to_spec(),
            "count": int(self.count),
            "noise": self.noise,
            "granularity": plan.granularity,
            "l2_sensitivity": number(self.l2_sensitivity),
            "l1_sensitivity": number(self.l1_sensitivity),
            "rule": {
                "nan_value": number(self.rule.nan_value),
                "bounds": None if bounds is None else [number(b) for b in bounds],
                "cells": int(self.rule.cells),
                "integer": bool(self.rule.integer),
            },
            "target_epsilon": number(self.target_epsilon),
        }

    def fixed_mechanism(self) -> Mechanism:
        """The declared mechanism (not ``auto``)."""
        if isinstance(self.mechanism, Mechanism):
            return self.mechanism
        return Mechanism.from_spec(self.mechanism)

    def mechanism_on(
        self, gate: ReleaseGate, log: logging.Logger | logging.LoggerAdapter[Any]
    ) -> Mechanism:
        """The mechanism to release with: the declared one, or for ``auto`` the least noise
        with which the release alone costs at most its target (the cap the gate's DAG is
        held to by default: its share's where the cap is divided, else the scope's) and
        fits that cap as its check counts it (at its filter order: noise planned on the
        reported epsilon alone could be refused by the filter on an empty account).
        Planned on nothing spent, so the choice tells nothing about anyone."""
        if not self.auto:
            return self.fixed_mechanism()
        policy = gate.policy_for_release(self.tenant, self.query_type)
        target = min(policy.cap_epsilon, self.target_epsilon or policy.cap_epsilon)
        target = check.positive("target_epsilon", target)

        def fits(noise_multiplier: float) -> bool:
            charged = self.plan(GaussianMechanism(noise_multiplier)).charged
            return gate.cost_alone(charged, self.count) <= target and policy.admits(
                gate.checked_alone(policy, charged, self.count)
            )

        needed = plan_noise_multiplier_where(
            fits, f"{self.count} release(s) within eps={target} at delta={gate.delta}"
        )
        log.info("noise_multiplier='auto' resolved to %.6g (target eps %g)", needed, target)
        return GaussianMechanism(needed)


@dataclass(frozen=True)
class ReleaseOutcome:
    """What became of one release (see :class:`ReleaseResult`).

    ``plan`` is the noise planned and charged (None when ``invalid`` before planning);
    ``keys``, of a refused release, how many (subject, window) pairs it covers.
    """

    result: ReleaseResult
    plan: NoisePlan | None = None
    keys: int | None = None
    value: Any = None
    receipt: ReleaseReceipt | None = None
    refusal: ReleaseRefused | None = None
    error: BaseException | None = None

    @property
    def summary(self) -> dict[str, Any] | None:
        """The outcome as plain JSON values, for the task that made it: a charged release's
        receipt and granularity (``released``, ``failed``), or a refusal's mechanism, keys
        and sealed reference (``refused``); None otherwise."""
        if self.receipt is not None and self.plan is not None:
            return {**self.receipt.as_dict(), "granularity": self.plan.granularity}
        if self.result is ReleaseResult.refused and self.plan is not None:
            return {
                "refused": True,
                "mechanism": self.plan.charged.to_spec(),
                "keys": self.keys,
                "reference": self.refusal.reference if self.refusal else None,
            }
        return None


def make_release(
    gate: ReleaseGate,
    declared: DeclaredRelease,
    keys: Covered,
    compute: Callable[[], Any] | ContributionTable,
    *,
    attempt: str,
    log: logging.Logger | logging.LoggerAdapter[Any],
    slot: ReleaseSlot | None = None,
    refresh: bool = False,
) -> ReleaseOutcome:
    """Reserve ``declared`` on ``keys`` (a list, read twice on a refusal) as ``attempt``,
    run ``compute`` (the exact, clipped answer), add the noise and commit; the outcome
    says which of these happened.

    ``compute`` a :class:`ContributionTable` (what each unit contributes, read before;
    ``keys``: the units' registered cohort in each window) makes the release *filtered*:
    the subjects that cannot afford it are left out of the reservation, the table is
    totalled without them and noised here, and nothing in the outcome says who or how
    many. A table whose units move the answer by more than the declared sensitivity is
    invalid before anything is reserved.

    Once ``compute`` has started the attempt is charged whatever happens next (the commit
    runs on success and on any failure alike), and the noise is added at most once.
    Made at ``slot``, a release made before is handed its stored answer instead (unless
    ``refresh``), and a released answer is kept for the next run.
    """
    try:
        mechanism = declared.mechanism_on(gate, log)
    except ValueError as error:  # a release no noise fits: the same on every attempt
        return ReleaseOutcome(ReleaseResult.invalid, error=error)
    plan = declared.plan(mechanism)
    table = compute if isinstance(compute, ContributionTable) else None
    if table is not None:
        try:
            if type(table) is not ContributionTable:  # its totals are the service's own
                raise ValueError("a filtered release's table is a ContributionTable itself")
            # The service's own copy: the caller's arrays (and the log it hands in, called
            # before the totals) must not change what was checked into what is released.
            table = replace(table)
            table.check_moves(declared.l1_sensitivity, declared.l2_sensitivity)
        except ValueError as error:
            return ReleaseOutcome(ReleaseResult.invalid, plan, error=error)
    identity = None
    if slot is not None:
        try:
            identity = ReleaseIdentity.of(slot, declared.identity_part(plan), keys)
            gate.own(identity)  # another DAG's release: refused, refresh or not
        except (ValueError, TypeError) as error:  # bad keys, a declaration JSON cannot hold
            return ReleaseOutcome(ReleaseResult.invalid, plan, error=error)
        if refresh:
            log.info(
                "refresh=True: release %s is made again, charged in full; its answer replaces "
                "the stored one",
                identity.digest,
            )
        else:
            reused = _reused(gate, identity, plan, keys, attempt, log)
            if reused is not None:
                return reused
    try:
        reserve = gate.reserve if table is None else gate._reserve_filtering
        granted = reserve(keys, plan.charged, declared.count, attempt=attempt)
    except ValueError as error:  # bad keys or windows
        return ReleaseOutcome(ReleaseResult.invalid, plan, error=error)
    except ReleaseRefused as refusal:
        return ReleaseOutcome(ReleaseResult.refused, plan, subjects_in(keys), refusal=refusal)
    log.info(
        "reserved %s on %d subject(s) (reservation %s); its lease (until %s) is renewed "
        "while the query runs",
        plan.charged.to_spec(),
        granted.subjects,
        granted.id,
        granted.lease_expires_at,
    )
    try:
        with gate.keep_alive(granted, log):
            if table is not None:
                value = plan.add_noise(table.totals(granted._left_out or frozenset()))
            else:
                value = plan.add_noise(compute())  # type: ignore[operator]
    except BaseException as error:
        # The data was touched: charged whatever ended the attempt (a timeout included),
        # and the receipt says so. Committed inside the handler, so that an error of the
        # commit itself keeps this one as its context.
        return _charged(gate, granted, plan, ReleaseResult.failed, error=error)
    keep = None if identity is None else (identity, value)
    outcome = _charged(gate, granted, plan, ReleaseResult.released, value=value, keep=keep)
    if outcome.receipt is not None and outcome.receipt.stored is False:
        log.warning(
            "the answer is larger than the %d bytes a ledger keeps for re-runs: it is not "
            "kept, so a re-run of this release is a new release, charged again",
            MAX_STORED_BYTES,
        )
    return outcome


def _reused(
    gate: ReleaseGate,
    identity: ReleaseIdentity,
    plan: NoisePlan,
    keys: Covered,
    attempt: str,
    log: logging.Logger | logging.LoggerAdapter[Any],
) -> ReleaseOutcome | None:
    """The outcome of handing out ``identity``'s stored answer (or of the gate refusing
    to), None when it has none. Decided by the identity alone, never by the data."""
    try:
        found = gate.reuse(identity, attempt=attempt)
    except ValueError as error:  # an identity of another DAG
        return ReleaseOutcome(ReleaseResult.invalid, plan, error=error)
    except ReleaseRefused as refusal:
        return ReleaseOutcome(ReleaseResult.refused, plan, subjects_in(keys), refusal=refusal)
    if found is None:
        return None
    log.info(
        "release %s was made before (reservation %s): its stored answer is handed out again, "
        "charging nothing (refresh=True makes a new release, charged in full)",
        identity.digest,
        found.receipt.reservation_id,
    )
    return ReleaseOutcome(ReleaseResult.reused, plan, value=found.value, receipt=found.receipt)


def _charged(
    gate: ReleaseGate,
    granted: GrantedRelease,
    plan: NoisePlan,
    result: ReleaseResult,
    *,
    value: Any = None,
    error: BaseException | None = None,
    keep: tuple[ReleaseIdentity, Any] | None = None,
) -> ReleaseOutcome:
    """Commit a release whose data was touched: ``result``, or ``withheld`` if the gate
    refuses the commit (quarantined meanwhile: the reservation stays open and is charged
    when reaped). ``keep``: its identity and answer, kept for re-runs."""
    try:
        receipt = gate.commit(granted, keep)
    except ReleaseRefused as refusal:
        return ReleaseOutcome(ReleaseResult.withheld, plan, refusal=refusal)
    return ReleaseOutcome(result, plan, value=value, receipt=receipt, error=error)
