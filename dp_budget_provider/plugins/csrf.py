"""Cross-site request forgery protection for the administrator's acts.

Inside the Airflow UI the pages are authenticated by the UI's ``_token`` cookie, which a
browser sends with any request to the API server, including a form another site posts
there. So a state-changing request that carries no ``Authorization: Bearer`` header (its
credential is the cookie) must prove it comes from one of our pages:

* a token bound to the user, which only our pages hold: ``HMAC(key, user id | issued)``,
  keyed with a key derived from ``[api] secret_key`` (what every api-server instance
  already shares), valid for :data:`TOKEN_SECONDS`. It travels in the form field
  ``csrf_token``, or in the header ``X-DP-Budget-CSRF`` for a script on the page; it is not
  bound to the cookie's value, so Airflow refreshing the cookie does not void a form;
* and, where the browser says where the request comes from (``Origin``,
  ``Sec-Fetch-Site``), that it is this site.

A request with a Bearer token is not forgeable this way (another site cannot set the
header) and needs neither.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from typing import Any
from urllib.parse import urlsplit

from fastapi import HTTPException, Request, status

FIELD = "csrf_token"
HEADER = "X-DP-Budget-CSRF"
TOKEN_SECONDS = 8 * 3600
_CLOCK_SLACK = 60
_LABEL = b"dp-budget csrf token v1"


def _key() -> bytes:
    from airflow.api_fastapi.auth.tokens import get_signing_key

    secret = get_signing_key("api", "secret_key")
    return hmac.new(secret.encode("utf-8"), _LABEL, hashlib.sha256).digest()


def _user_id(user: Any) -> str:
    return f"{user.get_id()}|{user.get_name()}"


def _mac(user: Any, issued: int) -> str:
    data = f"{_user_id(user)}|{issued}".encode()
    digest = hmac.new(_key(), data, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode("ascii").rstrip("=")


def token_for(user: Any, now: float | None = None) -> str:
    """A token for ``user``'s forms (and scripts), valid for :data:`TOKEN_SECONDS`."""
    issued = int(time.time() if now is None else now)
    return f"{issued}.{_mac(user, issued)}"


def _valid(user: Any, token: object) -> bool:
    if not isinstance(token, str) or token.count(".") != 1:
        return False
    issued_text, mac = token.split(".")
    if not issued_text.isdigit() or len(issued_text) > 12:
        return False
    issued = int(issued_text)
    age = time.time() - issued
    if not -_CLOCK_SLACK <= age <= TOKEN_SECONDS:
        return False
    return hmac.compare_digest(mac, _mac(user, issued))


def uses_the_cookie(request: Request) -> bool:
    """Whether the request's credential is the browser's cookie (no Bearer token)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return not (scheme.lower() == "bearer" and token.strip())


def _own_hosts(request: Request) -> set[str]:
    from airflow.configuration import conf

    hosts = {request.headers.get("host", "")}
    base_url = conf.get("api", "base_url", fallback=None)
    if base_url:
        hosts.add(urlsplit(base_url).netloc)
    return {host.lower() for host in hosts if host}


def _refuse(reason: str) -> HTTPException:
    return HTTPException(
        status_code=status.HTTP_403_FORBIDDEN,
        detail=f"refused as a possible cross-site request: {reason} (reload the page and "
        "submit its form again)",
    )


def check(request: Request, user: Any, submitted: object) -> None:
    """Refuse (403) a cookie-authenticated request that is not proven to come from one of
    our pages: ``submitted`` is the token it carried (form field or header)."""
    if not uses_the_cookie(request):
        return
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        raise _refuse("the browser says it comes from another site")
    origin = request.headers.get("origin")
    if origin is not None and urlsplit(origin).netloc.lower() not in _own_hosts(request):
        raise _refuse(f"it comes from {origin}")
    if not _valid(user, submitted):
        raise _refuse(f"no valid {FIELD} form field or {HEADER} header")
