"""The job ledger (``ledger.py``), its SQL table (``table.py``) and its database engines,
SQLite or PostgreSQL (``engines.py``)."""

from bnrecal.service.jobserver.ledger.ledger import (
    INTERRUPTED, MAX_ATTEMPTS, Ledger, outcome_values, sqlite_url, start_values,
)
from bnrecal.service.jobserver.ledger.table import JobRow

__all__ = ["INTERRUPTED", "MAX_ATTEMPTS", "JobRow", "Ledger", "outcome_values", "sqlite_url", "start_values"]
