"""What the fair order costs to read: one rank's pass over its shard in the seeded
``shuffled`` order against file order (``given``), per storage, paired.

For each storage the two orders are read in turn (given, shuffled, given, ...) and the
ratio shuffled / given is taken pair by pair, so a machine whose speed drifts (a shared
one) moves both alike; the median ratio is printed beside the median times. Storages:
``.npy`` memory-mapped (page cache warm), an uncompressed ``.npz`` member, a compressed
``.npz`` member (streamed: each step's rows are one forward pass over the member), an image
folder of PNGs (decoded and transformed), and ``.npy`` in S3-compatible storage (a local moto
server): shuffled rows coalesced into ranged reads fetched concurrently, and, for
comparison, one request per row (``--no-coalesce`` off by default).

    PYTHONPATH=. .venv/bin/python bench/read_order.py [--samples 8192] [--batch 64] [--pairs 5]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from bnrecal.workers.data import DataAccess, ReadOptions, describe_dataset, iter_batches
from bnrecal.workers.data.formats import arrays as objectstore_arrays
from bnrecal.workers.ranks.sharding import rank_ranges


def read_pass(spec_for: Callable[[str], object], order: str, batch: int, workers: int) -> float:
    """Seconds rank 0 takes to read every batch of its shard in ``order``."""
    spec = spec_for(order)
    ranges = rank_ranges(spec.num_samples, batch, workers, 0)  # type: ignore[attr-defined]
    started = time.perf_counter()
    with spec.open() as data:  # type: ignore[attr-defined]
        for _ in iter_batches(data, ranges):
            pass
    return time.perf_counter() - started


def paired(name: str, spec_for: Callable[[str], object], args: argparse.Namespace) -> None:
    read_pass(spec_for, "given", args.batch, args.workers)  # warm-up: page cache, imports, connections
    given, shuffled, ratios = [], [], []
    for _ in range(args.pairs):
        g = read_pass(spec_for, "given", args.batch, args.workers)
        s = read_pass(spec_for, "shuffled", args.batch, args.workers)
        given.append(g)
        shuffled.append(s)
        ratios.append(s / g)
    print(f"| {name} | {statistics.median(given):.3f} | {statistics.median(shuffled):.3f} | "
          f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="ranks K: rank 0's shard is read")
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.samples, 3, 32, 32)).astype(np.float32)  # 12 KiB a sample
    with tempfile.TemporaryDirectory(prefix="bnrecal-read-order-") as folder:
        root = Path(folder)
        np.save(root / "x.npy", x)
        np.savez(root / "x.npz", x=x)
        np.savez_compressed(root / "small.npz", x=x[:1024])
        images = root / "images"
        for i in range(args.images):
            label = images / f"class{i % 10}"
            label.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(label / f"{i:05d}.png")
        transform = {"resize": 64, "crop": 56}
        print(f"rank 0 of K={args.workers}, global batch {args.batch}; {args.pairs} pairs; seconds are medians; "
              f"load average {os.getloadavg()[0]:.1f} at the start")
        print("| storage | given (s) | shuffled (s) | shuffled / given (min-max) |")
        print("|---|---|---|---|")
        paired(f".npy, {args.samples} x 12 KiB, page cache",
               lambda order: describe_dataset(root / "x.npy", ReadOptions(order=order)), args)
        paired(f".npz stored, {args.samples} x 12 KiB",
               lambda order: describe_dataset(root / "x.npz", ReadOptions(order=order)), args)
        paired(".npz compressed, 1024 x 12 KiB",
               lambda order: describe_dataset(root / "small.npz", ReadOptions(order=order)), args)
        paired(f"image folder, {args.images} PNG 64x64 (decode + transform)",
               lambda order: describe_dataset(images, ReadOptions(order=order, transform=transform)), args)
        bench_s3(x[:2048], args)


def bench_s3(x: np.ndarray, args: argparse.Namespace) -> None:
    """The same .npy in a local S3-compatible server: coalesced ranged reads, then one request a row."""
    from tests.s3 import FAKE_CREDENTIALS, start_s3_server

    os.environ.update(FAKE_CREDENTIALS)
    server, httpd = start_s3_server()
    try:
        buffer = io.BytesIO()
        np.save(buffer, x)
        uri = server.put("bench", "x.npy", buffer.getvalue())
        access = DataAccess(endpoint_url=server.endpoint)
        spec_for = lambda order: describe_dataset(uri, ReadOptions(order=order), access)  # noqa: E731
        paired(f"s3 .npy, {len(x)} x 12 KiB, coalesced ranges", spec_for, args)
        gap = objectstore_arrays.GATHER_GAP_BYTES
        objectstore_arrays.GATHER_GAP_BYTES = 0
        try:
            paired(f"s3 .npy, {len(x)} x 12 KiB, only adjacent rows merged", spec_for, args)
        finally:
            objectstore_arrays.GATHER_GAP_BYTES = gap
    finally:
        httpd.shutdown()


if __name__ == "__main__":
    main()
