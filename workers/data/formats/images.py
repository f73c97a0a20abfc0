"""Image-folder calibration data: which files count, in which order, with which labels.

Layout rules (documented for users):

- Image files are ``.jpg``, ``.jpeg``, ``.png``, ``.webp`` and ``.bmp`` (any case); other
  files are ignored, and so are hidden entries (name starting with ``.``) and
  ``__MACOSX`` folders, which archivers add as junk.
- Samples are taken in sorted order of their relative POSIX path (plain string order).
- Either every image lies at the top level (no labels), or every image lies in a class
  folder: the top-level folders are the classes, in sorted order. Images nested deeper
  inside a class folder belong to that class (flattened, as torchvision's ImageFolder
  does). Images both at the top level and in folders are refused as ambiguous.
- A top level holding no image and a single folder is a wrapper (``calib/...`` in an
  archive) and is descended into; a lone class folder is therefore not a class.
- Symbolic links to files are read; symbolic links to folders are not followed.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from bnrecal.workers.data.opened import DecodedData, Described, FormatDescription
from bnrecal.workers.data.order import Sampling
from bnrecal.workers.data.storage.files import Place
from bnrecal.workers.data.storage.objectstore import RemoteSource, remote_error
from bnrecal.workers.data.formats.transform import (
    ImageTransform, check_image_header, decode_image, normalize, resolve_transform,
)
from bnrecal.errors import DatasetError

if TYPE_CHECKING:
    from bnrecal.workers.data.summary import DatasetSummary

IMAGE_EXTENSIONS: tuple[str, ...] = (".bmp", ".jpeg", ".jpg", ".png", ".webp")


@dataclass(frozen=True)
class ImageListing:
    """The images of a folder: effective root, sorted relative paths, classes and labels."""

    root: Path
    files: tuple[str, ...]
    classes: tuple[str, ...]
    labels: tuple[int, ...]  # class index per file; -1 everywhere when there are no classes


def is_image_name(name: str) -> bool:
    """Whether a file name has an image extension (case-insensitive)."""
    return name.lower().endswith(IMAGE_EXTENSIONS)


def is_ignored_part(part: str) -> bool:
    """Whether a path component marks a hidden or archiver-junk entry that is never read
    (``.`` is not one: ``tar -cf x.tar .`` names every member ``./NAME``)."""
    return (part.startswith(".") and part != ".") or part == "__MACOSX"


def list_images(directory: Path, *, strip_wrappers: bool = True, shown: str | None = None) -> ImageListing:
    """List the images of ``directory`` by the layout rules of this module.

    Raises :class:`DatasetError` when no image is found or when the layout is ambiguous,
    calling the folder ``shown`` (the name the user knows: an archive's, where the folder
    is its unpack named by digest), else the folder's own name.
    """
    root = _strip_wrappers(directory) if strip_wrappers else directory
    files: list[str] = []
    for current, dirnames, filenames in os.walk(root, onerror=_raise_walk_error):
        dirnames[:] = [d for d in dirnames if not is_ignored_part(d)]
        relative = Path(current).relative_to(root).as_posix()
        prefix = "" if relative == "." else relative + "/"
        files.extend(prefix + f for f in filenames if is_image_name(f) and not is_ignored_part(f))
    return listing_of(root, files, shown or directory.name or str(directory))


def listing_of(root: Path, files: Sequence[str], shown: str) -> ImageListing:
    """Apply the ordering and class-folder rules to the image files (relative POSIX paths)
    found under ``root``; ``shown`` names the folder in errors. Shared by local folders
    and object-storage prefixes, so both give the same samples in the same order."""
    files = sorted(files)
    if not files:
        raise DatasetError(f"no images found in {shown} (looked for {', '.join(IMAGE_EXTENSIONS)})")
    top_level = [f for f in files if "/" not in f]
    nested = [f for f in files if "/" in f]
    if top_level and nested:
        raise DatasetError(
            f"image {top_level[0]} lies beside class folder {nested[0].split('/')[0]}/; "
            "put every image in a class folder, or none"
        )
    if top_level:
        return ImageListing(root, tuple(files), (), (-1,) * len(files))
    classes = tuple(sorted({f.split("/", 1)[0] for f in files}))
    index = {name: i for i, name in enumerate(classes)}
    labels = tuple(index[f.split("/", 1)[0]] for f in files)
    return ImageListing(root, tuple(files), classes, labels)


def files_digest(files: Sequence[str]) -> str:
    """A digest of the sample file list, so an actor can tell that the folder changed."""
    digest = hashlib.sha256()
    for name in files:
        digest.update(name.encode("utf-8", "surrogateescape") + b"\0")
    return digest.hexdigest()


def _strip_wrappers(directory: Path) -> Path:
    root = directory
    while True:
        try:
            entries = [e for e in os.scandir(root) if not is_ignored_part(e.name)]
        except OSError as exc:
            raise DatasetError(f"cannot list {root.name or root}: {exc.strerror}") from exc
        folders = [e for e in entries if e.is_dir(follow_symlinks=False)]
        has_images = any(is_image_name(e.name) and not e.is_dir() for e in entries)
        if has_images or len(folders) != 1:
            return root
        root = Path(folders[0].path)


def _raise_walk_error(exc: OSError) -> None:
    raise DatasetError(f"cannot list {Path(exc.filename or '').name}: {exc.strerror}") from exc


def list_remote_images(source: RemoteSource, role: str) -> ImageListing:
    """The images under a prefix, by the same rules (and in the same order) as a local folder,
    wrapper folders included."""
    fs = source.filesystem()
    try:
        found = fs.find(source.key)
    except Exception as exc:  # noqa: BLE001
        raise remote_error(exc, source, role) from exc
    base = source.key + "/"
    names = [path[len(base):] for path in found if path.startswith(base)]
    names = [n for n in names if not any(is_ignored_part(p) for p in n.split("/"))]
    root = source.key
    while True:  # a top level of no image and a single folder is a wrapper
        top_files = [n for n in names if "/" not in n]
        folders = {n.split("/", 1)[0] for n in names if "/" in n}
        if any(is_image_name(n) for n in top_files) or len(folders) != 1:
            break
        (folder,) = folders
        root = f"{root}/{folder}"
        names = [n[len(folder) + 1:] for n in names if n.startswith(folder + "/")]
    return listing_of(Path(root), [n for n in names if is_image_name(n)], source.name or source.uri)


def describe_images(
    place: Place, transform: Mapping[str, Any] | None, sampling: Sampling, role: str, check_headers: bool,
) -> FormatDescription:
    """An image folder or prefix described: its listing (by the rules above), the images taken
    by ``sampling``, and, where asked for a local folder, each one's header read so that a
    broken file fails here, naming it, rather than in a rank."""
    resolved = resolve_transform(transform)
    remote = place.remote
    listing = list_remote_images(remote, role) if remote is not None else list_images(Path(place.location), shown=place.shown)
    files = tuple(listing.files[i] for i in sampling.rows(len(listing.files)).tolist())
    if check_headers and remote is None:
        for name in files:
            check_image_header(listing.root / name, name)
    part = ImagePart(resolved, listing.classes, files_digest(files), files_digest(listing.files))
    path = place.location if remote is not None else str(listing.root)
    return FormatDescription(part, path, len(listing.files), len(files), resolved.sample_shape)


class ImageData(DecodedData):
    """Images decoded and transformed on each ``load`` (so DataLoader workers can do it ahead),
    read through their ``place`` (:class:`~workers.data.storage.files.Place`): files under a
    local folder, or objects under an S3 prefix fetched concurrently, only those requested."""

    def __init__(
        self,
        place: Place,
        files: Sequence[str],
        transform: ImageTransform,
        *,
        classes: Sequence[str] = (),
        labels: Sequence[int] = (),
    ) -> None:
        self.place = place
        self.files = tuple(files)
        self.transform = transform
        self.classes = tuple(classes)
        self.labels = tuple(labels) if labels else (-1,) * len(self.files)
        self.sample_shape = transform.sample_shape

    def __len__(self) -> int:
        return len(self.files)

    @property
    def decodes(self) -> bool:
        """Image decoding is CPU-heavy: worth DataLoader workers."""
        return True

    def load_kept(self, start: int, stop: int) -> torch.Tensor:
        """Decode, resize and crop images ``[start, stop)`` to uint8 (``load`` normalises them);
        a broken file raises a DatasetError naming it."""
        self._check_range(start, stop)
        if start == stop:
            return self._empty().to(torch.uint8)
        return torch.stack([decode_image(io.BytesIO(data), name, self.transform) for name, data in self.encoded(start, stop)])  # type: ignore[arg-type]

    def from_kept(self, kept: torch.Tensor) -> torch.Tensor:
        """uint8 crops scaled and normalised by the transform."""
        return normalize(kept, self.transform)

    def encoded(self, start: int, stop: int) -> list[tuple[str, bytes]]:
        """The image files' bytes ``[start, stop)``, named as in messages."""
        self._check_range(start, stop)
        names = self.files[start:stop]
        return list(zip(names, self.place.read_files(names)))


@dataclass(frozen=True)
class ImagePart:
    """An image folder's (or prefix's) part of a dataset's description: the resolved
    ``transform``, the class folders' names (label = index), and the digests of the sample
    files (``files_digest``) and of the whole listing in file order (``listing_digest``), so
    a rank can tell that the folder changed since it was described."""

    transform: ImageTransform
    classes: tuple[str, ...]
    files_digest: str | None
    listing_digest: str
    kind: ClassVar[str] = "images"

    def open(self, described: Described) -> ImageData:
        """The images at the description's positions, listed again and checked against the digest."""
        listing = self._listing(described, "calibration data")
        files, labels = self._at_positions(listing, described)
        if files is None or files_digest(files) != self.files_digest:
            where = "prefix" if described.place.remote is not None else "folder"
            raise DatasetError(f"image {where} {self._shown(described)} changed since it was described")
        return ImageData(self._root(listing, described), files, self.transform, classes=listing.classes, labels=labels)

    def summarise(self, summary: DatasetSummary) -> DatasetSummary:
        """The transform and the number of classes."""
        return replace(summary, transform=self.transform, classes=len(self.classes))

    def labels(self, described: Described) -> np.ndarray | None:
        """The class folder of each sample (sorted names, index = position, as torchvision's
        ImageFolder); None for images without class folders."""
        if not self.classes:
            return None
        listing = self._listing(described, "evaluation data")
        return np.asarray(listing.labels, dtype=np.int64)[described.sample_rows()]

    def same_samples(self) -> ImagePart:
        """Without the sample files' digest: the listing's says which files there are."""
        return replace(self, files_digest=None)

    @staticmethod
    def _listing(described: Described, role: str) -> ImageListing:
        remote = described.place.remote
        if remote is not None:
            return list_remote_images(remote, role)
        return list_images(Path(described.place.location), strip_wrappers=False, shown=described.display_name)

    @staticmethod
    def _root(listing: ImageListing, described: Described) -> Place:
        """Where the listed files lie: the folder, or the prefix with its wrapper folders."""
        place = described.place
        if place.remote is None:
            return place
        scheme = place.location.split("://", 1)[0]
        return Place(f"{scheme}://{listing.root.as_posix()}", place.endpoint_url)

    @staticmethod
    def _shown(described: Described) -> str:
        return described.place.location if described.place.remote is not None else described.display_name

    @staticmethod
    def _at_positions(
        listing: ImageListing, described: Described
    ) -> tuple[tuple[str, ...] | None, tuple[int, ...]]:
        """The listed images (and labels) at the sample positions, None when the listing no
        longer has the described number of images."""
        if len(listing.files) != described.total_samples:
            return None, ()
        rows = described.sample_rows().tolist()
        return tuple(listing.files[i] for i in rows), tuple(listing.labels[i] for i in rows)
