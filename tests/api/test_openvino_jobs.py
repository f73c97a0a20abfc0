"""OpenVINO IR over HTTP: ``outputs: ["openvino", "openvino_int8"]`` give each a downloadable
tar of ``model.xml`` and ``model.bin``, the files ``bnrecal calibrate --openvino`` writes;
asked in a sweep, or without an INT8 phase's options where they do not belong, refused at
submission naming the field."""

from __future__ import annotations

import hashlib
import io
import re
import tarfile

import httpx
import numpy as np
import pytest
import torch

from bnrecal.service.client import BnrecalClient
from tests.api.conftest import KEYS
from tests.conftest import save_array, save_state
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


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"outputs": ["checkpoint", "openvino"], "int8": {"method": "entropy"}}, "int8"),  # no INT8 phase asked
        ({"outputs": ["openvino"], "sweep": True}, "outputs"),  # not in a sweep yet
    ],
)
def test_openvino_outputs_that_cannot_be_made_are_422_naming_the_field(live_server, tmp_path, change, field):
    with BnrecalClient(live_server.url, KEYS[KEY]) as client:
        checkpoint = client.upload(save_state(tmp_path / "m.pt", classifier_net())).digest
        data = client.upload(save_array(tmp_path / "x.npy", np.zeros((4, 3, 8, 8), np.float32))).digest
    spec = {"arch": "tests.nets:classifier_net", "checkpoint": checkpoint, "data": data} | change
    if spec.pop("sweep", False):
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
