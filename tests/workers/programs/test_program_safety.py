"""Loading an uploaded program never runs code from it (docs/models.md, "torch.export programs").

Each crafted archive starts from a real ``torch.export.save`` file and plants code that
would create a marker file if anything ran it: a pickle in a member, a graph node naming a
Python callable, a symbolic expression or guard that torch evaluates, a stack trace that
becomes generated code. Both the cheap check made at submission (``check_program``) and
the full load refuse each with one line, or load safely where bnrecal strips the part,
and the marker never appears. The first test shows the planted pickle is real: torch's
own ``torch.export.load`` runs it.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from bnrecal.workers.engine.batchnorm import find_batchnorm_layers
from bnrecal.errors import ProgramError
from bnrecal.workers.programs import check_program, load_program

from tests.programs import code_pickle, export_program, members, rewrite, rewrite_graph, rewrite_json, write_members


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)).mean((2, 3))


@pytest.fixture
def program(tmp_path: Path) -> Path:
    return export_program(Small(), torch.randn(2, 3, 5, 5), tmp_path / "small.pt2", dynamic=True)


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "ran-code"


def refused(path: Path, marker: Path, match: str) -> None:
    """Both loaders refuse ``path`` with one line matching ``match``, and nothing ran."""
    for load in (check_program, load_program):
        with pytest.raises(ProgramError, match=match) as info:
            load(path)
        assert "\n" not in str(info.value)
    assert not marker.exists()


def test_torch_export_load_runs_a_planted_sample_inputs_pickle(program, marker, tmp_path):
    crafted = rewrite(program, tmp_path / "evil.pt2", lambda name, _: code_pickle(marker) if "sample_inputs" in name else None)
    script = f"import torch; torch.export.load({str(crafted)!r})"
    subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert marker.exists(), "the crafted archive should run code through torch.export.load (else this test proves nothing)"
    marker.unlink()
    refused(crafted, marker, r"sample inputs are not a weights-only torch file")


@pytest.mark.parametrize("torch_format", [True, False], ids=["torch-zip", "plain-pickle"])
def test_a_pickled_weight_is_refused(program, marker, tmp_path, torch_format):
    evil = code_pickle(marker, torch_format=torch_format)

    def plant(name: str, data: bytes) -> bytes | None:
        return evil if name.endswith("data/weights/weight_0") else None

    crafted = rewrite(program, tmp_path / "evil.pt2", plant)

    def use_pickle(config: dict) -> None:
        for meta in config["config"].values():
            if meta["path_name"] == "weight_0":
                meta["use_pickle"] = True

    crafted = rewrite_json(crafted, tmp_path / "evil2.pt2", "model_weights_config.json", use_pickle)
    refused(crafted, marker, r"weight 'conv.weight' is stored as a pickled object")


@pytest.mark.parametrize("prefix", ["custom_obj_", "opaque_obj_", "tensor_"])
def test_a_pickled_constant_is_refused(program, marker, tmp_path, prefix):
    def add_constant(config: dict) -> None:
        config["config"]["evil"] = {
            "path_name": f"{prefix}0", "is_param": False, "use_pickle": prefix == "tensor_", "tensor_meta": None,
        }

    crafted = rewrite_json(program, tmp_path / "evil.pt2", "model_constants_config.json", add_constant)
    contents = members(crafted)
    root = next(iter(contents)).split("/")[0]
    contents[f"{root}/data/constants/{prefix}0"] = code_pickle(marker, torch_format=False)
    crafted = write_members(tmp_path / "evil2.pt2", contents)
    refused(crafted, marker, r"constant 'evil' is stored as a pickled object")


@pytest.mark.parametrize(
    ("target", "match"),
    [
        ("torch.os.system", r"calls 'torch.os.system', an arbitrary Python callable"),
        ("builtins.exec", r"an arbitrary Python callable"),
        ("torch.ops.evil.touch.default", r"operator namespace 'evil'"),
        ("torch.ops.aten.no_such_op.default", r"an operator this torch does not have"),
        ("#evil", r"an arbitrary Python callable"),
    ],
)
def test_a_graph_naming_code_is_refused_by_node(program, marker, tmp_path, target, match):
    def plant(document: dict) -> None:
        node = document["graph_module"]["graph"]["nodes"][0]
        node["target"] = target
        node["inputs"] = [{"name": "command", "arg": {"as_string": f"touch {marker}"}, "kind": 1}]

    refused(rewrite_graph(program, tmp_path / "evil.pt2", plant), marker, match)


def test_a_symbolic_expression_that_is_python_is_refused(program, marker, tmp_path):
    def plant(document: dict) -> None:
        values = document["graph_module"]["graph"]["tensor_values"]
        for meta in values.values():
            for size in meta["sizes"]:
                if "as_expr" in size:
                    size["as_expr"]["expr_str"] = f"__import__('os').system('touch {marker}')"
                    return
        raise AssertionError("the dynamic program has no symbolic size to plant into")

    refused(rewrite_graph(program, tmp_path / "evil.pt2", plant), marker, r"names '__import__'")


def test_guards_and_stack_traces_never_become_code(program, marker, tmp_path):
    """Guard code (exec'd by ExportedProgram.module()) and stack traces (comments in
    generated code, where a carriage return ends the comment) are dropped, not run."""
    def plant(document: dict) -> None:
        document["guards_code"] = [f"__import__('os').system('touch {marker}')"]
        for node in document["graph_module"]["graph"]["nodes"]:
            node["metadata"]["stack_trace"] = (
                f'File "x.py", line 1, in f\r__import__("os").system("touch {marker}")\n    f()'
            )
            node["metadata"]["custom"] = f"__import__('os').system('touch {marker}')"

    crafted = rewrite_graph(program, tmp_path / "evil.pt2", plant)
    check_program(crafted)
    loaded = load_program(crafted)
    with torch.no_grad():
        loaded(torch.randn(3, 3, 5, 5))
    assert [layer.name for layer in find_batchnorm_layers(loaded)[0]] == ["bn"]
    assert not marker.exists()


def test_unsafe_archives_are_refused(program, marker, tmp_path):
    contents = members(program)
    root = next(iter(contents)).split("/")[0]
    dotdot = write_members(tmp_path / "dotdot.pt2", {**contents, f"{root}/../escape": b"x"})
    refused(dotdot, marker, r"unsafe member name '.*\.\./escape'")
    absolute = write_members(tmp_path / "absolute.pt2", {"/etc/evil": b"x", **contents})
    refused(absolute, marker, r"unsafe member name")
    (tmp_path / "text.pt2").write_text("not a zip")
    refused(tmp_path / "text.pt2", marker, r"is not a \.pt2 archive \(not a zip file, or cut short\)")
    data = program.read_bytes()
    (tmp_path / "cut.pt2").write_bytes(data[: len(data) // 2])
    refused(tmp_path / "cut.pt2", marker, r"not a \.pt2 archive|cannot be read")
    plain = tmp_path / "plain.zip"
    with zipfile.ZipFile(plain, "w") as archive:
        archive.writestr("a/readme.txt", "hello")
    refused(plain, marker, r"no member 'archive_format'")
    checkpoint = tmp_path / "weights.pt"
    torch.save(Small().state_dict(), checkpoint)
    refused(checkpoint, marker, r"not a torch.export archive|no member 'archive_format'")


def test_a_damaged_weight_is_refused(program, marker, tmp_path):
    crafted = rewrite(program, tmp_path / "short.pt2", lambda name, data: data[:4] if name.endswith("weights/weight_0") else None)
    with pytest.raises(ProgramError, match=r"weight 'conv.weight' reaches past the end of its bytes"):
        load_program(crafted)
