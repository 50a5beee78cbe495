"""Who may read the budget UI.

Airflow mounts plugin FastAPI apps without any authentication, so every route of ours
depends on :func:`budget_reader`: the caller must be an authenticated Airflow user
(a Bearer token, or the UI's ``_token`` cookie, which is how the page shown inside the
Airflow UI is authenticated) whom the configured auth manager allows to read the custom
view ``DP Budget``. Unauthenticated callers get 401 (403 for an invalid token), users
without the permission 403, and none of them any data.

With the simple auth manager every role may read it; with FAB or Keycloak, grant
``GET`` (FAB: ``can_read``) on the custom resource ``DP Budget``.
"""

from __future__ import annotations

from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.models.base_user import BaseUser
from airflow.api_fastapi.core_api.security import GetUserDep
from fastapi import HTTPException, status

RESOURCE_NAME = "DP Budget"


def budget_reader(user: GetUserDep) -> BaseUser:
    """The authenticated user, if the auth manager lets them read the budget view."""
    allowed = get_auth_manager().is_authorized_custom_view(
        method="GET", resource_name=RESOURCE_NAME, user=user
    )
    if not allowed:
        raise HTTPException(
            status_code=status.HTTP_403_FORBIDDEN,
            detail=f"not allowed to read the {RESOURCE_NAME} view",
        )
    return user
