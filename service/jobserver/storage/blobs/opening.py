"""Which blob store a server or ``bnrecal gc`` opens: :func:`open_blob_store`, from the settings.

The S3 backend is imported only when the settings name a bucket, so a server on local files
(and ``bnrecal gc`` on its data directory) never loads s3fs or the data layer behind it.
"""

from __future__ import annotations

from pathlib import Path

from bnrecal.service.jobserver.storage.blobs.files import FileBlobStore
from bnrecal.service.jobserver.storage.blobs.store import BlobStore


def open_blob_store(blob_store: str | None, local_root: Path, endpoint_url: str | None = None) -> BlobStore:
    """The blob store the settings name: files under ``local_root`` (the default, a
    :class:`~.files.FileBlobStore`), or the bucket of ``BNRECAL_BLOB_STORE`` (an
    :class:`~.s3.S3BlobStore`) with ``local_root`` as this process's cache of it."""
    if not blob_store:
        return FileBlobStore(local_root)
    from bnrecal.service.jobserver.storage.blobs.s3 import S3BlobStore

    return S3BlobStore(blob_store, local_root, endpoint_url)
