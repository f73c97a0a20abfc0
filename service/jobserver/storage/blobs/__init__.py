"""The blob store, its two backends side by side behind one interface: local files
(:mod:`.files`, :class:`BlobStore`, the default and the interface) and S3-compatible object
storage (:mod:`.s3`, for a replicated service); :func:`open_blob_store` picks one from the
settings.

Names are imported from their backend on first use, so the files backend (and the HTTP
client, which only needs ``MAX_FILENAME_CHARS``) never loads the S3 one's dependencies.
"""

from __future__ import annotations

from bnrecal.workers.lazy import lazy_exports

_HOMES = {
    "files": ("DIGEST_PATTERN", "MAX_FILENAME_CHARS", "BlobInfo", "BlobStore", "StoredBlob", "WriteChunks", "clean_filename", "is_digest"),
    "s3": ("S3BlobStore", "open_blob_store", "parse_blob_store"),
}
__getattr__, __all__ = lazy_exports(__name__, _HOMES)
