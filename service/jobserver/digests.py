"""How the service names stored bytes: by their SHA-256, ``sha256:<64 hex digits>``, the same in
the job spec (which names blobs) and in the blob stores (which keep them)."""

DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
"""A blob's name: ``sha256:`` and the 64 lowercase hex digits of its bytes' SHA-256."""
