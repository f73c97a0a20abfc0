"""The routers of the HTTP API: health and metrics, blobs, jobs."""

from __future__ import annotations

from api.routes import blobs, health, jobs

__all__ = ["blobs", "health", "jobs"]
