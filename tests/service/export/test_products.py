"""The table of exported files (service/export/products.py): every surface names its files
from it, so a file added there is a flag of calibrate, submit and sweep, an output of the
job spec, and an artifact, with nothing else to edit."""

from __future__ import annotations

from dataclasses import fields
from typing import get_args

import pytest
from typer.testing import CliRunner

from bnrecal.service.cli.main import app
from bnrecal.service.cli.options import RunFlags
from bnrecal.service.cli.sweep import SweepFlags
from bnrecal.service.export.products import PRODUCT_NAMES, PRODUCTS, product_named
from bnrecal.service.export.int8.options import Int8Options
from bnrecal.service.jobserver.records.spec import ARTIFACT_NAMES, OutputName
from bnrecal.service.run.options import ExportOptions
from bnrecal.service.run.outputs.later_phases import RunOutputs


@pytest.mark.parametrize("command", ["calibrate", "submit", "sweep"])
def test_every_product_is_a_flag_of_each_command_that_writes_files(command):
    shown = CliRunner().invoke(app, [command, "--help"], terminal_width=200).output
    for product in PRODUCTS:
        help_text = product.cell_help if command == "sweep" else product.path_help
        assert product.flag in shown and help_text.split(" (")[0] in shown, (command, product.name)
    kind = SweepFlags if command == "sweep" else RunFlags
    assert set(PRODUCT_NAMES) <= {item.name for item in fields(kind)}


def test_every_product_is_an_output_of_the_job_spec_and_an_artifact_and_a_field_of_the_run_outputs(tmp_path):
    assert set(PRODUCT_NAMES) <= set(get_args(OutputName)) and set(PRODUCT_NAMES) <= set(ARTIFACT_NAMES)
    named = RunOutputs.named({name: tmp_path / name for name in PRODUCT_NAMES}, ExportOptions(), Int8Options())
    assert named.onnx and named.int8 and named.openvino and named.openvino_int8


def test_a_calibrate_flag_reads_the_path_into_its_product(tmp_path):
    flags = RunFlags(data="x.npy", out=tmp_path / "o.pt", onnx=tmp_path / "m.onnx", openvino_int8=tmp_path / "m.xml")
    assert flags.exports() == {product_named("onnx"): tmp_path / "m.onnx",
                               product_named("openvino_int8"): tmp_path / "m.xml"}
    assert flags.output_paths()["--openvino-int8"] == tmp_path / "m.xml"
    assert product_named("onnx_int8").flag == "--onnx-int8"
    with pytest.raises(KeyError):
        product_named("tensorrt")
