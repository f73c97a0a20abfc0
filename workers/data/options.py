"""The two option objects :func:`~workers.data.spec.describe_dataset` takes, each built once.

:class:`ReadOptions` says what to read and what to call it: the transform, how many samples
in which order, the columns of columnar data, and the names messages use. It changes with
every dataset a run reads (calibration data, evaluation data).
:class:`DataAccess` says how this process may reach and unpack data: where archives unpack
and the bounds they unpack under, the object-storage endpoint, whether image headers are
checked up front. A server builds it once from its settings
(:meth:`service.settings.Settings.data_access`) and hands the same one to every description.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from bnrecal.workers.data.formats.archive import (
    DEFAULT_MAX_COMPRESSION_RATIO,
    DEFAULT_MAX_MEMBERS,
    DEFAULT_MAX_UNPACKED_BYTES,
)
from bnrecal.workers.data.order import ORDERS, Sampling
from bnrecal.errors import DatasetOptionError


@dataclass(frozen=True)
class ReadOptions:
    """What to read of a dataset and what to call it.

    Checked when built: a bad ``max_samples``, ``order``, ``seed``, ``image_column`` or
    ``label_column`` raises :class:`DatasetOptionError` (a ``SpecError`` whose ``field``
    is the option's name). ``transform`` is checked against the data it applies to, when
    the dataset is described.
    """

    transform: Mapping[str, Any] | None = None
    """Image data: keys merged over the ImageNet preset (resize, crop, mean, std:
    ``workers.data.formats.transform``); None: the preset. Array data refuses a non-empty
    one: arrays are fed to the model as they are."""
    max_samples: int | None = None
    """Keep only the first this many samples of ``order`` (>= 1); None: every sample."""
    order: str = "given"
    """``given`` (the file or array order) or ``shuffled`` (seeded by ``seed``): the order the
    samples are taken in, so that a ``max_samples`` prefix is a uniform draw when shuffled
    (docs/calibration.md, "Order")."""
    seed: int = 0
    """The seed (>= 0) of the ``shuffled`` order: the driver and every rank compute the same order."""
    image_column: str | None = None
    """Parquet or Arrow data: the column of encoded images; None: ``image``, or the one column
    of image bytes (``workers.data.formats.columnar``)."""
    label_column: str | None = None
    """Parquet or Arrow data: the column of integer labels (read for evaluation only); None: ``label``."""
    columns_elsewhere: Literal["error", "ignore"] = "error"
    """What ``image_column``/``label_column`` do on data that is not columnar: ``error`` refuses
    them; ``ignore`` reads as if they were not given (options that name the columns of
    whichever of a run's datasets is columnar)."""
    role: str = "calibration data"
    """What messages call this data set (e.g. ``evaluation data``)."""
    name: str | None = None
    """What messages and the summary call the data instead of the file's own name (the name an
    uploaded blob came with, stored under its digest): only shown, never used to find or parse it."""

    def __post_init__(self) -> None:
        max_samples = self.max_samples
        if max_samples is not None and (
            isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 1
        ):
            raise DatasetOptionError(f"max_samples must be an integer >= 1, got {max_samples!r}", field="max_samples")
        if self.order not in ORDERS:
            raise DatasetOptionError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}", field="order")
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise DatasetOptionError(f"seed must be an integer >= 0, got {seed!r}", field="seed")
        for option in ("image_column", "label_column"):
            value = getattr(self, option)
            if value is not None and (not isinstance(value, str) or not value):
                raise DatasetOptionError(f"{option} must be a column name, got {value!r}", field=option)

    @property
    def sampling(self) -> Sampling:
        """Which samples are taken: the first ``max_samples`` of ``order`` (seeded)."""
        return Sampling(self.max_samples, self.order, self.seed)


@dataclass(frozen=True)
class DataAccess:
    """How this process may reach and unpack data: the same for every dataset it describes.

    The defaults are those of a process without settings: archives unpack under the user
    cache, within the bounds of ``workers.data.formats.archive``, and ``s3://`` data is read
    through the AWS environment's endpoint. The bounds are checked when an archive (or a
    compressed ``.npz``) is unpacked, as :func:`~workers.data.formats.archive.unpack_archive`
    checks them.
    """

    unpack_root: Path | None = None
    """The folder archives unpack under (``<unpack_root>/<sha256 of archive>``, reused by a
    later description of the same archive); its parent holds the shard-index cache
    (``shard-index/``). None: the user cache, ``default_unpack_root()``, read when used."""
    unpack_dir: Path | None = None
    """The exact folder to unpack an archive into instead of one under ``unpack_root``."""
    max_members: int = DEFAULT_MAX_MEMBERS
    """Most members an archive may hold."""
    max_unpacked_bytes: int = DEFAULT_MAX_UNPACKED_BYTES
    """Most bytes an archive, a compressed ``.npz`` member or a fetched object may unpack or download to."""
    max_compression_ratio: float = DEFAULT_MAX_COMPRESSION_RATIO
    """Most an archive member may expand (past its first MiB): more is a decompression bomb."""
    check_images: bool = True
    """Read the header of each kept image while describing, so that a broken file fails on
    the driver rather than in a rank."""
    endpoint_url: str | None = None
    """The object-storage endpoint of ``s3://`` data (e.g. a MinIO server); None: the AWS
    environment's (see ``workers.data.storage.objectstore``)."""

    def __post_init__(self) -> None:
        for folder in ("unpack_root", "unpack_dir"):
            value = getattr(self, folder)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, folder, Path(value))  # a str or any os.PathLike
