import os
import subprocess
import sys
import textwrap

from bnrecal.workers.ranks.process.allocator import RANK_ENV_VARS

PROBE = textwrap.dedent(
    """
    import resource, threading
    import torch
    from bnrecal.workers.ranks.process.allocator import release_free_memory

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    def step():  # a pass's pattern: large activations allocated and freed on a worker thread
        for _ in range(3):
            x = torch.ones(50_000_000)
            del x

    def passes(n):
        for _ in range(n):
            thread = threading.Thread(target=step)
            thread.start()
            thread.join()

    base = rss()
    passes(2)  # the heap grows to what a pass needs (how often it maps varies with the run)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    passes(4)  # then the next passes reuse it
    refaults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    kept = rss() - base
    released = release_free_memory()
    print(refaults, kept, rss() - base, released)
    """
)


def probe(env):
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    return [int(v) if v.lstrip("-").isdigit() else v for v in done.stdout.split()]


def test_rank_environment_keeps_a_pass_mapped_and_gives_it_back_after():
    refaults, kept, after, released = probe(RANK_ENV_VARS)
    assert released == "True"
    assert refaults < 5 * 49_000  # once grown, the heap is reused (200 MB is ~49,000 pages; 12 anew without)
    assert kept > 150_000_000
    assert after < 50_000_000


def test_default_environment_maps_every_activation_anew():
    # What the rank's environment changes: without it each 200 MB tensor is a new mapping.
    refaults, kept, _, _ = probe({name: "" for name in RANK_ENV_VARS})
    assert refaults > 11 * 49_000  # 12 tensors
    assert kept < 50_000_000
