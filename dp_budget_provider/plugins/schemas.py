"""The JSON API's response models (they are what ``/dp-budget/openapi.json`` documents)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dp_budget_provider.ledger import Share


class KeyModel(BaseModel):
    """A ledger key, canonical (NFKC, casefolded, trimmed)."""

    tenant: str
    subject: str
    query_type: str
    window: str


class AccountModel(KeyModel):
    """One subject of a live account: the account's committed spend (its class's)
    converted at the ledger's delta, against its cap."""

    epsilon: float = Field(description="cumulative epsilon of the committed releases")
    delta: float = Field(description="the ledger-wide delta every epsilon is stated at")
    cap_epsilon: float
    remaining: float = Field(description="cap minus epsilon, never negative")
    fraction: float = Field(description="epsilon / cap")
    held_epsilon: float = Field(
        description="epsilon with every open reservation charged too (committed + pending)"
    )
    remaining_after_held: float = Field(
        description="cap minus held_epsilon, never negative: what a new release can still get"
    )
    state: str = Field(
        description="ok, WARNING (held_epsilon past the warn fraction) or EXHAUSTED (held "
        "epsilon at the cap, or the cheapest release this tenant and query type has reserved "
        "no longer fits on it)"
    )
    warned: bool
    exhausted: bool
    releases: int
    open_reservations: int
    method: str = Field(description="which bound gave epsilon (rdp-improved, analytic-gaussian…)")
    updated_at: str
    account: str | None = Field(
        description="the label of the account (spend class) holding the subject's spend; "
        "null on a spend class's row"
    )
    subjects: int = Field(description="how many subjects share that spend (the class's size)")
    page_url: str = Field(description="the account's page in the UI")


class AccountsPage(BaseModel):
    """One page of the accounts matching a filter; ``total`` counts every match."""

    total: int
    offset: int
    limit: int
    sort: str
    order: str
    accounts: list[AccountModel]


class SpendClassModel(BaseModel):
    """Subjects of one window holding the same spend: one row for a whole cohort."""

    id: str = Field(description="names the class while no release changes its members' spend")
    subjects: int = Field(description="members (those matching a subject filter, if given)")
    account: AccountModel = Field(
        description="the status of its least subject: every member's but for the key"
    )
    members_url: str = Field(description="the API page of its members")


class ClassesPage(BaseModel):
    """One page of the spend classes matching a filter; ``total`` counts every class."""

    total: int
    offset: int
    limit: int
    classes: list[SpendClassModel]


class ShareModel(BaseModel):
    """One principal's share of a scope's cap."""

    principal: str
    fraction: float = Field(description="part of the scope's Rényi budget at its filter order")
    dags: list[str] = Field(description="the DAG ids whose releases are the principal's")
    cap_epsilon: float | None = Field(
        None, description="the share's cap at the scope's filter order (computed when set)"
    )


class PolicyModel(BaseModel):
    """The cap of one (tenant, query type) scope, ``*`` meaning any."""

    tenant: str
    query_type: str
    cap_epsilon: float
    warn_fraction: float
    calendar: str
    calendar_length_seconds: int | None
    min_window_seconds: int
    compliance_clause: str
    grace_seconds: int
    calendar_span: int = Field(1, description="windows per period: a horizon's (across windows)")
    filter_order: float | None = Field(
        None,
        description="the Rényi order the cap is checked at (a privacy filter); null: "
        "on the reported epsilon (not a filter under adaptive releases)",
    )
    shares: list[ShareModel] = Field(
        default_factory=list, description="the cap divided among principals (empty: undivided)"
    )


class SeriesPointModel(BaseModel):
    """The account's cumulative epsilon right after history entry ``seq``."""

    seq: int
    at: str
    action: str
    epsilon: float


class SeriesModel(BaseModel):
    """The key's lifetime epsilon over time: ``points`` samples ``events`` evenly when there
    are many, and always has every closing (action ``reset`` or ``rescope-away``, a point at
    the level reached: closing an account refunds nothing)."""

    events: int
    points: list[SeriesPointModel]


class ReservationModel(BaseModel):
    """A reservation holding the key: open until committed, released or reaped."""

    id: str
    attempt_id: str = Field(description="dag_id/task_id/run_id/map_index/try_number")
    state: str
    mechanism: dict[str, Any]
    count: int
    key_count: int = Field(description="how many accounts (spend classes) it holds")
    subjects: int = Field(description="how many subjects it covers")
    cost_epsilon: float = Field(description="epsilon of this release's cost on its own")
    prospective_epsilon: float
    actor: str
    created_at: str
    resolved_at: str | None


class ReservationsPage(BaseModel):
    total: int
    offset: int
    limit: int
    reservations: list[ReservationModel]


class ReleaseModel(BaseModel):
    """One release: its reservation, the windows it charged, a page of the accounts it
    held (a subject's, or a spend class's covering many subjects)."""

    reservation: ReservationModel
    windows: list[str]
    total: int = Field(description="how many accounts it held")
    offset: int
    limit: int
    accounts: list[KeyModel]


class HistoryEntryModel(BaseModel):
    """One append-only, hash-chained history entry concerning the key."""

    seq: int
    at: str
    action: str
    actor: str
    reservation_id: str | None
    key: KeyModel | None = Field(
        description="the account the entry charged (a spend class, or the subject's key "
        "when its class holds it alone); null for an entry over many accounts"
    )
    key_count: int = Field(description="how many accounts (spend classes) the entry names")
    subjects: int | None = Field(
        description="how many subjects the entry covered; null for entries made before "
        "spend classes (their keys are subjects) and those covering none"
    )
    attempt_id: str | None
    mechanism: dict[str, Any] | None
    count: int | None
    cost_epsilon: float | None = Field(description="epsilon of the entry's cost on its own")
    note: str | None
    payload: dict[str, Any]
    hash: str


class HistoryPage(BaseModel):
    total: int
    offset: int
    limit: int
    entries: list[HistoryEntryModel]


class VerificationModel(BaseModel):
    """Outcome of the ledger's audit (hash chain, reservation key sets, replay)."""

    ok: bool
    entries: int | None
    accounts: int | None
    problems: list[str]
    head_seq: int = Field(description="the last history entry the check covered")
    checked_at: str


class AccountDetail(BaseModel):
    """An account with what its page shows besides the paginated history."""

    key: KeyModel
    account: AccountModel | None = Field(description="null when the key has no live account")
    policy: PolicyModel
    series: SeriesModel
    open_reservations: list[ReservationModel]
    totals: list[AccountModel] = Field(
        description="the subject's totals across query types and across the windows of a "
        "horizon over this window, where a cap keeps them"
    )


# ---------------------------------------------------------------------- administrator's acts


class PolicyChangeModel(BaseModel):
    """A change of one scope's policy (``dp-budget policy set``): what is left out keeps
    the scope's current value, or a new scope's default; a new scope needs its cap."""

    model_config = ConfigDict(extra="forbid")

    tenant: str = Field("*", description="'*' (any) by default")
    query_type: str = Field("*", description="'*' (any) by default")
    cap_epsilon: float | None = Field(None, description="cap per account (needed for a new scope)")
    warn_fraction: float | None = Field(None, description="fraction of the cap that warns")
    calendar: Literal["iso_week", "month", "day", "fixed"] | None = Field(
        None, description="how the scope's windows are cut; a charged scope keeps its calendar"
    )
    length_seconds: int | None = Field(None, description="window length of a fixed calendar")
    min_window_seconds: int | None = Field(None, description="shortest window allowed")
    grace_seconds: int | None = Field(
        None, description="how long after a window ends late runs may still charge it"
    )
    compliance_clause: str | None = Field(None, description="the clause the cap implements")
    across: Literal["query_types", "windows"] | None = Field(
        None,
        description="a cap on each subject's total across the tenant's query types in a "
        "window, or across the windows of a horizon (then no query_type)",
    )
    horizon_windows: int | None = Field(
        None, description="with across='windows': how many consecutive windows a horizon spans"
    )
    filter_order: Literal["auto", "reported"] | float | None = Field(
        None,
        description="check the cap at this one Rényi order, a privacy filter ('auto': the "
        "cap's own); 'reported': on the reported epsilon, not a filter; left out, 'auto': a "
        "charged scope keeps how its cap is checked, an uncharged one takes its cap's order",
    )
    shares: list[ShareModel] | None = Field(
        None,
        description="divide the cap among principals (replacing the scope's shares; [] "
        "undivides it); a form gives 'PRINCIPAL=FRACTION:DAG,DAG; ...' or 'none'",
    )

    @field_validator("shares", mode="before")
    @classmethod
    def _shares_of_text(cls, value: Any) -> Any:
        """A form's text: shares separated by ';', or 'none'."""
        if not isinstance(value, str):
            return value
        if value.strip().lower() == "none":
            return []
        return [Share.parse(part).as_record() for part in value.split(";") if part.strip()]


class PolicySetModel(BaseModel):
    """The policy as set, and who set it (the actor its history entry names)."""

    policy: PolicyModel
    created: bool = Field(description="the scope had no policy before")
    actor: str


class QuarantineClearModel(BaseModel):
    """Why releases may run again: what the investigation found."""

    model_config = ConfigDict(extra="forbid")

    reason: str = Field(min_length=1, max_length=2000)


class QuarantineClearedModel(BaseModel):
    """The quarantine lifted, and by whom."""

    actor: str
    reason: str
    quarantined_at: str
    quarantine_reason: str


class RefusalReferenceModel(BaseModel):
    """A refusal reference, as a task logged it (``dpb-ref-1.…``)."""

    model_config = ConfigDict(extra="forbid")

    reference: str = Field(min_length=1, max_length=8192)


class RefusalModel(BaseModel):
    """What a refusal reference seals: the refusal's kind, its reason and, for a cap, the
    account, the eps the release would have brought it to and the cap."""

    facts: dict[str, Any]
    account_url: str | None = Field(description="the account's page, where the facts name one")
