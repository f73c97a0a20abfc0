"""Options shared by ``calibrate``, ``submit`` and ``export``: declared once, so the
commands cannot drift apart in names, types, choices or help."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer


class Mode(str, Enum):
    sync = "sync"
    local = "local"


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class Placement(str, Enum):
    spread = "spread"
    pack = "pack"
    strict_spread = "strict_spread"
    strict_pack = "strict_pack"


class OnnxDtype(str, Enum):
    float32 = "float32"
    float16 = "float16"


ArchOpt = Annotated[str, typer.Option(help="torchvision:<name>, timm:<name> or <module.path>:<callable>.")]
CheckpointOpt = Annotated[Path, typer.Option(help="Trained checkpoint (.safetensors or torch file).")]
DataOpt = Annotated[Path, typer.Option(help="Calibration data: .npy/.npz, image dir or archive.")]
OutOpt = Annotated[Path, typer.Option(help="Where to write the recalibrated checkpoint.")]
ModelKwargsOpt = Annotated[str | None, typer.Option(help="JSON object passed to the model factory.")]
WorkersOpt = Annotated[int, typer.Option("--workers", "-k", help="Ray actors (ranks).")]
BatchOpt = Annotated[int, typer.Option("--batch-size", "-b", help="Global batch size B.")]
ModeOpt = Annotated[Mode, typer.Option(help="sync: SyncBN statistics; local: per-rank statistics.")]
MaxSamplesOpt = Annotated[int | None, typer.Option(help="Use only the first M samples.")]
DeviceOpt = Annotated[Device, typer.Option(help="Where the ranks compute.")]
TransformOpt = Annotated[str | None, typer.Option(help='Image transform JSON, e.g. {"resize":256,"crop":224}.')]
PlacementOpt = Annotated[Placement | None, typer.Option(help="Spread ranks across nodes, or pack them.")]
MaxRetriesOpt = Annotated[int | None, typer.Option(help="Re-run a failed pass from scratch this many times.")]
OnnxOpt = Annotated[Path | None, typer.Option(help="Also export the model folded to ONNX here.")]
OnnxOpsetOpt = Annotated[int, typer.Option(help="ONNX opset of the export.")]
OnnxDtypeOpt = Annotated[OnnxDtype, typer.Option(help="Float type of the exported graph.")]
ReportOpt = Annotated[Path | None, typer.Option(help="Where to write report.json.")]
