"""The budget UI's FastAPI app: server-rendered pages and the JSON API behind them.

Mounted by Airflow's API server at ``/dp-budget`` (see :mod:`.dp_budget`). Every route,
``/openapi.json`` included, depends on :func:`.auth.budget_reader`; every route is a GET
but the administrator's (:mod:`.admin_routes`), which only administrators may use. The
ledger is read through :mod:`dp_budget_provider.ledger` only.

Pages: ``/accounts`` (filter, sort, server-side pagination), ``/classes`` (the same
filters, one row per spend class) and ``/classes/members?tenant=…&query_type=…&window=…&
class_id=…``, ``/account?tenant=…&subject=…&query_type=…&window=…`` (the key travels in
the query string: key parts may contain ``/``), ``/policies``. API: ``/api/accounts``,
``/api/classes``, ``/api/classes/members``, ``/api/account``, ``/api/account/history``,
``/api/account/reservations``, ``/api/policies``, ``/api/report``, ``/api/verification``.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Annotated, Any, Literal
from urllib.parse import quote, urlencode

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse
from sqlalchemy.engine import make_url
from starlette.exceptions import HTTPException as StarletteHTTPException

import dp_budget_provider
from dp_budget_provider.ledger import LedgerError, LedgerKey, Policy, PrivacyBudgetLedger
from dp_budget_provider.ledger.accounts import classes
from dp_budget_provider.ledger.accounts.keys import MAX_STORED_INT, canonical_part
from dp_budget_provider.ledger.audit.authority import AdminKey
from dp_budget_provider.ledger.records import AccountStatus
from dp_budget_provider.ledger.views import queries, spend_classes
from dp_budget_provider.ledger.views.report import (
    SUBJECTS_PAGE_SIZE,
    EpsilonAlone,
    SubjectNames,
    build_report,
    describe_mechanism,
    key_label,
    render_markdown,
    verification_record,
)
from dp_budget_provider.ledger.windows import maintenance
from dp_budget_provider.ledger.windows.calendar import display_window
from dp_budget_provider.plugins import admin_routes, csrf, schemas
from dp_budget_provider.plugins.admin import AdminLedgers, key_file
from dp_budget_provider.plugins.auth import budget_reader, may_administer
from dp_budget_provider.plugins.chart import build_chart
from dp_budget_provider.plugins.links import URL_PREFIX
from dp_budget_provider.plugins.templates import environment

LedgerSource = Callable[[], PrivacyBudgetLedger]
Reader = Annotated[Any, Depends(budget_reader)]
PageNumber = Annotated[int, Query(ge=1, le=MAX_STORED_INT // 1000)]
PerPage = Annotated[int, Query(ge=1, le=500)]
ClassId = Annotated[str, Query(min_length=1, max_length=64)]

PAGE_SIZES = (25, 50, 100, 200)
HISTORY_PAGE = 50
VERIFY_TTL_SECONDS = 60.0
RESERVATIONS_PAGE = 20
RELEASE_PAGE = 100  # accounts per page of a release
KEY_FIELDS = (
    ("tenant", "tenant"),
    ("subject", "subject"),
    ("query_type", "query type"),
    ("window", "window"),
)
MEMBERS_PAGE = 50
# (sort key or None, header, right-aligned); _DESCENDING_FIRST sorts start largest first.
# STATUS_COLUMNS are what every account or class row shows of its standing.
STATUS_COLUMNS = (
    ("epsilon", "ε spent", True),
    (None, "ε held", True),
    (None, "cap", True),
    ("remaining", "remaining", True),
    ("fraction", "used", False),
    ("state", "state", False),
    ("open_reservations", "open reservations", True),
    ("releases", "releases", True),
    ("updated_at", "updated", False),
)
COLUMNS = (
    ("tenant", "tenant", False),
    ("subject", "subject", False),
    ("query_type", "query type", False),
    ("window", "window", False),
    *STATUS_COLUMNS,
)
_UNSORTED_STATUS = tuple((None, label, numeric) for _, label, numeric in STATUS_COLUMNS)
CLASS_COLUMNS = (
    (None, "tenant", False),
    (None, "query type", False),
    (None, "window", False),
    (None, "subjects", True),
    (None, "first subject", False),
    *_UNSORTED_STATUS,
    (None, "members", False),
)
MEMBER_COLUMNS = ((None, "subject", False), *_UNSORTED_STATUS)
STALE_CLASS = (
    "no such spend class in that window (a release may have changed its members' spend: "
    "list the classes again)"
)
_DESCENDING_FIRST = {"epsilon", "fraction", "state", "open_reservations", "releases", "updated_at"}

_TEMPLATES = environment()


# ---------------------------------------------------------------------- ledger access


class HookLedgerSource:
    """Opens the ledger of the ``dp_budget_default`` connection once per process.

    It never creates a ledger (the UI must not): a ledger that does not exist yet is an
    error until the first release creates it. Opening is retried on the next request
    after a failure. :meth:`administered` opens it for one administrator's act.
    """

    def __init__(self) -> None:
        self._ledger: PrivacyBudgetLedger | None = None
        self._lock = threading.Lock()

    def __call__(self) -> PrivacyBudgetLedger:
        with self._lock:
            if self._ledger is None:
                from dp_budget_provider.hooks.dp_budget import DPBudgetHook

                hook = DPBudgetHook()
                # A keyed ledger refuses to open without its key: every page would be a 503.
                self._ledger = _open(hook)
            return self._ledger

    @staticmethod
    def administered(admin: AdminKey, actor: str) -> PrivacyBudgetLedger:
        """The same ledger, opened to sign with the administrator's key as ``actor`` (the
        caller closes it)."""
        from dp_budget_provider.hooks.dp_budget import DPBudgetHook

        return _open(DPBudgetHook(), admin=admin, actor=actor)


def _open(hook: Any, **acting: Any) -> PrivacyBudgetLedger:
    """The connection's ledger, with its chain key and the administrator key it pins."""
    return PrivacyBudgetLedger(
        url=hook.ledger_url(),
        chain_key=hook.chain_key(),
        admin_public_key=hook.admin_public_key(),
        **acting,
    )


class VerificationCache:
    """The audit result, reused while the chain head is unchanged and it is fresh.

    Verifying replays the whole history, too slow to run on every page view of a big
    ledger. A result is reused for the same chain head (nothing was written since) for
    at most :data:`VERIFY_TTL_SECONDS`, so an edit that leaves the head alone (tampering
    with an old entry) is still found within that time.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._head: tuple[int, str] | None = None
        self._result: dict[str, Any] | None = None
        self._checked = 0.0

    def _fresh(self, head: tuple[int, str]) -> bool:
        age = time.monotonic() - self._checked
        return self._result is not None and self._head == head and age < VERIFY_TTL_SECONDS

    def cached(self, ledger: PrivacyBudgetLedger) -> dict[str, Any] | None:
        """The result for the ledger's current head, if one was computed recently."""
        head = queries.chain_head(ledger)
        return self._result if self._fresh(head) else None

    def current(self, ledger: PrivacyBudgetLedger) -> dict[str, Any]:
        """The result for the current head, verifying now if needed (one at a time)."""
        with self._lock:
            head = queries.chain_head(ledger)
            if not self._fresh(head) or self._result is None:
                record = verification_record(ledger)
                checked = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
                self._result = {**record, "head_seq": head[0], "checked_at": checked}
                self._head = head
                self._checked = time.monotonic()
            return self._result


# ---------------------------------------------------------------------- helpers


def _ledger(request: Request) -> PrivacyBudgetLedger:
    """The ledger of the app serving ``request`` (opening it may fail: 503)."""
    try:
        return request.app.state.ledger_source()
    except LedgerError as error:
        raise HTTPException(status_code=503, detail=f"budget ledger: {error}") from error


Ledger = Annotated[PrivacyBudgetLedger, Depends(_ledger)]


def _root(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/")


def _relative_path(request: Request) -> str:
    path, root = request.url.path, _root(request)
    return path[len(root) :] if root and path.startswith(root) else path


def _wants_html(request: Request) -> bool:
    path = _relative_path(request)
    return not (path.startswith("/api") or path == "/openapi.json")


def _url(request: Request, path: str, params: Mapping[str, Any]) -> str:
    query = urlencode({k: v for k, v in params.items() if v not in (None, "")})
    return f"{_root(request)}{path}" + (f"?{query}" if query else "")


def _account_url(request: Request, key: LedgerKey) -> str:
    return _url(request, "/account", key.as_dict())


def _members_url(request: Request, path: str, spend_class: spend_classes.SpendClass) -> str:
    """The members listing (page or API, ``path``) of one spend class."""
    key = spend_class.status.key
    return _url(
        request,
        path,
        {
            "tenant": key.tenant,
            "query_type": key.query_type,
            "window": key.window,
            "class_id": spend_class.id,
        },
    )


def _page_filters(
    tenant: str | None = None,
    subject: str | None = None,
    query_type: str | None = None,
    window: str | None = None,
    state: str | None = None,
) -> dict[str, str | None]:
    """The filters of the accounts and classes pages, as typed (the form shows them back)."""
    return {
        "tenant": tenant,
        "subject": subject,
        "query_type": query_type,
        "window": window,
        "state": state,
    }


PageFilters = Annotated[dict[str, str | None], Depends(_page_filters)]


def _account_filter(raw: Mapping[str, str | None]) -> queries.AccountFilter:
    """The ledger's filter of a page's form values (an empty field matches anything)."""
    return queries.AccountFilter(**{name: value or None for name, value in raw.items()})


def _key(tenant: str, subject: str, query_type: str, window: str) -> LedgerKey:
    """A subject's key, or an account's (a spend class label: receipts, history entries
    and the task link name accounts)."""
    try:
        if classes.is_label(subject):
            return classes.account_key(tenant, subject, query_type, window)
        return LedgerKey(tenant, subject, query_type, window)
    except ValueError as error:
        raise HTTPException(status_code=422, detail=str(error)) from error


def _release(
    ledger: PrivacyBudgetLedger, reservation_id: str, limit: int, offset: int
) -> queries.Release:
    """The release of a reservation id (404 when there is none)."""
    found = queries.release(ledger, reservation_id, limit=limit, offset=offset)
    if found is None:
        raise HTTPException(status_code=404, detail=f"no release {reservation_id!r}")
    return found


def _class_members(
    ledger: PrivacyBudgetLedger,
    tenant: str,
    query_type: str,
    window: str,
    class_id: str,
    limit: int,
    offset: int,
) -> queries.Page[AccountStatus] | None:
    """One page of a spend class's members, None once no account holds its spend (422 when
    the tenant, query type or window cannot be a key part)."""
    try:
        return spend_classes.class_members(
            ledger, tenant, query_type, window, class_id, limit=limit, offset=offset
        )
    except ValueError as error:
        raise HTTPException(status_code=422, detail=str(error)) from error


def _info(ledger: PrivacyBudgetLedger) -> dict[str, Any]:
    """What every page's header says about the ledger, quarantine first, then overdue
    maintenance."""
    return {
        "backend": make_url(ledger.url).get_backend_name(),
        "delta": f"{ledger.delta:g}",
        "conversion": ledger.conversion,
        "keyed": ledger.chain_key.keyed,
        "quarantine": ledger.quarantine_status(),
        "maintenance": _maintenance_warning(ledger),
    }


def _maintenance_warning(ledger: PrivacyBudgetLedger) -> str | None:
    """The banner's line when reap, reset or verify is overdue under the deployment's
    schedules (Airflow's configuration, read where the UI runs), else None."""
    from dp_budget_provider.hooks.maintenance import maintenance_intervals

    try:
        intervals = maintenance_intervals()
    except ValueError as error:
        return f"cannot tell whether the ledger's maintenance is overdue: {error}"
    overdue = [state for state in ledger.maintenance(intervals) if state.overdue]
    return maintenance.overdue_warning(overdue) if overdue else None


def _account_model(request: Request, account: AccountStatus, delta: float) -> schemas.AccountModel:
    return schemas.AccountModel(
        **account.key.as_dict(),
        epsilon=account.epsilon,
        delta=delta,
        cap_epsilon=account.cap_epsilon,
        remaining=account.remaining,
        fraction=account.fraction,
        held_epsilon=account.held_epsilon,
        remaining_after_held=account.remaining_after_held,
        state=account.state,
        warned=account.warned,
        exhausted=account.exhausted,
        releases=account.releases,
        open_reservations=account.open_reservations,
        method=account.method,
        updated_at=account.updated_at,
        account=account.account,
        subjects=account.subjects,
        page_url=_account_url(request, account.key),
    )


def _history_records(ledger: PrivacyBudgetLedger, entries: list[dict[str, Any]]) -> list[Any]:
    """History entries with what the table shows: attempt, mechanism, cost, a note, and
    the subjects they covered (a class of one named by its subject: ``SubjectNames``)."""
    epsilon_alone = EpsilonAlone(ledger)
    names = SubjectNames(ledger, entries)
    return [_history_record(entry, epsilon_alone, names) for entry in entries]


def _history_record(
    entry: dict[str, Any], epsilon_alone: EpsilonAlone, names: SubjectNames
) -> dict[str, Any]:
    payload = entry["payload"]
    cost = payload.get("cost") or payload.get("carried")
    note = payload.get("reason") or None
    if entry["action"] == "rescope" and payload.get("from"):
        source = key_label(names.subject_key(payload["from"]))
        note = f"carried from {source}" + (f": {note}" if note else "")
    elif entry["action"] == "reset":
        note = f"window {display_window(str(payload.get('window')))} reset"
    return {
        **entry,
        "key": names.subject_key(entry["key"]),
        "subjects": names.subjects(entry),
        "key_count": entry.get("key_count") or payload.get("key_count") or 1,
        "attempt_id": entry.get("attempt_id") or payload.get("attempt_id"),
        "mechanism": entry.get("mechanism") or payload.get("mechanism"),
        "count": entry.get("count") or payload.get("count"),
        "cost_epsilon": epsilon_alone(cost) if cost else None,
        "note": note,
    }


def _task_link(request: Request, attempt_id: str | None) -> str | None:
    """The Airflow UI page of a task attempt ``dag_id/task_id/run_id/map_index/try/ti_id``
    (attempts made before the task instance's id joined them end at ``try``)."""
    parts = (attempt_id or "").split("/")
    if len(parts) >= 6 and parts[-2].isdigit() and parts[-3].lstrip("-").isdigit():
        parts = parts[:-1]  # the task instance's id
    if len(parts) < 5 or not all(parts):
        return None
    dag_id, task_id, run_id, map_index = parts[0], parts[1], "/".join(parts[2:-2]), parts[-2]
    airflow_root = _root(request).removesuffix(URL_PREFIX)
    path = (
        f"{airflow_root}/dags/{quote(dag_id)}/runs/{quote(run_id, safe='')}/tasks/{quote(task_id)}"
    )
    return path + (f"/mapped/{quote(map_index)}" if map_index not in ("-1", "") else "")


def _pages(total: int, size: int) -> int:
    return max(1, math.ceil(total / size))


def _policy_model(policy: Policy) -> schemas.PolicyModel:
    return schemas.PolicyModel(**policy.as_record())


# ---------------------------------------------------------------------- the app


def create_app(
    ledger_source: LedgerSource | None = None, admin_ledgers: AdminLedgers | None = None
) -> FastAPI:
    """The budget UI app, reading the ledger ``ledger_source()`` returns, and doing the
    administrator's acts on the ledger ``admin_ledgers(key, actor)`` opens.

    The default source is the ledger of the ``dp_budget_default`` Airflow connection
    (or the embedded SQLite ledger), what the plugin mounts; with it, the same
    connection's ledger is opened for the acts.
    """
    if ledger_source is None:
        hooked = HookLedgerSource()
        source: LedgerSource = hooked
        admin_ledgers = admin_ledgers or hooked.administered
    else:
        source = ledger_source
    verifications = VerificationCache()
    app = FastAPI(
        title="DP budget",
        version=dp_budget_provider.__version__,
        description=(
            "The differential-privacy budget ledger: accounts, their history, reservations "
            "and policies, the privacy report and the audit status; and the administrator's "
            "acts (/api/admin: set a policy, clear a quarantine, open a refusal reference). "
            "Every route needs an authenticated Airflow user allowed to read the custom "
            "view 'DP Budget' (a Bearer token from POST /auth/token, or the UI's cookie); "
            "the administrator's need PUT on it too, and, with the cookie, the page's CSRF "
            "token in the X-DP-Budget-CSRF header."
        ),
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
        dependencies=[Depends(budget_reader)],
    )

    app.state.ledger_source = source

    @app.middleware("http")
    async def security_headers(request: Request, call_next: Callable[..., Any]) -> Any:
        response = await call_next(request)
        response.headers.setdefault("Cache-Control", "no-store")
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "same-origin")
        return response

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> Any:
        if not _wants_html(request):
            return await http_exception_handler(request, error)
        login_url = None
        if error.status_code in (401, 403):
            login_url = _login_url()
        headings = {401: "Sign-in required", 403: "Not allowed", 404: "Not found"}
        return _render(
            request,
            "message.html",
            {
                "heading": headings.get(error.status_code, "Error"),
                "message": str(error.detail),
                "login_url": login_url,
                "back": None,
                "info": None,
                "user": "",
            },
            status_code=error.status_code,
        )

    @app.exception_handler(LedgerError)
    async def ledger_error(request: Request, error: LedgerError) -> Any:
        return await http_error(
            request, StarletteHTTPException(status_code=503, detail=f"budget ledger: {error}")
        )

    @app.get("/openapi.json", include_in_schema=False)
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    # ------------------------------------------------------------------ pages

    @app.get("/", include_in_schema=False)
    def index(request: Request) -> RedirectResponse:
        return RedirectResponse(_url(request, "/accounts", {}), status_code=307)

    @app.get("/accounts", response_class=HTMLResponse, summary="Accounts page")
    def accounts_page(
        request: Request,
        user: Reader,
        ledger: Ledger,
        raw: PageFilters,
        sort: str = "key",
        order: Literal["asc", "desc"] = "asc",
        page: PageNumber = 1,
        per_page: PerPage = 50,
    ) -> HTMLResponse:
        error = None
        try:
            found = queries.find_accounts(
                ledger,
                _account_filter(raw),
                sort=sort,
                descending=order == "desc",
                limit=per_page,
                offset=(page - 1) * per_page,
            )
        except ValueError as problem:
            error = str(problem)
            found = queries.Page(total=0, offset=0, limit=per_page)
        params = {**raw, "sort": sort, "order": order, "per_page": per_page}

        def page_link(number: int) -> str:
            return _url(request, "/accounts", {**params, "page": number})

        def sort_link(column: str) -> str:
            if column == sort:
                direction = "asc" if order == "desc" else "desc"
            else:
                direction = "desc" if column in _DESCENDING_FIRST else "asc"
            return _url(request, "/accounts", {**params, "sort": column, "order": direction})

        return _render(
            request,
            "accounts.html",
            {
                **_listing(request, ledger, user, found, page, per_page, raw),
                "accounts": found.items,
                "sorts": queries.SORTS,
                "sort": sort,
                "order": order,
                "columns": COLUMNS,
                "error": error,
                "page_link": page_link,
                "sort_link": sort_link,
                "account_link": lambda key: _account_url(request, key),
                "classes_link": _url(request, "/classes", {**raw, "per_page": per_page}),
            },
            status_code=200 if error is None else 422,
        )

    @app.get("/classes", response_class=HTMLResponse, summary="Spend classes page")
    def classes_page(
        request: Request,
        user: Reader,
        ledger: Ledger,
        raw: PageFilters,
        page: PageNumber = 1,
        per_page: PerPage = 50,
    ) -> HTMLResponse:
        error = None
        try:
            found = spend_classes.find_classes(
                ledger, _account_filter(raw), limit=per_page, offset=(page - 1) * per_page
            )
        except ValueError as problem:
            error = str(problem)
            found = queries.Page(total=0, offset=0, limit=per_page)
        params = {**raw, "per_page": per_page}
        return _render(
            request,
            "classes.html",
            {
                **_listing(request, ledger, user, found, page, per_page, raw),
                "classes": found.items,
                "columns": CLASS_COLUMNS,
                "error": error,
                "page_link": lambda n: _url(request, "/classes", {**params, "page": n}),
                "members_link": lambda c: _members_url(request, "/classes/members", c),
                "account_link": lambda key: _account_url(request, key),
                "accounts_link": _url(request, "/accounts", params),
            },
            status_code=200 if error is None else 422,
        )

    @app.get("/classes/members", response_class=HTMLResponse, summary="Spend class members page")
    def class_members_page(
        request: Request,
        user: Reader,
        ledger: Ledger,
        tenant: str,
        query_type: str,
        window: str,
        class_id: ClassId,
        page: PageNumber = 1,
    ) -> HTMLResponse:
        found = _class_members(
            ledger, tenant, query_type, window, class_id, MEMBERS_PAGE, (page - 1) * MEMBERS_PAGE
        )
        scope = {
            name: canonical_part(name, value)
            for name, value in (("tenant", tenant), ("query_type", query_type), ("window", window))
        }
        classes_link = _url(request, "/classes", scope)
        if found is None:
            return _render(
                request,
                "message.html",
                {
                    "heading": "Spend class not found",
                    "message": STALE_CLASS,
                    "login_url": None,
                    "back": (classes_link, "the spend classes of this window"),
                    "info": _info(ledger),
                    "user": _user_name(user),
                },
                status_code=404,
            )
        params = {**scope, "class_id": class_id}
        return _render(
            request,
            "members.html",
            {
                "info": _info(ledger),
                "user": _user_name(user),
                "scope": scope,
                "class_id": class_id,
                "members": found.items,
                "total": found.total,
                "page": page,
                "pages": _pages(found.total, MEMBERS_PAGE),
                "columns": MEMBER_COLUMNS,
                "page_link": lambda n: _url(request, "/classes/members", {**params, "page": n}),
                "account_link": lambda key: _account_url(request, key),
                "classes_link": classes_link,
            },
        )

    @app.get("/account", response_class=HTMLResponse, summary="Account page")
    def account_page(
        request: Request,
        user: Reader,
        ledger: Ledger,
        tenant: str,
        subject: str,
        query_type: str,
        window: str,
        page: PageNumber = 1,
        rpage: PageNumber = 1,
    ) -> HTMLResponse:
        key = _key(tenant, subject, query_type, window)
        account = queries.account_status(ledger, key)
        history = queries.key_history(
            ledger, key, limit=HISTORY_PAGE, offset=(page - 1) * HISTORY_PAGE
        )
        if account is None and history.total == 0:
            raise HTTPException(status_code=404, detail=f"no account or history for {key}")
        policy = ledger.policy_for(key)
        series = queries.spend_series(ledger, key)
        reservations = queries.key_reservations(
            ledger, key, limit=RESERVATIONS_PAGE, offset=(rpage - 1) * RESERVATIONS_PAGE
        )
        history_items = _history_records(ledger, history.items)
        verified = verifications.cached(ledger)
        if verified is None:
            verification: dict[str, Any] = {"state": "pending", "problems": []}
        else:
            verification = {**verified, "state": "ok" if verified["ok"] else "failed"}
        params = {**key.as_dict(), "page": page, "rpage": rpage}
        return _render(
            request,
            "account.html",
            {
                "info": _info(ledger),
                "user": _user_name(user),
                "key": key,
                "account": account,
                "state": account.state if account else None,
                "totals": queries.subject_totals(ledger, key),
                "account_link": lambda total: _account_url(request, total),
                "policy": policy,
                "series": series,
                "chart": build_chart(series.points, policy),
                "verification": verification,
                "history": queries.Page(
                    history.total, history.offset, history.limit, history_items
                ),
                "history_page": page,
                "history_pages": _pages(history.total, HISTORY_PAGE),
                "history_link": lambda n: _url(request, "/account", {**params, "page": n}),
                "reservations": reservations,
                "reservations_page": rpage,
                "reservations_pages": _pages(reservations.total, RESERVATIONS_PAGE),
                "reservations_link": lambda n: _url(request, "/account", {**params, "rpage": n}),
                "release_link": lambda rid: _url(request, "/release", {"reservation": rid}),
                "describe": describe_mechanism,
                "task_link": lambda attempt: _task_link(request, attempt),
            },
        )

    @app.get("/release", response_class=HTMLResponse, summary="Release page")
    def release_page(
        request: Request,
        user: Reader,
        ledger: Ledger,
        reservation: str,
        page: PageNumber = 1,
    ) -> HTMLResponse:
        found = _release(ledger, reservation, RELEASE_PAGE, (page - 1) * RELEASE_PAGE)
        return _render(
            request,
            "release.html",
            {
                **_header(ledger, user),
                "release": found,
                "page": page,
                "pages": _pages(found.accounts.total, RELEASE_PAGE),
                "page_link": lambda n: _url(
                    request, "/release", {"reservation": reservation, "page": n}
                ),
                "account_link": lambda key: _account_url(request, key),
                "describe": describe_mechanism,
                "task_link": lambda attempt: _task_link(request, attempt),
            },
        )

    @app.get("/policies", response_class=HTMLResponse, summary="Policies page")
    def policies_page(request: Request, user: Reader, ledger: Ledger) -> HTMLResponse:
        return _render(
            request,
            "policies.html",
            {
                **_header(ledger, user),
                "policies": ledger.policies(),
                "notice": None,
                "error": None,
            },
        )

    # ------------------------------------------------------------------ API

    @app.get("/api/accounts", response_model=schemas.AccountsPage, tags=["accounts"])
    def api_accounts(
        request: Request,
        ledger: Ledger,
        tenant: Annotated[str | None, Query(description="exact, or * wildcards")] = None,
        subject: Annotated[str | None, Query(description="exact, or * wildcards")] = None,
        query_type: Annotated[str | None, Query(description="exact, or * wildcards")] = None,
        window: Annotated[str | None, Query(description="exact, or * wildcards")] = None,
        state: Annotated[str | None, Query(description="ok, warning or exhausted")] = None,
        sort: Annotated[str, Query(description=", ".join(queries.SORTS))] = "key",
        order: Literal["asc", "desc"] = "asc",
        limit: Annotated[int, Query(ge=1, le=queries.MAX_PAGE)] = 50,
        offset: Annotated[int, Query(ge=0, le=MAX_STORED_INT)] = 0,
    ) -> schemas.AccountsPage:
        """Live accounts matching the filters, one page, with the total count."""
        try:
            filters = queries.AccountFilter(tenant, subject, query_type, window, state)
            found = queries.find_accounts(
                ledger, filters, sort=sort, descending=order == "desc", limit=limit, offset=offset
            )
        except ValueError as error:
            raise HTTPException(status_code=422, detail=str(error)) from error
        delta = ledger.delta
        return schemas.AccountsPage(
            total=found.total,
            offset=found.offset,
            limit=found.limit,
            sort=sort,
            order=order,
            accounts=[_account_model(request, account, delta) for account in found.items],
        )

    @app.get("/api/classes", response_model=schemas.ClassesPage, tags=["accounts"])
    def api_classes(
        request: Request,
        ledger: Ledger,
        tenant: Annotated[str | None, Query(description="exact, or * wildcards")] = None,
        subject: Annotated[
            str | None, Query(description="the classes of these subjects (exact, or * wildcards)")
        ] = None,
        query_type: Annotated[str | None, Query(description="exact, or * wildcards")] = None,
        window: Annotated[str | None, Query(description="exact, or * wildcards")] = None,
        state: Annotated[str | None, Query(description="ok, warning or exhausted")] = None,
        limit: Annotated[int, Query(ge=1, le=queries.MAX_PAGE)] = 50,
        offset: Annotated[int, Query(ge=0, le=MAX_STORED_INT)] = 0,
    ) -> schemas.ClassesPage:
        """Spend classes: the subjects of a window holding the same spend, one page."""
        try:
            filters = queries.AccountFilter(tenant, subject, query_type, window, state)
            found = spend_classes.find_classes(ledger, filters, limit=limit, offset=offset)
        except ValueError as error:
            raise HTTPException(status_code=422, detail=str(error)) from error
        delta = ledger.delta
        return schemas.ClassesPage(
            total=found.total,
            offset=found.offset,
            limit=found.limit,
            classes=[
                schemas.SpendClassModel(
                    id=spend_class.id,
                    subjects=spend_class.subjects,
                    account=_account_model(request, spend_class.status, delta),
                    members_url=_members_url(request, "/api/classes/members", spend_class),
                )
                for spend_class in found.items
            ],
        )

    @app.get("/api/classes/members", response_model=schemas.AccountsPage, tags=["accounts"])
    def api_class_members(
        request: Request,
        ledger: Ledger,
        tenant: str,
        query_type: str,
        window: str,
        class_id: ClassId,
        limit: Annotated[int, Query(ge=1, le=queries.MAX_PAGE)] = 50,
        offset: Annotated[int, Query(ge=0, le=MAX_STORED_INT)] = 0,
    ) -> schemas.AccountsPage:
        """The accounts of one spend class, by subject; 404 once a release has changed it."""
        found = _class_members(ledger, tenant, query_type, window, class_id, limit, offset)
        if found is None:
            raise HTTPException(status_code=404, detail=STALE_CLASS)
        delta = ledger.delta
        return schemas.AccountsPage(
            total=found.total,
            offset=found.offset,
            limit=found.limit,
            sort="subject",
            order="asc",
            accounts=[_account_model(request, account, delta) for account in found.items],
        )

    @app.get("/api/account", response_model=schemas.AccountDetail, tags=["accounts"])
    def api_account(
        request: Request,
        ledger: Ledger,
        tenant: str,
        subject: str,
        query_type: str,
        window: str,
        max_points: Annotated[int, Query(ge=2, le=5000)] = 200,
    ) -> schemas.AccountDetail:
        """One account: status, policy, cumulative epsilon over time, open reservations."""
        key = _key(tenant, subject, query_type, window)
        account = queries.account_status(ledger, key)
        series = queries.spend_series(ledger, key, max_points=max_points)
        if account is None and series.events == 0:
            history = queries.key_history(ledger, key, limit=1)
            if history.total == 0:
                raise HTTPException(status_code=404, detail=f"no account or history for {key}")
        open_reservations = queries.key_reservations(
            ledger, key, states=["open"], limit=queries.MAX_PAGE
        )
        return schemas.AccountDetail(
            key=schemas.KeyModel(**key.as_dict()),
            account=None if account is None else _account_model(request, account, ledger.delta),
            policy=_policy_model(ledger.policy_for(key)),
            series=schemas.SeriesModel(
                events=series.events,
                points=[schemas.SeriesPointModel(**vars(p)) for p in series.points],
            ),
            open_reservations=[schemas.ReservationModel(**r) for r in open_reservations.items],
            totals=[
                _account_model(request, total, ledger.delta)
                for total in queries.subject_totals(ledger, key)
            ],
        )

    @app.get("/api/account/history", response_model=schemas.HistoryPage, tags=["accounts"])
    def api_account_history(
        ledger: Ledger,
        tenant: str,
        subject: str,
        query_type: str,
        window: str,
        limit: Annotated[int, Query(ge=1, le=queries.MAX_PAGE)] = 50,
        offset: Annotated[int, Query(ge=0, le=MAX_STORED_INT)] = 0,
        order: Literal["newest", "oldest"] = "newest",
    ) -> schemas.HistoryPage:
        """History entries concerning one key (its own and its multi-key reservations')."""
        key = _key(tenant, subject, query_type, window)
        history = queries.key_history(
            ledger, key, limit=limit, offset=offset, newest_first=order == "newest"
        )
        return schemas.HistoryPage(
            total=history.total,
            offset=history.offset,
            limit=history.limit,
            entries=[
                schemas.HistoryEntryModel(**record)
                for record in _history_records(ledger, history.items)
            ],
        )

    @app.get(
        "/api/account/reservations", response_model=schemas.ReservationsPage, tags=["accounts"]
    )
    def api_account_reservations(
        ledger: Ledger,
        tenant: str,
        subject: str,
        query_type: str,
        window: str,
        state: Annotated[list[str] | None, Query(description="open, committed, …")] = None,
        limit: Annotated[int, Query(ge=1, le=queries.MAX_PAGE)] = 50,
        offset: Annotated[int, Query(ge=0, le=MAX_STORED_INT)] = 0,
    ) -> schemas.ReservationsPage:
        """Reservations holding one key, newest first."""
        key = _key(tenant, subject, query_type, window)
        try:
            found = queries.key_reservations(ledger, key, states=state, limit=limit, offset=offset)
        except ValueError as error:
            raise HTTPException(status_code=422, detail=str(error)) from error
        return schemas.ReservationsPage(
            total=found.total,
            offset=found.offset,
            limit=found.limit,
            reservations=[schemas.ReservationModel(**r) for r in found.items],
        )

    @app.get("/api/release", response_model=schemas.ReleaseModel, tags=["accounts"])
    def api_release(
        ledger: Ledger,
        reservation: str,
        limit: Annotated[int, Query(ge=1, le=queries.MAX_PAGE)] = 50,
        offset: Annotated[int, Query(ge=0, le=MAX_STORED_INT)] = 0,
    ) -> schemas.ReleaseModel:
        """One release (by its reservation id, as its receipt names it) and the accounts it
        held, in the order it reserved them."""
        found = _release(ledger, reservation, limit, offset)
        return schemas.ReleaseModel(
            reservation=schemas.ReservationModel(**found.reservation),
            windows=found.windows,
            total=found.accounts.total,
            offset=found.accounts.offset,
            limit=found.accounts.limit,
            accounts=[schemas.KeyModel(**key.as_dict()) for key in found.accounts.items],
        )

    @app.get("/api/policies", response_model=list[schemas.PolicyModel], tags=["policies"])
    def api_policies(ledger: Ledger) -> list[schemas.PolicyModel]:
        """Every stored policy, the default (* / *) first."""
        return [_policy_model(policy) for policy in ledger.policies()]

    @app.get("/api/report", tags=["report"], response_model=None)
    def api_report(
        ledger: Ledger,
        window: str | None = None,
        tenant: str | None = None,
        format: Literal["json", "md"] = "json",
        subjects: bool = False,
        page: int = 1,
        page_size: int = SUBJECTS_PAGE_SIZE,
    ) -> Any:
        """The privacy report (JSON, or Markdown with ``format=md``) of the ledger or a scope:
        per spend class, and with ``subjects=true`` one page (``page``, ``page_size``) of
        the per-subject listing, as ``dp-budget report`` takes them."""
        try:
            report = build_report(
                ledger,
                window=window or None,
                tenant=tenant or None,
                subjects=subjects,
                page=page,
                page_size=page_size,
            )
        except ValueError as error:
            raise HTTPException(status_code=422, detail=str(error)) from error
        if format == "md":
            return PlainTextResponse(render_markdown(report), media_type="text/markdown")
        return JSONResponse(report)

    @app.get("/api/verification", response_model=schemas.VerificationModel, tags=["audit"])
    def api_verification(ledger: Ledger) -> schemas.VerificationModel:
        """The ledger's audit: hash chain, reservation key sets, replay (cached per head)."""
        return schemas.VerificationModel(**verifications.current(ledger))

    admin_routes.install(
        app,
        admin_ledgers,
        admin_routes.Pages(
            render=_render, ledger=_ledger, header=_header, account_url=_account_url
        ),
    )
    return app


def _header(ledger: PrivacyBudgetLedger, user: Any) -> dict[str, Any]:
    """What every page's header shows: the ledger, and who is signed in."""
    return {"info": _info(ledger), "user": _user_name(user)}


def _admin_view(request: Request) -> dict[str, Any] | None:
    """What a page shows an administrator (None for anyone else): the CSRF token its
    forms carry, and whether this api-server holds the administrator's key (without it
    no administrator's act is offered)."""
    user = getattr(request.state, "dp_budget_user", None)
    if user is None or not may_administer(user):
        return None
    return {"csrf": csrf.token_for(user), "key": key_file() is not None}


def _user_name(user: Any) -> str:
    try:
        return str(user.get_name())
    except Exception:  # noqa: BLE001 - a display nicety must not break a page
        return ""


def _login_url() -> str | None:
    from airflow.api_fastapi.app import get_auth_manager

    try:
        return str(get_auth_manager().get_url_login())
    except Exception:  # noqa: BLE001 - no login link rather than no error page
        return None


def _listing(
    request: Request,
    ledger: PrivacyBudgetLedger,
    user: Any,
    found: queries.Page[Any],
    page: int,
    per_page: int,
    filters: Mapping[str, Any],
) -> dict[str, Any]:
    """What the accounts and the classes pages both show: who and where, the filter
    form, the page numbers."""
    return {
        "info": _info(ledger),
        "user": _user_name(user),
        "total": found.total,
        "page": page,
        "pages": _pages(found.total, per_page),
        "per_page": per_page,
        "page_sizes": sorted({*PAGE_SIZES, per_page}),
        "filters": filters,
        "key_fields": KEY_FIELDS,
        "states": queries.STATES,
    }


def _render(
    request: Request, template: str, context: dict[str, Any], status_code: int = 200
) -> HTMLResponse:
    nonce = secrets.token_urlsafe(16)
    context.setdefault("admin", _admin_view(request))
    html = _TEMPLATES.get_template(template).render(root=_root(request), nonce=nonce, **context)
    response = HTMLResponse(html, status_code=status_code)
    response.headers["Content-Security-Policy"] = (
        f"default-src 'none'; style-src 'nonce-{nonce}'; script-src 'nonce-{nonce}'; "
        "img-src 'self' data:; connect-src 'self'; form-action 'self'; base-uri 'none'; "
        "frame-ancestors 'self'"
    )
    return response
