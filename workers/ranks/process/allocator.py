"""How a rank process's C allocator treats the large tensors of a pass.

Every step of a pass allocates and frees the same large activations (resnet18 at batch
32: 100 MB tensors, several GB per step). With glibc's defaults each of them is a fresh
``mmap``, so the kernel zeroes every page on first touch and unmaps it on free: on this
project's machines a plain channels-last eval forward spends a quarter of its CPU time
in the kernel that way (1.7 million page faults over 512 samples). A rank instead keeps
freed memory in its heap while a pass runs, so the next step reuses pages that are
already mapped, and hands it back to the system when the job ends.

These are environment variables because glibc reads them once, when the process
starts: the ranks are started with them (``RANK_ENV_VARS`` in the actor's Ray runtime
environment). Other allocators ignore them, and ``release_free_memory`` does nothing
where glibc is not the allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

RANK_ENV_VARS = {
    # One arena: the pass runs on a worker thread, and a thread arena's heaps are 64 MiB,
    # too small for a batch's activations, which would then be mmap'd after all.
    "MALLOC_ARENA_MAX": "1",
    # Serve allocations of any size from the heap, not from mmap ...
    "MALLOC_MMAP_THRESHOLD_": str(1 << 40),
    # ... and keep freed memory there during the pass (released by release_free_memory).
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
}
"""Environment of a rank process: glibc malloc keeps a pass's large tensors mapped."""


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing kept to release
        return None


def release_free_memory() -> bool:
    """Give the memory a finished job freed back to the system (glibc ``malloc_trim``),
    so a warm rank waiting for its next job holds only what it uses; False where the
    allocator has no such call."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
