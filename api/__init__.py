"""Thin FastAPI routers and dependencies of the bnrecal HTTP API."""
