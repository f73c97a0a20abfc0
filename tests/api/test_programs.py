"""A torch.export program over HTTP, as a team with its own model would send it: the class
exists only in this test module (never on the server, the ranks, or an allowlist), exported
with a static batch of 1, calibrated by 2 ranks at batch 8. The recalibrated program and
its folded ONNX come back; crafted archives are refused at submission and run nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import ray
import torch
from torch import nn

from bnrecal.service.cli import main
from bnrecal.service.client import BnrecalClient
from tests.api.conftest import KEYS, submit, upload, wait_for
from tests.nets import perturbed
from tests.programs import buffers_as_modules, code_pickle, export_program, rewrite, rewrite_graph
from tests.reference import assert_matches_reference, in_contract_order, reference_statistics
from bnrecal.workers.programs import load_program

pytestmark = pytest.mark.usefixtures("ray_cluster")

KEY = "programs"


class TeamNet(nn.Module):
    """A team's own architecture: a stem, a depthwise block with BN called twice, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.SiLU())
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.norm(self.depthwise(x)) + x
        x = self.norm(torch.relu(x))
        return self.head(x.mean((2, 3)))


@pytest.fixture(scope="module")
def team(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, torch.Tensor, Path, Path]:
    torch.manual_seed(4)
    folder = tmp_path_factory.mktemp("team")
    model = perturbed(TeamNet()).eval()
    samples = torch.randn(30, 3, 9, 9) * 1.2 - 0.4
    np.save(folder / "calib.npy", samples.numpy())
    return model, samples, export_program(model, samples[:1], folder / "team.pt2"), folder / "calib.npy"


def test_a_program_recalibrates_over_http_to_its_models_statistics(live_server, team, tmp_path):
    model, samples, program, data = team
    with BnrecalClient(live_server.url, KEYS[KEY]) as client:  # the Python client, as a script would
        spec = {
            "program": client.upload(program).digest, "data": client.upload(data).digest,
            "workers": 2, "batch_size": 8, "outputs": ["program", "onnx"],
        }
        job = client.wait(client.submit(spec).id)
        assert job.status == "succeeded", job.error
        assert set(job.artifacts) == {"program", "onnx", "report", "report.html"}
        assert job.artifacts["program"].filename == "recalibrated.pt2"
        client.download(job.id, "program", tmp_path / "out.pt2")
        client.download(job.id, "onnx", tmp_path / "out.onnx")
    recalibrated = torch.export.load(tmp_path / "out.pt2")
    expected = reference_statistics(model, in_contract_order(samples), batch_size=8)
    assert_matches_reference(buffers_as_modules(load_program(tmp_path / "out.pt2")), expected)
    report = job.report
    assert report["program"]["name"] == "team.pt2" and report["collectives"] == 3 * 4  # norm runs twice a step
    assert [layer["name"] for layer in report["layers"]] == ["stem.1", "norm"]
    assert [layer["calls"] for layer in report["layers"]] == [4, 8]  # per job: 4 steps, norm twice in each
    eager = perturbed(TeamNet()).eval()
    eager.load_state_dict(recalibrated.state_dict)
    session = ort.InferenceSession(str(tmp_path / "out.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: samples[:1].numpy()})[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, eager(samples[:1]).numpy(), rtol=1e-4, atol=1e-4)


def test_default_outputs_are_the_program(live_server, team):
    _, _, program, data = team
    with live_server.client(KEY) as client:
        job = submit(client, {"program": upload(client, program), "data": upload(client, data), "max_samples": 4})
        assert job["spec"]["outputs"] == ["program"]
        finished = wait_for(client, job["id"])
    assert finished["status"] == "succeeded" and set(finished["artifacts"]) == {"program", "report", "report.html"}


def test_a_crafted_program_is_refused_at_submission_and_runs_nothing(live_server, team, tmp_path):
    _, _, program, data = team
    marker = tmp_path / "ran-code"
    pickled = rewrite(program, tmp_path / "a.pt2", lambda name, _: code_pickle(marker) if "sample_inputs" in name else None)

    def callable_node(document: dict) -> None:
        document["graph_module"]["graph"]["nodes"][0]["target"] = "torch.os.system"

    named = rewrite_graph(program, tmp_path / "b.pt2", callable_node)
    with live_server.client(KEY) as client:
        data_digest = upload(client, data)
        for crafted, detail in ((pickled, "weights-only"), (named, "arbitrary Python callable")):
            response = client.post("/v1/jobs", json={"program": upload(client, crafted), "data": data_digest})
            assert response.status_code == 422, response.text
            assert response.headers["content-type"] == "application/problem+json"
            problem = response.json()
            assert problem["field"] == "program" and detail in problem["detail"] and problem["type"].endswith("/program")
    assert not marker.exists()


@pytest.mark.parametrize(
    ("change", "field"),
    [({"arch": "torchvision:resnet18"}, "arch"), ({"outputs": ["checkpoint"]}, "outputs"),
     ({"model_kwargs": {"num_classes": 3}}, "model_kwargs")],
)
def test_a_program_spec_with_architecture_fields_is_422(live_server, team, change, field):
    _, _, program, data = team
    with live_server.client(KEY) as client:
        spec = {"program": upload(client, program), "data": upload(client, data)} | change
        response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 422 and response.json()["field"] == field


def test_submit_and_calibrate_take_a_program(live_server, team, tmp_path, capsys):
    model, samples, program, data = team
    out, onnx = tmp_path / "remote.pt2", tmp_path / "remote.onnx"
    main([
        "submit", "--server", live_server.url, "--api-key", KEYS[KEY], "--program", str(program), "--data", str(data),
        "--workers", "2", "--batch-size", "8", "--out", str(out), "--onnx", str(onnx),
    ])
    err = capsys.readouterr().err
    assert "recalibrated 2 BN layers on 30 samples" in err and f"-> {out}" in err
    local = tmp_path / "local.pt2"
    # The local run shares the test session's Ray with the server, whose warm pool would keep
    # its idle ranks' CPUs for a minute: a cluster shared with other drivers is not this test.
    live_server.services.pool.evict_for({"CPU": ray.cluster_resources()["CPU"]})
    main(["calibrate", "--program", str(program), "--data", str(data), "--workers", "2", "--batch-size", "8",
          "--out", str(local), "--report", str(tmp_path / "report.json")])
    remote_state, local_state = torch.export.load(out).state_dict, torch.export.load(local).state_dict
    for key, value in remote_state.items():
        torch.testing.assert_close(local_state[key], value, rtol=1e-6, atol=1e-7)
    assert json.loads((tmp_path / "report.json").read_text())["program"]["batch"] == "a static batch of 1"
    assert onnx.stat().st_size > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--arch", "torchvision:resnet18"], "error: --arch does not go with --program"),
        (["--checkpoint", "x.pt"], "error: --checkpoint does not go with --program"),
    ],
)
def test_calibrate_refuses_a_program_with_architecture_flags(team, tmp_path, capsys, flags, message):
    _, _, program, data = team
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "--program", str(program), "--data", str(data), "--out", str(tmp_path / "o.pt2"), *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(message) and err.count("\n") == 1


def test_calibrate_refuses_a_crafted_program_in_one_line(team, tmp_path, capsys):
    _, _, program, data = team
    marker = tmp_path / "ran-code"
    crafted = rewrite(program, tmp_path / "c.pt2", lambda name, _: code_pickle(marker) if "sample_inputs" in name else None)
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "--program", str(crafted), "--data", str(data), "--out", str(tmp_path / "o.pt2")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "program 'c.pt2'" in err and err.count("\n") == 1
    assert not marker.exists()
