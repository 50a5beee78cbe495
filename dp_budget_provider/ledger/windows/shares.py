"""Shares of a cap: a scope's budget divided among named principals (teams, pipelines).

A cap that many DAGs draw on tells each of them something about the others: a release is
granted or refused by what every DAG has charged to the same subjects, so a DAG that
knows its own subjects can learn whether another DAG released over them. A policy with
``shares`` divides its scope's budget among *principals*, each named with the DAG ids
that act for it: every release is also charged to its principal's *share account* of
each shared scope, ``(tenant, subject, "*share:<principal>:<scope>", window)``, checked
against the principal's part of the cap. What a principal is granted, refused or told
(:class:`~dp_budget_provider.ledger.gate.ReleaseGate`) then depends only on its own
releases at every shared scope.

Shares are parts of one Rényi budget, not of an epsilon: epsilons do not add up under
composition, Rényi divergences at one order do. So a policy with shares is a privacy
filter (its ``filter_order`` fixed): at order ``a`` with conversion term ``c(a)`` the
scope's budget is ``B = cap - c(a)``, and a share of fraction ``f`` may hold
``f * B * (1 - SHARE_MARGIN)``, i.e. its cap is ``c(a) + f * B * (1 - SHARE_MARGIN)``.
Fractions add up to at most 1, so the shares' curves at ``a`` add up to at most ``B``
along every history, and the scope's total converts to at most its cap: each principal's
releases form a Rényi filter (Feldman and Zrnic 2021), and so does their sum. The margin
(one millionth of the budget) absorbs floating-point error in ``c(a)`` and in summed
spend, so the scope's own account (still charged and checked, as a second line) never
refuses a release its shares grant.

The principal of a release is its DAG's: the DAG id is the first part of the release's
attempt id as the operators write it (``dag_id/task_id/run_id/...``), looked up in the
administrator-signed policy; a DAG no share names is refused at a shared scope. The
mapping is the administrator's, never a DAG argument. Task code holds the worker's
ledger connection and could write another attempt id: shares then still bound the scope
(the caps never depend on who is named), but which share pays is only as sound as the
attempt ids the operators write (see docs/ledger.md).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

# The part of a scope's Rényi budget no share may use (see the module docstring).
SHARE_MARGIN = 1e-6
# The smallest share: below it a share's budget nears the conversion's tiny-curve
# shortcut and rounding, and is no budget a team could release with anyway.
MIN_FRACTION = 1e-3
# How far above 1 the floats of fractions that add up to 1 as decimals may sum.
_ROUNDING = Fraction(1, 10**12)
SHARE_PREFIX = "*share:"
_PRINCIPAL = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
# Airflow's own rule for DAG ids (KEY_REGEX), with its length limit.
_DAG_ID = re.compile(r"[A-Za-z0-9_.-]{1,250}")


@dataclass(frozen=True)
class Share:
    """One principal's part of a scope's cap.

    ``fraction`` of the scope's Rényi budget at its filter order; ``dags`` the DAG ids
    whose releases are the principal's; ``cap_epsilon`` the share's cap at that order,
    which setting the policy computes (None until then).
    """

    principal: str
    fraction: float
    dags: tuple[str, ...]
    cap_epsilon: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.principal, str) or not _PRINCIPAL.fullmatch(self.principal):
            raise ValueError(
                "a share's principal is a name of lower-case letters, digits, '_', '.' and "
                f"'-' (at most 64), got {self.principal!r}"
            )
        fraction = self.fraction
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, int | float)
            or not MIN_FRACTION <= float(fraction) <= 1.0
        ):
            raise ValueError(
                f"the share of {self.principal!r} must be a fraction in [{MIN_FRACTION:g}, 1], "
                f"got {fraction!r}"
            )
        object.__setattr__(self, "fraction", float(fraction))
        dags = tuple(self.dags) if not isinstance(self.dags, str) else (self.dags,)
        if not dags:
            raise ValueError(f"the share of {self.principal!r} names no DAG")
        for dag in dags:
            if not isinstance(dag, str) or not _DAG_ID.fullmatch(dag):
                raise ValueError(f"the share of {self.principal!r} names {dag!r}, not a DAG id")
        if len(set(dags)) != len(dags):
            raise ValueError(f"the share of {self.principal!r} names a DAG twice")
        object.__setattr__(self, "dags", tuple(sorted(dags)))
        cap = self.cap_epsilon
        if cap is not None and (
            isinstance(cap, bool) or not isinstance(cap, int | float) or not math.isfinite(cap)
        ):
            raise ValueError(f"the share of {self.principal!r} has cap {cap!r}")
        if cap is not None:
            object.__setattr__(self, "cap_epsilon", float(cap))

    def as_record(self) -> dict[str, Any]:
        """The share as plain JSON values (part of its policy's signed record)."""
        return {
            "principal": self.principal,
            "fraction": self.fraction,
            "dags": list(self.dags),
            "cap_epsilon": self.cap_epsilon,
        }

    @classmethod
    def parse(cls, text: str) -> Share:
        """A share as an administrator writes it: ``PRINCIPAL=FRACTION:DAG[,DAG...]``
        (``dp-budget policy set --share``, the UI's form)."""
        principal, equals, rest = text.partition("=")
        part, colon, dags = rest.partition(":")
        if not equals or not colon:
            raise ValueError(
                "a share is PRINCIPAL=FRACTION:DAG[,DAG...] (e.g. analytics=0.5:etl_a,etl_b), "
                f"got {text!r}"
            )
        try:
            fraction = float(part)
        except ValueError:
            raise ValueError(f"the share of {principal.strip()!r} has fraction {part!r}") from None
        return cls(principal.strip(), fraction, tuple(dag.strip() for dag in dags.split(",")))

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Share:
        """A share from :meth:`as_record`'s values."""
        if not isinstance(record, Mapping) or set(record) != {
            "principal",
            "fraction",
            "dags",
            "cap_epsilon",
        }:
            raise ValueError(f"not a share: {record!r}")
        dags = record["dags"]
        if not isinstance(dags, list):
            raise ValueError(f"not a share's DAG list: {dags!r}")
        return cls(record["principal"], record["fraction"], tuple(dags), record["cap_epsilon"])


def checked_shares(shares: Iterable[Share], filter_order: object, cap: float) -> tuple[Share, ...]:
    """``shares`` as a policy holds them (by principal), or ValueError: distinct
    principals, each DAG in one share, fractions adding up to at most 1 (as decimals do:
    0.1 and 0.9 are accepted although their floats add up to a hair above 1; the margin
    of every share's cap absorbs far more, and verify proves the caps' sum), a filter
    order (shares are parts of a Rényi budget at one order), and caps either all
    computed (at most the scope's) or none."""
    found = tuple(sorted(shares, key=lambda share: share.principal))
    if not found:
        return ()
    if not all(isinstance(share, Share) for share in found):
        raise ValueError("shares must be Share values")
    if filter_order is None:
        raise ValueError(
            "shares divide a Rényi budget at one order: a cap checked on the reported "
            "epsilon (filter_order='reported', or a scope charged so) cannot be divided"
        )
    principals = [share.principal for share in found]
    if len(set(principals)) != len(principals):
        raise ValueError("two shares name the same principal")
    dags = [dag for share in found for dag in share.dags]
    if len(set(dags)) != len(dags):
        raise ValueError("a DAG is named by two shares: a release has one principal")
    if sum((Fraction(share.fraction) for share in found), Fraction(0)) > 1 + _ROUNDING:
        raise ValueError(
            f"the shares add up to {sum(share.fraction for share in found):g} of the cap; "
            "they may add up to at most 1"
        )
    computed = {share.cap_epsilon is not None for share in found}
    if len(computed) > 1:
        raise ValueError("either every share's cap is computed or none is")
    if any(share.cap_epsilon is not None and share.cap_epsilon > cap for share in found):
        raise ValueError("a share's cap is above its scope's")
    return found


def share_caps(shares: Sequence[Share], cap: float, term: float) -> tuple[Share, ...]:
    """``shares`` with their caps at an order whose conversion term is ``term``: the
    share of fraction ``f`` may hold ``f * (cap - term) * (1 - SHARE_MARGIN)`` in Rényi
    divergence at that order."""
    budget = cap - term
    if not budget > 0.0:
        raise ValueError(
            f"a cap of {cap:g} leaves no Rényi budget at its filter order (its conversion "
            f"alone costs {term:g}): shares need a larger cap or another order"
        )
    return tuple(
        Share(
            share.principal,
            share.fraction,
            share.dags,
            term + share.fraction * budget * (1.0 - SHARE_MARGIN),
        )
        for share in shares
    )


def shares_sound(shares: Sequence[Share], cap: float, term: float) -> bool:
    """Whether ``shares``' caps add up, at a conversion term ``term``, to at most the
    scope's budget with the margin kept (exact rational arithmetic on the stored values):
    verify's proof that a set of shares bounds its scope."""
    budget = Fraction(cap) - Fraction(term)
    used = sum((Fraction(share.cap_epsilon) - Fraction(term) for share in shares), Fraction(0))
    return all(share.cap_epsilon is not None for share in shares) and used <= budget * (
        1 - Fraction(SHARE_MARGIN) / 2
    )


def share_query_type(principal: str, scope_query_type: str) -> str:
    """The query type of ``principal``'s share accounts of a scope."""
    return f"{SHARE_PREFIX}{principal}:{scope_query_type}"


def parse_share(query_type: str) -> tuple[str, str] | None:
    """(principal, scope query type) of a share account's query type, else None."""
    if not query_type.startswith(SHARE_PREFIX):
        return None
    principal, _, scope = query_type[len(SHARE_PREFIX) :].partition(":")
    return (principal, scope) if principal and scope else None


def dag_of(attempt: str | None) -> str | None:
    """The DAG id of a release's attempt id (``dag_id/task_id/...``, as the operators
    write it); None for an attempt that names no DAG."""
    if not attempt or "/" not in attempt:
        return None
    dag = attempt.split("/", 1)[0]
    return dag if _DAG_ID.fullmatch(dag) else None


def principal_of(shares: Sequence[Share], dag: str | None) -> Share | None:
    """The share whose DAGs include ``dag``, if any."""
    if dag is None:
        return None
    return next((share for share in shares if dag in share.dags), None)
