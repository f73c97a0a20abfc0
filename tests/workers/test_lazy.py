"""``workers.lazy``: a public name's modules import on first use, with the cyclic garbage
collector held off meanwhile and left as the user had it, on or off (a guest in the user's
process). Run in a fresh Python, where the modules are not imported yet."""

from __future__ import annotations

import json
import subprocess
import sys

FIRST_USES = """
import gc, json
import torch  # the user's process holds torch: a full collection there is what costs
import bnrecal

gc.disable()  # the user's own choice
bnrecal.recalibrate
off_after = gc.isenabled()

gc.enable()
collections = []
gc.callbacks.append(lambda phase, info: collections.append(info["generation"]) if phase == "start" else None)
bnrecal.BnrecalClient  # modules not imported yet: httpx and the client
print(json.dumps({"off_after": off_after, "on_after": gc.isenabled(), "collections": collections}))
"""


def test_a_first_use_imports_with_no_collection_and_leaves_the_collector_as_it_was():
    done = subprocess.run([sys.executable, "-c", FIRST_USES], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert (seen["off_after"], seen["on_after"]) == (False, True)
    # none while the modules import (18 here without the hold; with torchvision imported and a model
    # built, recalibrate's import ran a full one of 0.17 s); at most a youngest-generation one after
    assert seen["collections"] in ([], [0]), seen["collections"]
