"""What the privacy report says one subject's guarantee covers: the privacy unit, and each
scope a cap bounds (a query type's window, a subject's total across query types in a
window, its total across a horizon of windows).

Where no cap bounds a sum, the report says so: a guarantee claimed for a scope no cap
holds would be a false statement about people.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timezone
from typing import Any

from dp_budget_provider.ledger.windows.policy import ANY, SCOPE_ACCOUNTS, Policy

_UNIT = (
    "The privacy unit is the `subject` part of the ledger key (tenant, subject, query_type, "
    "window). Two datasets are neighbouring when they differ in one subject's contributions "
    "within a window: all records of that subject that feed the releases charged to one key. "
    "An account's (epsilon, delta) bounds what the releases charged to that key reveal about "
    "one subject."
)
# The moment a horizon's example period is named by (a report must not depend on the clock).
_EXAMPLE = datetime(2026, 12, 1, tzinfo=timezone.utc)
_RESET = (
    "A reset drops the accounts of a closed window, not the privacy loss those releases caused."
)


def _whose(policy: Policy) -> str:
    return (
        "Every tenant without a cap of its own"
        if policy.tenant == ANY
        else (f"Tenant {policy.tenant!r}")
    )


def scope_statement(policy: Policy) -> str:
    """What a cap across query types or windows bounds, in one sentence or two."""
    windows = policy.calendar.windows.label
    if policy.across == "query_types":
        return (
            f"{_whose(policy)}: each subject's total over all query types in each {windows} "
            f"window is an account of its own (query type `{policy.query_type}`), capped at "
            f"epsilon {policy.cap_epsilon:g}: it bounds what every release charged to the "
            "subject in that window reveals, together, from the moment the cap was set."
        )
    return (
        f"{_whose(policy)}: each subject's total over all query types and all windows of each "
        f"horizon of {policy.horizon_windows} consecutive {windows} windows (query type "
        f"`{policy.query_type}`, a horizon named by its first window, such as "
        f"{policy.calendar.window_of(_EXAMPLE)}) is capped at epsilon "
        f"{policy.cap_epsilon:g}, from the moment the cap was set. Horizons follow each other "
        f"without overlap: any {policy.horizon_windows} consecutive windows lie in at most two "
        "horizons, so their total is at most the composition of those two horizons' totals."
    )


def shares_statement(policy: Policy) -> str:
    """What dividing ``policy``'s cap among principals means for its guarantee."""
    scope = f"query type {policy.query_type}" if policy.query_type != ANY else "every query type"
    parts = ", ".join(
        f"{share.principal} {share.fraction:g} (DAGs {', '.join(share.dags)})"
        for share in policy.shares
    )
    return (
        f"The cap of tenant {policy.tenant}, {scope} is divided among principals: {parts}. "
        f"Each principal's releases are held to its part of the cap's Rényi budget at order "
        f"{policy.filter_order:g}, and the parts add up to at most the whole, so the cap "
        "bounds their sum; what a principal is granted depends only on its own releases "
        "wherever each cap it meets is divided."
    )


def privacy_unit(policies: Iterable[Policy], tenant: str | None = None) -> dict[str, Any]:
    """The report's privacy unit: the statement, and each capped wider scope (of ``tenant``
    when the report is about one), and how divided caps are shared."""
    policies = list(policies)
    divided = [
        policy
        for policy in sorted(policies, key=lambda p: (p.tenant, p.query_type))
        if policy.shares and (tenant is None or policy.tenant in (tenant, ANY))
    ]
    wider = [
        policy
        for policy in sorted(policies, key=lambda p: (p.query_type, p.tenant))
        if policy.query_type in SCOPE_ACCOUNTS
        and (tenant is None or policy.tenant in (tenant, ANY))
    ]
    across_types = any(p.across == "query_types" for p in wider)
    across_windows = any(p.across == "windows" for p in wider)
    if across_types and across_windows:
        unbounded = (
            "Releases charged to the same subject under another tenant, or of a tenant "
            "without the caps above, are accounted in other accounts"
        )
    elif across_types:
        unbounded = (
            "Releases charged to the same subject under another tenant or in another window "
            "(or of a tenant without the cap above) are accounted in other accounts"
        )
    elif across_windows:
        unbounded = (
            "Releases charged to the same subject under another tenant, or in another horizon "
            "(or of a tenant without the cap above), are accounted in other accounts"
        )
    else:
        unbounded = (
            "Releases charged to the same subject under another query type, tenant or window "
            "are accounted in other accounts"
        )
    statement = " ".join(
        [
            _UNIT,
            *(scope_statement(policy) for policy in wider),
            *(shares_statement(policy) for policy in divided),
            f"{unbounded}; their losses compose on top of each other and this report does not "
            "bound that sum.",
            _RESET,
        ]
    )
    return {
        "unit": "subject",
        "statement": statement,
        "capped_scopes": [
            {
                "tenant": policy.tenant,
                "query_type": policy.query_type,
                "across": policy.across,
                "horizon_windows": policy.horizon_windows,
                "calendar": policy.calendar.windows.kind,
                "cap_epsilon": policy.cap_epsilon,
                "statement": scope_statement(policy),
            }
            for policy in wider
        ],
        "divided_caps": [
            {
                "tenant": policy.tenant,
                "query_type": policy.query_type,
                "filter_order": policy.filter_order,
                "shares": [share.as_record() for share in policy.shares],
                "statement": shares_statement(policy),
            }
            for policy in divided
        ],
    }
