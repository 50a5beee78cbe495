"""Who may read the budget UI, and who may administer the ledger through it.

Airflow mounts plugin FastAPI apps without any authentication, so every route of ours
depends on :func:`budget_reader`: the caller must be an authenticated Airflow user
(a Bearer token, or the UI's ``_token`` cookie, which is how the page shown inside the
Airflow UI is authenticated) whom the configured auth manager allows to read the custom
view ``DP Budget``. Unauthenticated callers get 401 (403 for an invalid token), users
without the permission 403, and none of them any data.

With the simple auth manager every role may read it; with FAB or Keycloak, grant
``GET`` (FAB: ``can_read``) on the custom resource ``DP Budget``.

Administering (setting a policy, clearing a quarantine, opening a refusal reference) is
``PUT`` on the same custom view (FAB: ``can_edit`` on ``DP Budget``): :func:`budget_admin`.
Airflow 3.3's simple auth manager answers every custom-view question as a ``GET``, so
there every role that may read could administer; it fails closed instead: with the simple
auth manager only its ``ADMIN`` role administers.
"""

from __future__ import annotations

from typing import Any

from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.models.base_user import BaseUser
from airflow.api_fastapi.core_api.security import GetUserDep
from fastapi import HTTPException, Request, status

RESOURCE_NAME = "DP Budget"
# The custom-view method an administrator's act needs (FAB: can_edit).
ADMIN_METHOD = "PUT"


def budget_reader(request: Request, user: GetUserDep) -> BaseUser:
    """The authenticated user, if the auth manager lets them read the budget view.

    The user is kept on the request, so that pages can offer an administrator the
    administrator's controls (:func:`may_administer`) without asking again who it is.
    """
    allowed = get_auth_manager().is_authorized_custom_view(
        method="GET", resource_name=RESOURCE_NAME, user=user
    )
    if not allowed:
        raise HTTPException(
            status_code=status.HTTP_403_FORBIDDEN,
            detail=f"not allowed to read the {RESOURCE_NAME} view",
        )
    request.state.dp_budget_user = user
    return user


def may_administer(user: Any) -> bool:
    """Whether ``user`` may do an administrator's acts through the UI."""
    manager = get_auth_manager()
    if not manager.is_authorized_custom_view(
        method=ADMIN_METHOD, resource_name=RESOURCE_NAME, user=user
    ):
        return False
    return _simple_admin(user) if _ignores_the_method(manager) else True


def _ignores_the_method(manager: Any) -> bool:
    """The simple auth manager decides custom views by role alone, as a read."""
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

    return isinstance(manager, SimpleAuthManager)


def _simple_admin(user: Any) -> bool:
    role = getattr(user, "role", None)
    return isinstance(role, str) and role.upper() == "ADMIN"


def budget_admin(request: Request, user: GetUserDep) -> BaseUser:
    """The authenticated user, if they may administer the ledger through the UI (403
    otherwise: a reader sees no administrator's controls and cannot use them)."""
    if not may_administer(user):
        raise HTTPException(
            status_code=status.HTTP_403_FORBIDDEN,
            detail=f"administering the ledger needs {ADMIN_METHOD} on the {RESOURCE_NAME} view "
            "(FAB: can_edit; the simple auth manager: the ADMIN role)",
        )
    return user
