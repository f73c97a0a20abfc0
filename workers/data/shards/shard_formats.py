"""The formats a dataset of shards can be: the formats' own :class:`ShardFormat` entries, each
declared in its format's module (WebDataset tars in ``webdataset``, Parquet and Arrow in
``columnar``, MosaicML Streaming's MDS in ``mds``), saying how it finds its shards in a file or
folder, how one shard is counted when the data is described and how a rank opens it.

A new format of shards is its entry in its module and its place in :data:`SHARD_FORMATS` (the
order ``detection`` shows a file or folder to each format's ``find``); lists, patterns,
manifests, folders of shard files, the order, the ranks' reads, read-once keeping, shipping
and the report's data summary are the shards' own.
"""

from __future__ import annotations

from bnrecal.workers.data.formats.columnar import ARROW_SHARDS, PARQUET_SHARDS
from bnrecal.workers.data.formats.mds import MDS
from bnrecal.workers.data.formats.webdataset import WEBDATASET
from bnrecal.workers.data.opened import ShardFormat

SHARD_FORMATS: tuple[ShardFormat, ...] = (WEBDATASET, PARQUET_SHARDS, ARROW_SHARDS, MDS)
"""Every format of shards, by the name a dataset's description and its report give it."""

_BY_NAME = {shard_format.name: shard_format for shard_format in SHARD_FORMATS}


def shard_format(name: str) -> ShardFormat:
    """The format of shards named ``name`` (one of :data:`SHARD_FORMATS`)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"no format of shards is named {name!r} (known: {', '.join(_BY_NAME)})") from None


def columned(conjunction: str) -> str:
    """The formats of shards whose samples sit in named columns, as messages name them
    (``"Parquet, Arrow and MDS"``): where ``image_column`` and ``label_column`` apply."""
    shown = [shard_format.shown for shard_format in SHARD_FORMATS if shard_format.columns]
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} {conjunction} {shown[-1]}"
