"""Describe a calibration dataset once on the driver; open it in every actor from the description."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from bnrecal.workers.data.formats.archive import default_unpack_root, discard_unpack, unpack_archive
from bnrecal.workers.data.formats.arrays import ArrayPart, describe_arrays
from bnrecal.workers.data.formats.npy_layout import ArrayLayout
from bnrecal.workers.data.opened import CalibrationData, FormatDescription, FoundShards
from bnrecal.workers.data.options import DataAccess, ReadOptions
from bnrecal.workers.data.file_formats import EXPECTED, detect_format, format_named
from bnrecal.workers.data.shards.patterns import not_found, stat_data
from bnrecal.workers.data.formats.images import ImagePart, describe_images
from bnrecal.workers.data.reading.kept import KeepDecoded
from bnrecal.workers.data.storage.files import Place
from bnrecal.workers.data.storage.objectstore import RemoteSource, fetch_object, is_data_uri, parse_data_uri
from bnrecal.workers.data.order import order_rows
from bnrecal.workers.data.shards.dataset import ShardPart, ShardSet
from bnrecal.workers.data.shards.shard_formats import columned
from bnrecal.workers.data.summary import DatasetSummary
from bnrecal.workers.data.shards.listing import has_brace_pattern
from bnrecal.workers.data.shards.detection import describe_shards, is_shard_list, list_shards, local_shards, remote_shards
from bnrecal.workers.data.formats.transform import ImageTransform, resolve_transform
from bnrecal.errors import DatasetError, DatasetOptionError

DataPartOf = ArrayPart | ImagePart | ShardPart
"""The formats' parts a description holds (each format's module defines its own)."""


@dataclass(frozen=True)
class DatasetSpec:
    """What the driver learned about a dataset: small and picklable, sent to every actor.

    A header every dataset has, and ``part``, what its format adds (:class:`ArrayPart`: the
    array's layout; :class:`ImagePart`: the transform, classes and listing digests;
    :class:`ShardPart`: the shards and their transform), which opens the data, reads its
    labels and fills its summary. ``path`` is the ``.npy``/``.npz`` file or the image folder
    (after unpacking an archive), or their URI; ``remote`` says it lies in object storage and
    which endpoint reaches it; ``source`` is the path the user gave. ``num_samples`` counts
    after ``max_samples``, ``total_samples`` before. ``sample_shape`` is one sample as fed to
    the model (float32). ``name`` is what messages and reports call the data when that is not
    the file's own name (an uploaded blob is stored under its digest).
    """

    part: DataPartOf
    path: str
    num_samples: int
    sample_shape: tuple[int, ...]
    total_samples: int
    source: str
    name: str | None = None  # the name the user knows, where the file's is an internal one
    remote: RemoteSource | None = None  # data in object storage: ranks fetch their own samples from it
    order: str = "given"  # "shuffled" (seeded) or "given" (file order)
    seed: int = 0
    keep: KeepDecoded | None = None  # set by a run: its ranks keep what they decode for its later passes (workers.data.reading.kept)

    @property
    def kind(self) -> str:
        """``array``, ``images`` or ``shards``: the format's part's kind."""
        return self.part.kind

    @property
    def place(self) -> Place:
        """Where the data's own bytes live (a file or folder here, or an object or prefix)."""
        return Place(self.path, self.remote.endpoint_url if self.remote is not None else None)

    @property
    def transform(self) -> ImageTransform | None:
        """The image transform of image samples (a folder's, or the shards'); None for arrays."""
        return self.part.transform if not isinstance(self.part, ArrayPart) else None

    @property
    def layout(self) -> ArrayLayout | None:
        """An array file's layout; None for other data."""
        return self.part.layout if isinstance(self.part, ArrayPart) else None

    @property
    def shards(self) -> ShardSet | None:
        """A dataset of shards' shards; None for other data."""
        return self.part.shards if isinstance(self.part, ShardPart) else None

    @property
    def classes(self) -> tuple[str, ...]:
        """An image folder's class names (label = index); empty for other data."""
        return self.part.classes if isinstance(self.part, ImagePart) else ()

    def sample_rows(self) -> np.ndarray:
        """The file row (array row, or index in the sorted image listing) of each sample position."""
        return order_rows(self.total_samples, self.num_samples, self.order, self.seed)

    @property
    def display_name(self) -> str:
        """The data as the user named it: ``name``, else the source file's or folder's name."""
        return self.name or Path(self.source).name

    def open(self) -> CalibrationData:
        """Open the dataset for reading (inside the actor); only ``load`` reads sample data.
        Its format's part opens it, reading through the data's :class:`Place`."""
        return self.part.open(self)

    def labels(self) -> np.ndarray | None:
        """The class index of each sample (int64, in the samples' order), or None without labels."""
        return self.part.labels(self)

    def summary(self) -> DatasetSummary:
        """What reports and logs say about the data: its kind, name, counts, shape and order,
        and what its format adds (an array's layout, images' transform, the shards)."""
        summary = DatasetSummary(
            kind=self.kind, source=self.display_name, samples=self.num_samples, total_samples=self.total_samples,
            sample_shape=self.sample_shape, order=self.order, seed=self.seed if self.order == "shuffled" else None,
        )
        return self.part.summarise(summary)


def read_labels(spec: DatasetSpec) -> np.ndarray | None:
    """The class index of each of the dataset's samples (int64), or None when it has none.

    Labels follow the samples' order (``spec.order``). Image folders are labelled by their
    class folders (sorted names, index = position, as torchvision's ImageFolder); an ``.npz``
    by an integer array ``y`` of one label per row of ``x``. A ``y`` that does not fit ``x``
    is an error, never silently ignored. Shards are labelled by each sample's ``KEY.cls`` or
    the label column, and every sample must have one: evaluation shards without labels fail,
    naming what is missing. Labels are small (one integer per sample), so the driver reads
    them whole and hands each rank those of its own samples.
    """
    return spec.labels()


def describe_dataset(
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    read: ReadOptions = ReadOptions(),
    access: DataAccess = DataAccess(),
) -> DatasetSpec:
    """Validate and count a calibration dataset on the driver, unpacking an archive safely.

    ``read`` says what to read and what to call it (:class:`ReadOptions`: the transform, the
    samples kept and their order, the columns, the names in messages); ``access`` how this
    process may reach and unpack data (:class:`DataAccess`: where archives unpack and their
    bounds, the object-storage endpoint, whether image headers are checked), the same for
    every dataset a server describes. Both default to a process without settings.

    The format comes from the extension, or from the leading bytes for a file without a
    known one (an uploaded blob). The samples are taken in ``read.order`` (``shuffled`` with
    ``read.seed``, or ``given``: the file order, the default); ``read.max_samples`` keeps
    the first samples of that order; ``access.check_images`` reads the header of each kept
    image so a broken file fails here rather than in an actor. ``read.role`` names the data
    in messages (e.g. ``evaluation data``); ``read.name`` is what messages and the summary
    call it instead of the file's own name (only shown, never used to find or parse the file).
    Raises :class:`DatasetError` on any problem (bad options raise
    :class:`DatasetOptionError`, which is also a ``SpecError`` naming the field; ``read``'s
    own options are checked when it is built).
    A ``s3://`` URI is described from object storage (``access.endpoint_url`` overrides the AWS
    environment's endpoint); see :mod:`workers.data.storage.objectstore`. Shards (a list of shard
    paths or URIs, a brace pattern, a folder or prefix of shards, a manifest, a WebDataset
    tar, Parquet, a ``save_to_disk`` folder: :mod:`workers.data.shards.detection`) are counted
    here, each tar's index built and cached under the unpack root's parent folder
    (``shard-index/``); ``read.image_column``/``read.label_column`` name a Parquet or Arrow
    file's columns (data of another format refuses them, or with ``read.columns_elsewhere="ignore"``
    reads as if they were not given: options that name the columns of whichever data set is columnar).
    """
    role, name, endpoint_url = read.role, read.name, access.endpoint_url
    if is_shard_list(path):
        entries = list(path)  # type: ignore[arg-type]
        shown = Path(os.fspath(entries[0])).name + (f" and {len(entries) - 1} more shards" if len(entries) > 1 else "")
        found = list_shards(entries, role, endpoint_url, _index_cache(access))
        spec = _shard_spec(found, os.fspath(entries[0]), read, access)
        return replace(spec, name=name or shown)
    if not isinstance(path, (str, os.PathLike)):
        raise DatasetError(f"{role} must be a path, a URI or a list of shards, not {type(path).__name__}")
    if is_data_uri(path):
        remote = RemoteSource(parse_data_uri(str(path), "data"), endpoint_url)
        return _describe_remote(remote, read, access)
    source = Path(path).expanduser()
    if not source.exists() and not has_brace_pattern(str(path)):
        raise not_found(str(path), role)
    source = source.absolute()
    found = local_shards(source, name or source.name, role, endpoint_url, _index_cache(access))
    if found is not None:
        spec = _shard_spec(found, str(source), read, access)
        return spec if name is None else replace(spec, name=name)
    if (read.image_column is not None or read.label_column is not None) and read.columns_elsewhere == "error":
        raise DatasetOptionError(
            f"image_column and label_column apply to {columned('and')} shards; {name or source.name} is not",
            field="image_column" if read.image_column is not None else "label_column",
        )
    spec = _describe(source, read, access)
    return spec if name is None else replace(spec, name=name)


def _index_cache(access: DataAccess) -> Path:
    """Where shard indexes are cached: beside the unpack root (``shard-index/``)."""
    root = access.unpack_root if access.unpack_root is not None else default_unpack_root()
    return Path(root).expanduser().absolute().parent


def _describe(source: Path, read: ReadOptions, access: DataAccess) -> DatasetSpec:
    """:func:`describe_dataset` on an existing absolute path. Every error calls the data
    ``read.name`` where given (a blob is stored, and an archive unpacked, under its digest)."""
    shown = read.name or source.name
    try:
        if source.is_dir():
            return _spec(describe_images(Place(str(source), None, shown), read.transform, read.sampling, read.role,
                                         access.check_images), str(source), read)
        file_format = detect_format(source, read.role, read.name)
        if file_format.reads_as == "arrays":
            described = describe_arrays(Place(str(source), None, shown), file_format.name, source.stat().st_size,
                                        read.transform, read.sampling, read.role, **_npz_limits(access))
            return _spec(described, str(source), read)
        if file_format.reads_as == "shards":  # shards were told apart before: a file here is not one
            raise DatasetError(f"{shown} is not {file_format.name} data that can be read; expected {EXPECTED}")
        resolve_transform(read.transform)  # bad options fail before a long unpack
        folder = unpack_archive(
            source, file_format.name, access.unpack_dir, name=shown, unpack_root=access.unpack_root,
            max_members=access.max_members, max_unpacked_bytes=access.max_unpacked_bytes,
            max_compression_ratio=access.max_compression_ratio,
        )
        try:
            described = describe_images(Place(str(folder), None, shown), read.transform, read.sampling, read.role,
                                        access.check_images)
        except DatasetError:
            discard_unpack(folder)  # an archive whose content is bad keeps nothing on disk
            raise
        return _spec(described, str(source), read)
    except OSError as exc:
        raise DatasetError(f"cannot read {shown}: {exc.strerror or exc}") from exc


def _npz_limits(access: DataAccess) -> dict[str, int | float]:
    """The bounds a compressed ``.npz`` member is read within (the archives' own)."""
    return {"max_unpacked_bytes": access.max_unpacked_bytes, "max_compression_ratio": access.max_compression_ratio}


def _spec(described: FormatDescription, source: str, read: ReadOptions, remote: RemoteSource | None = None) -> DatasetSpec:
    """The dataset's description: its format's, under the header every dataset has."""
    return DatasetSpec(
        described.part, path=described.path, num_samples=described.num_samples, sample_shape=described.sample_shape,
        total_samples=described.total_samples, source=source, remote=remote, order=read.order, seed=read.seed,
    )


def _shard_spec(found: FoundShards, source: str, read: ReadOptions, access: DataAccess) -> DatasetSpec:
    """The description of a dataset of shards: every shard counted, the first sample read."""
    shards, transform, shape = describe_shards(
        found, transform=read.transform, image_column=read.image_column, label_column=read.label_column,
        endpoint_url=access.endpoint_url, cache_root=_index_cache(access), role=read.role,
        strict_columns=read.columns_elsewhere == "error",
    )
    remote = next((ref.location for ref in found.refs if ref.remote), None)
    described = FormatDescription(ShardPart(shards, transform), source, shards.total, read.sampling.kept(shards.total),
                                  shape)
    return _spec(described, source, read, RemoteSource(remote, access.endpoint_url) if remote is not None else None)


def _describe_remote(remote: RemoteSource, read: ReadOptions, access: DataAccess) -> DatasetSpec:
    """:func:`describe_dataset` for an object or prefix in object storage: arrays, image
    prefixes and shards stay there (each rank fetches its own samples), archives of images
    are fetched and unpacked."""
    role = read.role
    if has_brace_pattern(remote.uri):
        kind, size = "pattern", 0
    else:
        kind, size = stat_data(remote, role)
    found = remote_shards(remote, kind, role, _index_cache(access))
    if found is not None:
        return _shard_spec(found, remote.uri, read, access)
    if (read.image_column is not None or read.label_column is not None) and read.columns_elsewhere == "error":
        raise DatasetOptionError(
            f"image_column and label_column apply to {columned('and')} shards; {remote.uri} is not", field="image_column"
        )
    place = Place(remote.uri, remote.endpoint_url)
    if kind == "directory":
        return _spec(describe_images(place, read.transform, read.sampling, role, False), remote.uri, read, remote)
    file_format = format_named(remote.name)
    if file_format is None or file_format.reads_as == "shards":  # shards were told apart before
        raise DatasetError(f"unknown {role} format {remote.uri!r}; expected {EXPECTED}")
    if file_format.reads_as == "arrays":
        described = describe_arrays(place, file_format.name, size, read.transform, read.sampling, role, **_npz_limits(access))
        return _spec(described, remote.uri, read, remote)
    resolve_transform(read.transform)  # bad options fail before a long download
    root = access.unpack_root if access.unpack_root is not None else default_unpack_root()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=root) as staging:
        archive = fetch_object(remote, Path(staging) / remote.name, access.max_unpacked_bytes, role)
        # The fetched archive is a local file: no endpoint, and its images' headers are always checked.
        spec = describe_dataset(
            archive, ReadOptions(transform=read.transform, max_samples=read.max_samples, role=role, order=read.order,
                                 seed=read.seed),
            replace(access, check_images=True, endpoint_url=None),
        )
    return replace(spec, source=remote.uri)
