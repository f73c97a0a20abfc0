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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bnrecal.workers.data.opened import DecodedData
from bnrecal.workers.data.storage.files import Place
from bnrecal.workers.data.storage.objectstore import RemoteSource, remote_error
from bnrecal.workers.data.formats.transform import ImageTransform, decode_image, normalize
from bnrecal.errors import DatasetError

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
    """Whether a path component marks a hidden or archiver-junk entry that is never read."""
    return part.startswith(".") or part == "__MACOSX"


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
