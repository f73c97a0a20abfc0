"""MDS shards as MosaicML Streaming writes them: ``streaming.MDSWriter`` itself, run in a
process of its own from ``.streaming-writer/`` (``make test`` installs it there: Streaming's
pins conflict with the project's numpy and transformers, see the Makefile).

The photos of :mod:`tests.shards` go in as the column encoding asked for: ``bytes`` (the
JPEG file's bytes), ``jpeg`` (a ``PIL`` image opened from the file, which Streaming stores as
that file's bytes), ``png`` (Streaming re-encodes the decoded pixels) or ``pil`` (the raw
pixels); a ``label`` column (``int``) unless ``labels`` is off; the shards' digests listed in
the index where ``hashes`` names algorithms. A set written in parts (``merge``) is one
subfolder per part, their indexes merged into one above them by Streaming's ``merge_index``,
as a dataset written by several processes or of several streams is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WRITER = REPO / ".streaming-writer"

_SCRIPT = """
import json, sys
from PIL import Image
from streaming import MDSWriter


def write(out, columns, job, extra, items):
    with MDSWriter(out=out, columns=columns, size_limit=job["size_limit"], **extra) as writer:
        for path, label in items:
            if job["encoding"] == "bytes":
                with open(path, "rb") as handle:
                    image = handle.read()
            else:
                image = Image.open(path)
                if job["encoding"] != "jpeg":
                    image = image.convert("RGB")
            writer.write({job["image_name"]: image, **({job["label_name"]: label} if job["labels"] else {})})


for job in json.loads(sys.argv[1]):
    columns = {job["image_name"]: job["encoding"]}
    if job["labels"]:
        columns[job["label_name"]] = "int"
    extra = {"compression": job["compression"]} if job["compression"] else {}
    if job["hashes"]:
        extra["hashes"] = job["hashes"]
    if job["parts"] == 1:
        write(job["out"], columns, job, extra, job["items"])
        continue
    size = -(-len(job["items"]) // job["parts"])  # contiguous parts, in order, one subfolder each
    for number in range(job["parts"]):
        write(f"{job['out']}/{number}", columns, job, extra, job["items"][number * size:(number + 1) * size])
    from streaming.base.util import merge_index
    merge_index(job["out"], keep_local=True)
"""


@dataclass(frozen=True)
class MdsSet:
    """One dataset to write: ``MDSWriter(out=folder, ...)`` of the photos in their order, the
    image column in ``encoding``, shards of at most ``size_limit`` bytes; ``hashes``: the
    digests its index lists; ``parts`` > 1: that many subfolders under one merged index."""

    folder: Path
    items: list[tuple[str, bytes, int]]
    encoding: str
    size_limit: int = 1 << 16
    labels: bool = True
    compression: str | None = None
    image_name: str = "image"
    label_name: str = "label"
    hashes: tuple[str, ...] = ()
    parts: int = 1


def write_mds(*sets: MdsSet) -> list[Path]:
    """Write each set (``folder/index.json`` and its shards) in one process of Streaming's
    (its import takes seconds); their folders."""
    if not (WRITER / ".installed").is_file():
        raise RuntimeError(f"MosaicML Streaming's writer is not installed in {WRITER}: run make test (or make check)")
    jobs = []
    for one in sets:
        files = one.folder.parent / f"{one.folder.name}-files"
        files.mkdir(parents=True, exist_ok=True)
        listed = []
        for name, data, label in one.items:
            (files / f"{name}.jpg").write_bytes(data)
            listed.append((str(files / f"{name}.jpg"), label))
        jobs.append({"out": str(one.folder), "encoding": one.encoding, "labels": one.labels,
                     "size_limit": one.size_limit, "compression": one.compression, "items": listed,
                     "image_name": one.image_name, "label_name": one.label_name, "hashes": list(one.hashes),
                     "parts": one.parts})
    env = {**os.environ, "PYTHONPATH": str(WRITER)}
    subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(jobs)], check=True, env=env, timeout=300)
    return [one.folder for one in sets]
