"""The blob store: its interface and two backends side by side, re-exported here.

- :mod:`.store`: the :class:`BlobStore` protocol, all the rest of the server uses of a
  store, and the values that cross it (:class:`BlobInfo`, :class:`StoredBlob`, the digest
  pattern, :func:`is_digest`, :func:`clean_filename`, the file-name limit).
- :mod:`.files`: :class:`FileBlobStore`, blobs on the local disk (the default).
- :mod:`.s3`: :class:`S3BlobStore`, blobs in S3-compatible object storage with a local cache
  per replica (for a replicated service); :func:`parse_blob_store` reads its setting.
- :mod:`.opening`: :func:`open_blob_store` picks one from the settings.
- :mod:`.shared`: what both backends do the same way (layout, staging, digest checks).

Names are imported from their module on first use, so the HTTP client (which only needs
``MAX_FILENAME_CHARS`` and ``BlobInfo``) loads no backend, and the files backend never loads
the S3 one's dependencies.
"""

from __future__ import annotations

from bnrecal.workers.lazy import lazy_exports

_HOMES = {
    "store": (
        "DIGEST_PATTERN", "MAX_FILENAME_CHARS", "BlobInfo", "BlobStore", "CorruptHook", "StoredBlob", "WriteChunks",
        "clean_filename", "is_digest",
    ),
    "files": ("FileBlobStore",),
    "s3": ("S3BlobStore", "parse_blob_store"),
    "opening": ("open_blob_store",),
}
__getattr__, __all__ = lazy_exports(__name__, _HOMES)
