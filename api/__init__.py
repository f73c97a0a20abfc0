"""The bnrecal HTTP API: the app factory, thin FastAPI routers and their dependencies."""

from __future__ import annotations

from api.app import create_app
from api.deps import ServicesDep, TenantDep, get_services, get_tenant
from api.limits import BodySizeLimit
from api.problems import Problem, install_problem_handlers, problem_response
from api.routes import blobs, health, jobs

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
