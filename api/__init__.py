"""The bnrecal HTTP API: the app factory, thin FastAPI routers and their dependencies."""

from __future__ import annotations

from bnrecal.api.app import create_app
from bnrecal.api.deps import ServicesDep, TenantDep, get_services, get_tenant
from bnrecal.api.limits import BodySizeLimit
from bnrecal.api.problems import Problem, install_problem_handlers, problem_response
from bnrecal.api.routes import blobs, health, jobs

__all__ = [
    "BodySizeLimit",
    "Problem",
    "ServicesDep",
    "TenantDep",
    "blobs",
    "create_app",
    "get_services",
    "get_tenant",
    "health",
    "install_problem_handlers",
    "jobs",
    "problem_response",
]
