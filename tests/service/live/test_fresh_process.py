"""The issue's "done when", as a user runs it: a fresh Python process whose model class
lives in its own ``__main__``, recalibrated from a DataLoader of dict batches with
``forward=`` on 2 Ray workers (an embedded Ray it starts and shuts down itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = '''
import copy, json, os, sys
import ray, torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
import bnrecal
from tests.reference import assert_matches_reference, reference_statistics


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)
        self.bn = nn.BatchNorm2d(5)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(5, 3)
        self.bn_fc = nn.BatchNorm1d(3)

    def forward(self, x):
        return self.bn_fc(self.fc(self.drop(torch.relu(self.bn(self.conv(x)))).mean((2, 3))))


class Records(Dataset):
    def __init__(self, x):
        self.x = x

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return {"pixels": self.x[index], "name": f"sample-{index}"}


torch.manual_seed(0)
model = Net().eval()
with torch.no_grad():
    model.bn.running_mean.uniform_(-1, 1)
    model.bn.running_var.uniform_(0.5, 2)
x = torch.randn(26, 3, 8, 8) * 1.7 + 0.4
expected = reference_statistics(model, x, batch_size=6)
before = copy.deepcopy(model.state_dict())
report = bnrecal.recalibrate(model, DataLoader(Records(x), batch_size=6), workers=2,
                             forward=lambda net, batch: net(batch["pixels"]), progress=False)
assert_matches_reference(model, expected)
after = model.state_dict()
unchanged = [k for k, v in before.items() if k.split(".")[-1] not in ("running_mean", "running_var",
             "num_batches_tracked") and torch.equal(v, after[k])]
auth_env = {name: os.environ.get(name) for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE")}
json.dump({"report": report.to_dict(), "unchanged": unchanged, "ray_left_running": ray.is_initialized(),
           "auth_env": auth_env,
           "tracked": int(after["bn.num_batches_tracked"])}, sys.stdout)
'''


def test_a_main_module_class_on_two_ray_workers(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_TOKEN", None)
    env["RAY_AUTH_MODE"] = "disabled"  # the caller's own setting, given back after the call
    done = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(result["unchanged"]) == sorted(["conv.weight", "conv.bias", "bn.weight", "bn.bias", "fc.weight",
                                                  "fc.bias", "bn_fc.weight", "bn_fc.bias"])
    assert result["tracked"] == 5 and not result["ray_left_running"]
    # The embedded instance's token dies with it: a later ray.init(address=...) of the
    # script must not send its own cluster that token.
    assert result["auth_env"] == {"RAY_AUTH_TOKEN": None, "RAY_AUTH_MODE": "disabled"}
    report = result["report"]
    assert report["world_size"] == 2 and report["samples"] == 26 and len(set(report["nodes"])) == 1
    assert report["model"]["transport"] == "pickle" and report["embedded_cluster"] is True
