"""What a run reports about the data it used: one typed summary for every kind of data."""

from __future__ import annotations

from dataclasses import dataclass

from bnrecal.workers.data.formats.transform import ImageTransform


@dataclass(frozen=True)
class DatasetSummary:
    """Data as a run used it, for reports and logs (the report's ``data`` and
    ``evaluation.data``): its kind, the name the user knows it by, how many samples of how
    many, one sample's shape; the sample order (``seed`` only when shuffled) and a loader's
    number of steps; an array's storage, dtype and ``.npz`` member; images' transform and
    number of classes; shards' format, count and image column. None where the data has no
    such thing (the report leaves it out)."""

    kind: str
    source: str
    samples: int
    total_samples: int
    sample_shape: tuple[int, ...]
    steps: int | None = None
    order: str | None = None
    seed: int | None = None
    storage: str | None = None
    dtype: str | None = None
    array: str | None = None
    transform: ImageTransform | None = None
    classes: int | None = None
    format: str | None = None
    shards: int | None = None
    image_column: str | None = None
