"""OpenVINO IR over HTTP: ``outputs: ["openvino", "openvino_int8"]`` give each a downloadable
tar of ``model.xml`` and ``model.bin``, the files ``bnrecal calibrate --openvino`` writes;
in a sweep, every cell's (``bnrecal sweep --openvino --openvino-int8``, here or on the
server, the same files); the INT8 phase's options without an INT8 output refused at
submission naming the field."""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile

import httpx
import numpy as np
import pytest
import torch

from bnrecal.service.client import BnrecalClient
from tests.api.conftest import KEYS
from tests.conftest import run_cli, save_array, save_state
from tests.nets import classifier_net, perturbed

pytestmark = pytest.mark.usefixtures("ray_cluster")

KEY = "openvino"


def unnumbered(xml: str) -> str:
    """An IR's ``.xml`` without the numbers OpenVINO gives the layers it names itself
    (``Constant_5399``: a counter of its process)."""
    return re.sub(r'name="([A-Za-z]+)_[0-9]+"', r'name="\1_N"', xml)


def test_a_job_ships_openvino_ir_of_the_fp32_and_int8_models(live_server, tmp_path):
    torch.manual_seed(4)
    checkpoint = save_state(tmp_path / "m.pt", perturbed(classifier_net(6)))
    data = save_array(tmp_path / "x.npy", (torch.randn(24, 3, 8, 8) * 1.5 + 0.3).numpy())
    with BnrecalClient(live_server.url, KEYS[KEY]) as client:
        spec = {
            "arch": "tests.nets:classifier_net", "model_kwargs": {"classes": 6},
            "checkpoint": client.upload(checkpoint).digest, "data": client.upload(data).digest, "batch_size": 8,
            "outputs": ["checkpoint", "openvino", "openvino_int8"],
        }
        job = client.wait(client.submit(spec).id)
        assert job.status == "succeeded", job.error
        assert set(job.artifacts) == {"checkpoint", "openvino", "openvino_int8", "report", "report.html"}
        assert job.artifacts["openvino"].filename == "recalibrated-openvino.tar"  # what a download is called
        assert job.artifacts["openvino_int8"].filename == "recalibrated-openvino-int8.tar"
        for name in ("openvino", "openvino_int8"):
            client.download(job.id, name, tmp_path / f"{name}.tar")
            payload = (tmp_path / f"{name}.tar").read_bytes()
            assert job.artifacts[name].digest == "sha256:" + hashlib.sha256(payload).hexdigest()
            with tarfile.open(fileobj=io.BytesIO(payload)) as tar:
                members = {member.name: tar.extractfile(member).read() for member in tar.getmembers()}
            assert set(members) == {"model.xml", "model.bin"} and b"<net " in members["model.xml"]
            section = job.report[name]
            assert section["bin_bytes"] == len(members["model.bin"]) and section["xml_bytes"] == len(members["model.xml"])
            assert section["max_abs_diff_to_onnx_in_openvino"] <= 1e-4 * max(1.0, section["outputs_max_abs"])
        assert job.report["int8"]["method"] == "minmax"  # the INT8 phase ran, its file not asked for


@pytest.mark.parametrize("sweep", [False, True], ids=["job", "sweep"])
def test_int8_options_without_an_int8_output_are_422_naming_the_field(live_server, tmp_path, sweep):
    with BnrecalClient(live_server.url, KEYS[KEY]) as client:
        checkpoint = client.upload(save_state(tmp_path / "m.pt", classifier_net())).digest
        data = client.upload(save_array(tmp_path / "x.npy", np.zeros((4, 3, 8, 8), np.float32))).digest
    spec = {"arch": "tests.nets:classifier_net", "checkpoint": checkpoint, "data": data,
            "outputs": ["checkpoint", "openvino"], "int8": {"method": "entropy"}}  # IR of FP32 only: no INT8 phase
    field = "int8"
    if sweep:
        spec |= {"models": [{"checkpoint": spec.pop("checkpoint")}], "datasets": {"a": {"data": spec.pop("data")}}}
    response = httpx.post(f"{live_server.url}/v1/jobs", json=spec, headers={"Authorization": f"Bearer {KEYS[KEY]}"})
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert field in response.json()["detail"], response.text


def test_submit_writes_the_ir_files_calibrate_writes(live_server, tmp_path, capsys, monkeypatch):
    from bnrecal.service.cli import main

    monkeypatch.setenv("BNRECAL_MODEL_MODULES", "tests.nets")  # the calibrate here: the server has its own

    torch.manual_seed(6)
    checkpoint = save_state(tmp_path / "m.pt", perturbed(classifier_net(6)))
    data = save_array(tmp_path / "x.npy", (torch.randn(24, 3, 8, 8) * 1.5 + 0.3).numpy())
    common = ["--arch", "tests.nets:classifier_net", "--model-kwargs", '{"classes": 6}', "--checkpoint", str(checkpoint),
              "--data", str(data), "--workers", "1", "--batch-size", "8", "--order", "given"]
    for where, extra in (("here", []), ("server", ["--server", live_server.url, "--api-key", KEYS[KEY]])):
        (tmp_path / where).mkdir()
        main(["submit" if extra else "calibrate", *common, *extra, "--out", str(tmp_path / where / "out.pt"),
              "--openvino", str(tmp_path / where / "m.xml"), "--openvino-int8", str(tmp_path / where / "q.xml")])
        assert str(tmp_path / where / "q.xml") in capsys.readouterr().err
    for name in ("m.bin", "q.bin"):
        assert (tmp_path / "server" / name).read_bytes() == (tmp_path / "here" / name).read_bytes(), name
    for name in ("m.xml", "q.xml"):  # the same graph: only the names OpenVINO numbers per process differ
        server, here = (unnumbered((tmp_path / side / name).read_text()) for side in ("server", "here"))
        assert server == here, name
    assert sorted(p.name for p in (tmp_path / "server").iterdir()) == ["m.bin", "m.xml", "out.pt", "q.bin", "q.xml"]


def test_a_sweep_writes_the_ir_of_every_cell_here_and_on_a_server_alike(live_server, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("BNRECAL_MODEL_MODULES", "tests.nets")  # the sweep here: the server has its own
    folder = tmp_path / "in"
    folder.mkdir()
    for seed in (0, 1):
        torch.manual_seed(seed)
        save_state(folder / f"m{seed}.pt", perturbed(classifier_net(6), seed=seed))
    (folder / "models.txt").write_text("m0.pt\nm1.pt\n")
    data = save_array(folder / "x.npy", (torch.randn(24, 3, 8, 8) * 1.5 + 0.3).numpy())
    common = ["sweep", "--models", str(folder / "models.txt"), "--arch", "tests.nets:classifier_net",
              "--model-kwargs", '{"classes": 6}', "--data", f"a={data}", "--workers", "1", "--batch-size", "8",
              "--order", "given", "--openvino", "--openvino-int8"]
    code, _, err = run_cli(capsys, *common, "--out-dir", str(tmp_path / "here"))
    assert code == 0, err
    code, _, err = run_cli(capsys, *common, "--out-dir", str(tmp_path / "server"), "--server", live_server.url,
                           "--api-key", KEYS[KEY])
    assert code == 0, err
    job_id = re.search(r"job (\w+) queued", err).group(1)
    for cell in ("m0/a", "m1/a"):
        for name in ("model.bin", "model.int8.bin"):
            assert (tmp_path / "server" / cell / name).read_bytes() == (tmp_path / "here" / cell / name).read_bytes()
        for name in ("model.xml", "model.int8.xml"):
            server, here = (unnumbered((tmp_path / side / cell / name).read_text()) for side in ("server", "here"))
            assert server == here, (cell, name)
        report = json.loads((tmp_path / "here" / cell / "report.json").read_text())
        for section in ("openvino", "openvino_int8"):
            checked = report[section]
            assert checked["max_abs_diff_to_onnx_in_openvino"] <= 1e-4 * max(1.0, checked["outputs_max_abs"])
    with BnrecalClient(live_server.url, KEYS[KEY]) as client:  # each cell's IR, one artifact each
        job = client.job(job_id)
        assert {job.artifacts[f"m1/a/{name}"].filename for name in ("openvino", "openvino_int8")} == {
            "openvino.tar", "openvino-int8.tar"}
        for name, stem in (("openvino", "model"), ("openvino_int8", "model.int8")):
            client.download(job.id, f"m1/a/{name}", tmp_path / f"{name}.tar")
            with tarfile.open(tmp_path / f"{name}.tar") as tar:
                members = {member.name: tar.extractfile(member).read() for member in tar.getmembers()}
            assert members["model.bin"] == (tmp_path / "server" / "m1" / "a" / f"{stem}.bin").read_bytes()
            assert members["model.xml"] == (tmp_path / "server" / "m1" / "a" / f"{stem}.xml").read_bytes()
    assert not list((tmp_path / "server").rglob("*.tar"))  # the archive lays out the files, not their tars
