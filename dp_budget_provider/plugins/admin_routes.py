"""The administrator's routes: a JSON API under ``/api/admin`` and the pages' forms.

| route | does |
|---|---|
| ``PUT /api/admin/policy`` | set a policy (:class:`~.schemas.PolicyChangeModel`) |
| ``POST /api/admin/quarantine/clear`` | clear the quarantine (``{"reason": ...}``) |
| ``POST /api/admin/refusal`` | open a refusal reference (``{"reference": "dpb-ref-1..."}``) |
| ``POST /admin/policy`` | the policies page's form |
| ``POST /admin/quarantine/clear`` | the quarantine banner's form |
| ``GET``/``POST /admin/refusal`` | the refusal page and its form |

Every one needs a reader of the view (the app's dependency) who may administer
(:func:`.auth.budget_admin`: 403 otherwise, before anything is read or written), and a
request that is not forged by another site (:mod:`.csrf`: forms carry the token, scripts
using the cookie send it as a header, Bearer-token calls need none). The acts are
:mod:`.admin`'s; the history names the acting Airflow user.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import HTMLResponse
from pydantic import ValidationError

from dp_budget_provider.ledger import LedgerError, LedgerKey, PrivacyBudgetLedger
from dp_budget_provider.ledger.errors import LedgerUnavailable
from dp_budget_provider.plugins import csrf, schemas
from dp_budget_provider.plugins.admin import (
    AdminLedgers,
    AdminUnavailable,
    PolicyChange,
    acting,
    open_reference,
)
from dp_budget_provider.plugins.auth import budget_admin

Admin = Annotated[Any, Depends(budget_admin)]
CsrfHeader = Annotated[str | None, Header(alias=csrf.HEADER)]
_POLICY_FIELDS = tuple(schemas.PolicyChangeModel.model_fields)


@dataclass(frozen=True)
class Pages:
    """What the admin routes use of the app's pages (kept in :mod:`.app`)."""

    render: Callable[..., HTMLResponse]  # (request, template, context, status_code)
    ledger: Callable[[Request], PrivacyBudgetLedger]  # the ledger pages read (503 if down)
    header: Callable[[PrivacyBudgetLedger, Any], dict[str, Any]]  # info and user of a page
    account_url: Callable[[Request, LedgerKey], str]


def _failure(error: Exception) -> HTTPException:
    """The HTTP error an act's failure is: the api-server cannot act (503), the request is
    not a valid change (422), the ledger refuses it (409)."""
    if isinstance(error, (AdminUnavailable, LedgerUnavailable)):
        return HTTPException(status_code=503, detail=str(error))
    if isinstance(error, ValidationError):
        problems = "; ".join(
            f"{'.'.join(str(p) for p in problem['loc']) or 'value'}: {problem['msg']}"
            for problem in error.errors()
        )
        return HTTPException(status_code=422, detail=problems)
    if isinstance(error, ValueError):
        return HTTPException(status_code=422, detail=str(error))
    return HTTPException(status_code=409, detail=f"budget ledger: {error}")


def _doing(act: Callable[[], Any]) -> Any:
    try:
        return act()
    except (AdminUnavailable, LedgerError, ValueError) as error:
        raise _failure(error) from None


def _policy_of(values: dict[str, Any]) -> PolicyChange:
    """The change a JSON body or a form holds (a form's empty field: not given)."""
    given = {name: value for name, value in values.items() if value not in (None, "")}
    return PolicyChange.of(schemas.PolicyChangeModel(**given).model_dump())


def _set_policy(
    admin_ledgers: AdminLedgers | None, user: Any, change: PolicyChange
) -> schemas.PolicySetModel:
    name = str(user.get_name())

    def act(ledger: PrivacyBudgetLedger) -> schemas.PolicySetModel:
        policy, created = change.apply(ledger)
        return schemas.PolicySetModel(
            policy=schemas.PolicyModel(**policy.as_record()), created=created, actor=ledger.actor
        )

    return _doing(lambda: acting(admin_ledgers, name, act))


def _clear(
    admin_ledgers: AdminLedgers | None, user: Any, reason: str
) -> schemas.QuarantineClearedModel:
    name = str(user.get_name())

    def act(ledger: PrivacyBudgetLedger) -> schemas.QuarantineClearedModel:
        status = ledger.quarantine_status()
        ledger.clear_quarantine(reason)
        since, why = status or ("", "")
        return schemas.QuarantineClearedModel(
            actor=ledger.actor, reason=reason.strip(), quarantined_at=since, quarantine_reason=why
        )

    return _doing(lambda: acting(admin_ledgers, name, act))


def _opened(request: Request, pages: Pages, reference: str) -> schemas.RefusalModel:
    facts = _doing(lambda: open_reference(reference))
    account = facts.get("account")
    url = None
    if isinstance(account, dict):
        try:
            url = pages.account_url(request, LedgerKey(**account))
        except (TypeError, ValueError):
            url = None
    return schemas.RefusalModel(facts=facts, account_url=url)


async def _form(request: Request, user: Any) -> dict[str, str]:
    """The posted form's fields, once its CSRF token is proven."""
    form = await request.form()
    values = {name: value for name, value in form.items() if isinstance(value, str)}
    csrf.check(request, user, values.get(csrf.FIELD))
    return values


def install(app: FastAPI, admin_ledgers: AdminLedgers | None, pages: Pages) -> None:
    """Add the administrator's routes to the UI's ``app``."""

    # ------------------------------------------------------------------ API

    @app.put("/api/admin/policy", response_model=schemas.PolicySetModel, tags=["admin"])
    def api_set_policy(
        request: Request, user: Admin, body: schemas.PolicyChangeModel, token: CsrfHeader = None
    ) -> schemas.PolicySetModel:
        """Create or replace one scope's policy, signed with the api-server's administrator
        key; the history names the acting user."""
        csrf.check(request, user, token)
        return _set_policy(admin_ledgers, user, PolicyChange.of(body.model_dump()))

    @app.post(
        "/api/admin/quarantine/clear",
        response_model=schemas.QuarantineClearedModel,
        tags=["admin"],
    )
    def api_clear_quarantine(
        request: Request, user: Admin, body: schemas.QuarantineClearModel, token: CsrfHeader = None
    ) -> schemas.QuarantineClearedModel:
        """Let releases run again (409 if the ledger is not quarantined)."""
        csrf.check(request, user, token)
        return _clear(admin_ledgers, user, body.reason)

    @app.post("/api/admin/refusal", response_model=schemas.RefusalModel, tags=["admin"])
    def api_open_refusal(
        request: Request,
        user: Admin,
        body: schemas.RefusalReferenceModel,
        token: CsrfHeader = None,
    ) -> schemas.RefusalModel:
        """Which account refused a release, and why (422 for a reference this key did not
        seal, or a damaged one)."""
        csrf.check(request, user, token)
        return _opened(request, pages, body.reference)

    # ------------------------------------------------------------------ forms

    def policies(
        request: Request,
        user: Any,
        notice: str | None = None,
        error: str | None = None,
        status_code: int = 200,
    ) -> HTMLResponse:
        ledger = pages.ledger(request)
        context = {
            **pages.header(ledger, user),
            "policies": ledger.policies(),
            "notice": notice,
            "error": error,
        }
        return pages.render(request, "policies.html", context, status_code)

    @app.post("/admin/policy", response_class=HTMLResponse, include_in_schema=False)
    async def form_set_policy(request: Request, user: Admin) -> HTMLResponse:
        values = await _form(request, user)
        try:
            change = _policy_of({name: values.get(name) for name in _POLICY_FIELDS})
            done = _set_policy(admin_ledgers, user, change)
        except ValidationError as invalid:
            failure = _failure(invalid)
            return policies(request, user, error=failure.detail, status_code=failure.status_code)
        except HTTPException as failure:
            return policies(request, user, error=failure.detail, status_code=failure.status_code)
        policy = done.policy
        notice = (
            f"policy {policy.tenant}/{policy.query_type} {'created' if done.created else 'updated'}"
            f" by {done.actor}: cap {policy.cap_epsilon:g}"
        )
        return policies(request, user, notice=notice)

    @app.post("/admin/quarantine/clear", response_class=HTMLResponse, include_in_schema=False)
    async def form_clear_quarantine(request: Request, user: Admin) -> HTMLResponse:
        values = await _form(request, user)
        try:
            done = _clear(admin_ledgers, user, values.get("reason", ""))
            heading, message, status_code = (
                "Quarantine cleared",
                f"cleared by {done.actor}: {done.reason}",
                200,
            )
        except HTTPException as failure:
            heading, message, status_code = "Not cleared", failure.detail, failure.status_code
        ledger = pages.ledger(request)
        context = {
            **pages.header(ledger, user),
            "heading": heading,
            "message": message,
            "login_url": None,
            "back": (f"{request.scope.get('root_path', '')}/accounts", "the accounts"),
        }
        return pages.render(request, "message.html", context, status_code)

    def refusal(
        request: Request,
        user: Any,
        opened: schemas.RefusalModel | None = None,
        error: str | None = None,
        status_code: int = 200,
    ) -> HTMLResponse:
        context = {
            **pages.header(pages.ledger(request), user),
            "opened": opened,
            "error": error,
        }
        return pages.render(request, "refusal.html", context, status_code)

    @app.get("/admin/refusal", response_class=HTMLResponse, include_in_schema=False)
    def refusal_page(request: Request, user: Admin) -> HTMLResponse:
        return refusal(request, user)

    @app.post("/admin/refusal", response_class=HTMLResponse, include_in_schema=False)
    async def form_open_refusal(request: Request, user: Admin) -> HTMLResponse:
        values = await _form(request, user)
        try:
            opened = _opened(request, pages, values.get("reference", ""))
        except HTTPException as failure:
            return refusal(request, user, error=failure.detail, status_code=failure.status_code)
        return refusal(request, user, opened=opened)
