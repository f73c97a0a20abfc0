"""The routers of the HTTP API (health and metrics, blobs, jobs) and of the web page."""

from __future__ import annotations

from bnrecal.api.routes import blobs, health, jobs, pages

__all__ = ["blobs", "health", "jobs", "pages"]
