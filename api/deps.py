"""Dependencies of the routes: the running services and the caller's tenant."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from bnrecal.service.jobserver.server import PUBLIC_TENANT, Services, tenant_of_key
from bnrecal.errors import AuthenticationError, RunError

bearer_scheme = HTTPBearer(auto_error=False, description="An API key from BNRECAL_API_KEYS.")


def get_services(request: Request) -> Services:
    """The services the app's lifespan opened."""
    services = getattr(request.app.state, "services", None)
    if services is None:
        raise RunError("the service is not started yet")
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


def get_tenant(
    services: ServicesDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> str:
    """The tenant of the request's API key (each key is its own tenant); 401 without a valid key.

    A server with no ``BNRECAL_API_KEYS`` serves everyone as one tenant.
    """
    keys = services.settings.api_keys
    if not keys:
        return PUBLIC_TENANT
    if credentials is None:
        raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
    offered = credentials.credentials.encode()
    matched = None
    for key in keys:  # compare with every key, in constant time, so timing reveals nothing
        if hmac.compare_digest(offered, key.encode()):
            matched = key
    if matched is None:
        raise AuthenticationError("invalid API key")
    return tenant_of_key(matched)


TenantDep = Annotated[str, Depends(get_tenant)]
