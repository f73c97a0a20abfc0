"""Sweeps over HTTP (docs/sweeps.md, "Over HTTP"): one job over models x named sets, each
cell's files byte-identical to the single job's and downloadable as soon as the cell is
done (its ``cell`` event names them), a failing cell alone, the matrix report and one
archive of everything, and bad sweeps refused at submission naming the model or set."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile

import pytest
import torch

from bnrecal.service.client import BnrecalClient
from tests.api.conftest import KEYS, submit, upload, wait_for, write_samples
from tests.conftest import run_cli
from tests.nets import mixed_net, perturbed

pytestmark = pytest.mark.usefixtures("ray_cluster")

KEY = "sweeps"
ARCH = "tests.nets:mixed_net"


@pytest.fixture(scope="module")
def inputs(live_server, tmp_path_factory):
    """Digests of two stale mixed_net checkpoints, one that does not fit it, and two sets."""
    folder = tmp_path_factory.mktemp("sweep-inputs")
    files = {}
    for seed in (0, 1):
        files[f"m{seed}.pt"] = folder / f"m{seed}.pt"
        torch.manual_seed(seed)
        torch.save(perturbed(mixed_net(), seed=seed).state_dict(), files[f"m{seed}.pt"])
    files["wide.pt"] = folder / "wide.pt"
    torch.save(mixed_net(channels=9).state_dict(), files["wide.pt"])
    files["a.npy"], _ = write_samples(folder / "a.npy", 40, seed=3)
    files["b.npy"], _ = write_samples(folder / "b.npy", 24, seed=4)
    with live_server.client(KEY) as client:
        return {name: upload(client, path, name) for name, path in files.items()}


def sweep_spec(inputs, models=("m0.pt", "m1.pt"), **extra):
    return {
        "arch": ARCH, "workers": 2, "batch_size": 8, "outputs": ["checkpoint", "onnx"],
        "models": [{"checkpoint": inputs[name]} for name in models],
        "datasets": {"a": {"data": inputs["a.npy"]}, "b": {"data": inputs["b.npy"]}},
    } | extra


def test_each_cell_is_its_single_job_and_streams_as_it_finishes(live_server, inputs, tmp_path):
    with BnrecalClient(live_server.url, KEYS[KEY]) as client:
        job = client.submit(sweep_spec(inputs))
        cells, early = [], {}
        for event in client.events(job.id):
            if event.kind == "cell":
                assert "status" not in event.data  # only the job's events carry one
                cells.append(event.data["cell"])
                if not early:  # downloadable at once, while the sweep goes on
                    name = f"{cells[-1]['model']}/{cells[-1]['set']}/checkpoint"
                    early[name] = client.download(job.id, name, tmp_path / "early.pt").digest
        job = client.wait(job.id)
        assert job.status == "succeeded", job.error
        assert [(c["model"], c["set"]) for c in cells] == [("m0", "a"), ("m0", "b"), ("m1", "a"), ("m1", "b")]
        assert all(c["status"] == "succeeded" for c in cells)
        assert cells[0]["artifacts"] == ["m0/a/checkpoint", "m0/a/onnx", "m0/a/report"]
        for key in ("m0/a", "m0/b", "m1/a", "m1/b"):
            assert {f"{key}/{name}" for name in ("checkpoint", "onnx", "report", "report.html")} <= set(job.artifacts)
        assert {"sweep", "sweep.csv", "sweep.html", "archive"} <= set(job.artifacts)
        assert early == {name: job.artifacts[name].digest for name in early}
        for model, set_name in (("m1", "b"), ("m0", "a")):  # the single job of that model and set
            single = client.wait(client.submit({
                "arch": ARCH, "checkpoint": inputs[f"{model}.pt"], "data": inputs[f"{set_name}.npy"], "workers": 2,
                "batch_size": 8, "outputs": ["checkpoint", "onnx"],
            }).id)
            assert single.status == "succeeded", single.error
            for name in ("checkpoint", "onnx"):
                assert job.artifacts[f"{model}/{set_name}/{name}"].digest == single.artifacts[name].digest, name
        client.download(job.id, "archive", tmp_path / "sweep.zip")
        client.download(job.id, "m1/b/report", tmp_path / "report.json")
    matrix = job.report
    assert matrix["models"] == ["m0", "m1"] and matrix["sets"] == ["a", "b"] and matrix["succeeded"] == 4
    assert matrix["rank_by"] == "worst_drift" and len(matrix["ranking"]) == 4
    with zipfile.ZipFile(tmp_path / "sweep.zip") as archive:
        names = set(archive.namelist())
        assert {"sweep.json", "sweep.csv", "sweep.html", "m0/a/report.json", "m1/b/m1.pt", "m1/b/model.onnx",
                "m1/b/report.html"} <= names
        assert json.loads(archive.read("sweep.json"))["succeeded"] == 4
        cell = archive.read("m1/b/m1.pt")
    assert hashlib.sha256(cell).hexdigest() == job.artifacts["m1/b/checkpoint"].digest.removeprefix("sha256:")
    assert json.loads((tmp_path / "report.json").read_text())["samples"] == 24
    assert "href=\"m1/b/report.html\"" in (zipfile.ZipFile(tmp_path / "sweep.zip").read("sweep.html").decode())


def test_a_cell_that_cannot_run_fails_alone(live_server, inputs):
    with live_server.client(KEY) as client:
        job = submit(client, sweep_spec(inputs, models=("m0.pt", "wide.pt"), outputs=["checkpoint"])  # no ONNX: unchecked
                     | {"pairs": [[0, "a"], [1, "a"], [1, "b"]]})
        job = wait_for(client, job["id"])
        assert job["status"] == "failed"
        assert "2 of 3 cells failed" in job["error"]["detail"], job["error"]
        assert job["report"]["failed"] == 2 and job["report"]["succeeded"] == 1
        failed = [c for c in job["report"]["cells"] if c["status"] == "failed"]
        assert {c["model"] for c in failed} == {"wide"} and all("wide" in c["error"] or c["error"] for c in failed)
        assert "m0/a/checkpoint" in job["artifacts"] and not any(n.startswith("wide/") for n in job["artifacts"])
        response = client.get(f"/v1/jobs/{job['id']}/artifacts/m0/a/checkpoint")
        assert response.status_code == 200
        assert "sha256:" + hashlib.sha256(response.content).hexdigest() == job["artifacts"]["m0/a/checkpoint"]["digest"]
        assert client.get(f"/v1/jobs/{job['id']}/artifacts/m0/b/checkpoint").status_code == 404  # not a listed pair
        assert client.get(f"/v1/jobs/{job['id']}/artifacts/m0/a/../../x").status_code == 404


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"checkpoint": "sha256:" + "1" * 64}, "checkpoint"),
        ({"data": "sha256:" + "1" * 64}, "data"),
        ({"models": [{"checkpoint": "sha256:" + "1" * 64}]}, "models[0].checkpoint"),
        ({"models": [{"program": "sha256:" + "1" * 64, "arch": ARCH}]}, "models[0].arch"),
        ({"models": [{"arch": ARCH}]}, "models[0].checkpoint"),
        ({"models": [{"checkpoint": "M0", "arch": "os:system"}]}, "models[0].arch"),
        ({"datasets": {"a b": {"data": "sha256:" + "1" * 64}}}, "datasets.a b"),
        ({"datasets": {"a": {"data": {"path": "/etc"}}}}, "datasets.a.data.path"),
        ({"pairs": [[2, "a"]]}, "pairs[0]"),
        ({"pairs": [[0, "c"]]}, "pairs[0]"),
        ({"rank_by": "best"}, "rank_by"),
    ],
)
def test_a_bad_sweep_is_refused_at_submission_naming_the_cell(live_server, inputs, change, field):
    spec = json.loads(json.dumps(sweep_spec(inputs) | change).replace('"M0"', json.dumps(inputs["m0.pt"])))
    with live_server.client(KEY) as client:
        response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["field"] == field, body


def test_one_model_over_named_sets_needs_no_models_list(live_server, inputs):
    spec = {"arch": ARCH, "checkpoint": inputs["m0.pt"], "workers": 1, "batch_size": 8,
            "datasets": {"site1": {"data": inputs["a.npy"]}, "site2": {"data": inputs["b.npy"]}}}
    with live_server.client(KEY) as client:
        job = wait_for(client, submit(client, spec)["id"])
        assert job["status"] == "succeeded", job["error"]
        assert [c["set"] for c in job["report"]["cells"]] == ["site1", "site2"]
        assert job["report"]["models"] == ["m0"]
        phases = [entry["phase"] for entry in job["phases"]]  # one entry a cell, not one a phase of each
        assert phases == ["starting workers", "[1/2 m0/site1]", "[2/2 m0/site2]"], phases
        archive = zipfile.ZipFile(io.BytesIO(client.get(f"/v1/jobs/{job['id']}/artifacts/archive").content))
        assert "m0/site2/m0.pt" in archive.namelist()
        single = wait_for(client, submit(client, {"arch": ARCH, "checkpoint": inputs["m0.pt"], "data": inputs["b.npy"],
                                                  "batch_size": 8})["id"])
        assert job["artifacts"]["m0/site2/checkpoint"]["digest"] == single["artifacts"]["checkpoint"]["digest"]


def test_bnrecal_sweep_on_a_server_writes_what_a_sweep_here_writes(live_server, capsys, tmp_path, monkeypatch):
    folder = tmp_path / "in"
    folder.mkdir()
    for seed in (0, 1):
        torch.manual_seed(seed)
        torch.save(perturbed(mixed_net(), seed=seed).state_dict(), folder / f"p{seed}.pt")
    torch.save(mixed_net(channels=9).state_dict(), folder / "wide.pt")
    (folder / "models.txt").write_text("p0.pt\np1.pt\nwide.pt\n")
    write_samples(folder / "a.npy", 40, seed=3)
    write_samples(folder / "b.npy", 24, seed=4)
    common = ["sweep", "--models", str(folder / "models.txt"), "--arch", ARCH, "--data", f"a={folder / 'a.npy'}",
              "--data", f"b={folder / 'b.npy'}", "--workers", "2", "--batch-size", "8", "--onnx"]
    code, out, err = run_cli(capsys, *common, "--out-dir", str(tmp_path / "remote"), "--server", live_server.url,
                             "--api-key", KEYS[KEY])
    assert code == 1, err  # the wide model's cells failed, each named; the others' files are written
    assert "cell wide/a failed" in err and "cell wide/b failed" in err
    assert "4 cells succeeded, 2 failed" in err + out
    code, _, err = run_cli(capsys, *common, "--out-dir", str(tmp_path / "here2"))
    assert code == 2 and "--models: model p0: module 'tests.nets' is not allowed" in err, err  # here: this allowlist
    monkeypatch.setenv("BNRECAL_MODEL_MODULES", "tests")
    code, _, err = run_cli(capsys, *common, "--out-dir", str(tmp_path / "here"))
    assert code == 1, err
    for cell in ("p0/a", "p0/b", "p1/a", "p1/b"):
        model = cell.split("/")[0]
        for name in (f"{model}.pt", "model.onnx"):
            assert (tmp_path / "remote" / cell / name).read_bytes() == (tmp_path / "here" / cell / name).read_bytes()
        assert (tmp_path / "remote" / cell / "report.html").is_file()
    remote = json.loads((tmp_path / "remote" / "sweep.json").read_text())
    here = json.loads((tmp_path / "here" / "sweep.json").read_text())
    assert [(c["model"], c["set"], c["status"], c["samples"]) for c in remote["cells"]] == \
        [(c["model"], c["set"], c["status"], c["samples"]) for c in here["cells"]]
    assert not (tmp_path / "remote" / ".bnrecal-sweep.zip").exists()


def test_cancel_stops_a_sweep_and_keeps_the_cells_done(live_server, inputs):
    spec = sweep_spec(inputs, models=("m0.pt", "m1.pt", "m0.pt", "m1.pt"))  # 8 cells: m0, m1, m0-2, m1-2
    with BnrecalClient(live_server.url, KEYS[KEY]) as client:
        job = client.submit(spec)
        for event in client.events(job.id):
            if event.kind == "cell":
                first = event.data["cell"]
                client.cancel(job.id)
                break
        job = client.wait(job.id)
        assert job.status == "cancelled", job.error
        statuses = {(c["model"], c["set"]): c["status"] for c in job.report["cells"]}
        assert statuses[(first["model"], first["set"])] == "succeeded"
        assert "cancelled" in statuses.values() and len(statuses) == 8, statuses
        done = [key for key, status in statuses.items() if status == "succeeded"]
        for model, set_name in done:  # every cell done before the cancel keeps its files
            saved = client.download(job.id, f"{model}/{set_name}/checkpoint", live_server.settings.data_dir / "x.pt")
            assert saved.digest == job.artifacts[f"{model}/{set_name}/checkpoint"].digest
        assert not any(name.startswith(("m0-2/b/", "m1-2/")) for name in job.artifacts)


def test_cells_side_by_side_are_each_their_single_job(live_server, inputs):
    spec = sweep_spec(inputs) | {"workers": 1, "cells_at_once": 2}
    with live_server.client(KEY) as client:
        job = wait_for(client, submit(client, spec)["id"])
        assert job["status"] == "succeeded", [c.get("error") for c in (job["report"] or {}).get("cells", [])]
        assert sorted((c["model"], c["set"]) for c in job["report"]["cells"]) == [
            ("m0", "a"), ("m0", "b"), ("m1", "a"), ("m1", "b")]
        single = wait_for(client, submit(client, {"arch": ARCH, "checkpoint": inputs["m1.pt"], "data": inputs["b.npy"],
                                                  "batch_size": 8, "outputs": ["checkpoint", "onnx"]})["id"])
        for name in ("checkpoint", "onnx"):
            assert job["artifacts"][f"m1/b/{name}"]["digest"] == single["artifacts"][name]["digest"], name
        response = client.post("/v1/jobs", json={"arch": ARCH, "checkpoint": inputs["m1.pt"], "data": inputs["b.npy"],
                                                 "cells_at_once": 2})
        assert response.status_code == 422 and response.json()["field"] == "cells_at_once", response.text
