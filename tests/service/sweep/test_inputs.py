"""A sweep's command-line inputs, checked before any work: the manifest, the sets, the pairs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bnrecal.errors import SpecError
from bnrecal.service.sweep.cells import cells_of, unique_names
from bnrecal.service.sweep.inputs import calibration_sets, read_manifest, read_pairs


def _manifest(tmp_path: Path, *lines: str) -> Path:
    for name in ("a.pt", "b.pt", "sub/a.pt", "p.pt2"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    path = tmp_path / "models.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_manifest_lines_paths_programs_and_objects(tmp_path):
    path = _manifest(tmp_path, "# the pruned ones", "a.pt", "", "sub/a.pt", "p.pt2",
                     json.dumps({"checkpoint": "b.pt", "arch": "tests.nets:mixed_net", "name": "wide",
                                 "model_kwargs": {"channels": 8}}))
    models = read_manifest(path, arch="tests.nets:classifier_net", model_kwargs={"classes": 3})
    assert [m.name for m in models] == ["a", "a-2", "p", "wide"]  # stems made unique in order
    assert models[0].checkpoint == tmp_path / "a.pt" and models[0].arch == "tests.nets:classifier_net"
    assert models[0].model_kwargs == {"classes": 3}
    assert models[2].program == tmp_path / "p.pt2" and models[2].arch is None and models[2].model_kwargs == {}
    assert models[3].arch == "tests.nets:mixed_net" and models[3].model_kwargs == {"channels": 8}


@pytest.mark.parametrize(("line", "message"), [
    ("missing.pt", "line 2: checkpoint missing.pt: no such file"),
    ('{"checkpoint": "a.pt", "weights": 1}', "line 2: unknown key 'weights'"),
    ('{"checkpoint": "a.pt", "program": "p.pt2"}', "line 2: give checkpoint or program"),
    ("{not json", "line 2: not a JSON object"),
    ('{"checkpoint": "a.pt", "name": "../up"}', "line 2: model name '../up' must be"),
])
def test_manifest_problems_name_the_line(tmp_path, line, message):
    path = _manifest(tmp_path, "a.pt", line)
    with pytest.raises(SpecError, match=message) as caught:
        read_manifest(path, arch="tests.nets:mixed_net", model_kwargs={})
    assert caught.value.field == "--models"


def test_checkpoint_without_arch_is_refused_naming_the_line(tmp_path):
    path = _manifest(tmp_path, "p.pt2", "a.pt")
    with pytest.raises(SpecError, match=r"line 2: --arch is required"):
        read_manifest(path, arch=None, model_kwargs={})


def test_empty_manifest_is_refused(tmp_path):
    with pytest.raises(SpecError, match="lists no model"):
        read_manifest(_manifest(tmp_path, "# nothing"), arch=None, model_kwargs={})


def test_sets_named_and_unnamed():
    assert calibration_sets(["x.npy"], []) == [("data", "x.npy", None)]
    assert calibration_sets(["cam1=a/x.npy", "cam2=s3://b/k=v"], ["cam2=e.npz"]) == [
        ("cam1", "a/x.npy", None), ("cam2", "s3://b/k=v", "e.npz")]
    with pytest.raises(SpecError, match="name each set as NAME=PATH"):
        calibration_sets(["a.npy", "b.npy"], [])
    with pytest.raises(SpecError, match="given twice"):
        calibration_sets(["a=x.npy", "a=y.npy"], [])
    with pytest.raises(SpecError, match="--eval-data cam3: no calibration set of that name"):
        calibration_sets(["cam1=x.npy"], ["cam3=e.npz"])


def test_pairs_by_name(tmp_path):
    path = tmp_path / "pairs.txt"
    path.write_text("# model set\na cam1\nb, cam2\n")
    assert read_pairs(path, ["a", "b"], ["cam1", "cam2"]) == {("a", "cam1"), ("b", "cam2")}
    cells = list(cells_of(enumerate(["a", "b"]), ["cam1", "cam2"], {("a", "cam1"), ("b", "cam2")}))
    assert [cell.key for cell in cells] == ["a/cam1", "b/cam2"]
    path.write_text("a cam9\n")
    with pytest.raises(SpecError, match="line 1: no set named 'cam9'"):
        read_pairs(path, ["a"], ["cam1"])
    path.write_text("c cam1\n")
    with pytest.raises(SpecError, match="line 1: no model named 'c'"):
        read_pairs(path, ["a"], ["cam1"])


def test_unique_names_never_take_another_models_name():
    assert unique_names(["a", "a", "a-2", "b", "a"]) == ["a", "a-3", "a-2", "b", "a-4"]
