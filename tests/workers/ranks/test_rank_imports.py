"""A rank process pays only for what its job uses: loading the rank actor's code imports
torch, Ray and numpy, not torchvision (1.3 s on its own, as it imports ``torch._dynamo``),
which only image data or a torchvision model needs. Each rank of every K > 1 run starts
by importing this, so it sits on the critical path of every embedded run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[3]


def test_loading_the_rank_actor_imports_no_torchvision():
    heavy = ("torchvision", "transformers", "timm", "onnx", "onnxruntime")
    code = f"import sys, bnrecal.workers.ranks.process.actor; print(sorted(m for m in sys.modules if m.split('.')[0] in {heavy}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
