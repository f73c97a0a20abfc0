"""The flags of ``calibrate``, ``submit``, ``export`` and the job commands.

The run options' choices, defaults and help come from ``service.run.options.RunOptions``, the
one declaration the HTTP job spec and the engine share; only what is particular to the
command line (flag spellings, paths, output files) is declared here.

The rule that keeps ``bnrecal --help``, the job commands and every argument error under a
second: this module, and every module a command is declared in, imports no torch, Ray,
numpy or run pipeline at its top (``tests/service/cli/test_fast_commands.py`` checks it in a
fresh process). A flag's type, choices, default and help come from light declarations
(``service.run.options``, ``workers.engine.modes``, ``service.export.opsets``); what a
flag's value needs to be checked or used is imported inside the function that uses it.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Any, get_args

import typer

from bnrecal.workers.engine.modes import Mode as ModeChoice
from bnrecal.workers.errors import SpecError

from bnrecal.service.run.options import DEFAULT_OPSET, RunOptions, default, description
from bnrecal.service.run.options import Device as DeviceChoice
from bnrecal.service.run.options import Order as OrderChoice
from bnrecal.service.run.options import Placement as PlacementChoice

from .console import parse_json_object


def _choices(name: str, literal: Any) -> type[Enum]:
    """A typer choice type with exactly the values the run options accept."""
    return Enum(name, {value: value for value in get_args(literal)}, type=str)  # type: ignore[return-value]


Mode = _choices("Mode", ModeChoice)
Device = _choices("Device", DeviceChoice)
Placement = _choices("Placement", PlacementChoice)


class OnnxDtype(str, Enum):
    float32 = "float32"
    float16 = "float16"


ArchOpt = Annotated[str | None, typer.Option(help=description("arch"))]
CheckpointOpt = Annotated[
    Path | None, typer.Option(help="Trained checkpoint (.safetensors or torch file), with --arch.")
]
ProgramOpt = Annotated[
    Path | None,
    typer.Option(help="A torch.export program (.pt2, from torch.export.save), instead of --arch and --checkpoint."),
]
DataOpt = Annotated[
    str, typer.Option(help="Calibration data: .npy/.npz, image dir or archive, local or s3://bucket/key-or-prefix.")
]
OutOpt = Annotated[Path, typer.Option(help="Where to write the recalibrated checkpoint (or program, with --program).")]
ModelKwargsOpt = Annotated[str | None, typer.Option(help=description("model_kwargs") + " (JSON object)")]
WorkersOpt = Annotated[int, typer.Option("--workers", "-k", help=description("workers"))]
BatchOpt = Annotated[int, typer.Option("--batch-size", "-b", help=description("batch_size"))]
ModeOpt = Annotated[Mode, typer.Option(help=description("mode"))]
MaxSamplesOpt = Annotated[str | None, typer.Option(help=description("max_samples"), metavar="<int|auto>")]
Order = _choices("Order", OrderChoice)
OrderOpt = Annotated[Order, typer.Option(help=description("order"))]
SeedOpt = Annotated[int, typer.Option(help=description("seed"))]
ToleranceOpt = Annotated[float | None, typer.Option(help=description("tolerance"))]
DeviceOpt = Annotated[Device, typer.Option(help=description("device"))]
TransformOpt = Annotated[str | None, typer.Option(help=description("transform") + " (JSON object)")]
PlacementOpt = Annotated[Placement | None, typer.Option(help=description("placement"))]
MaxRetriesOpt = Annotated[int | None, typer.Option(help=description("max_retries"))]
OnnxOpt = Annotated[Path | None, typer.Option(help="Also export the model folded to ONNX here.")]
OnnxOpsetOpt = Annotated[int, typer.Option(help="ONNX opset of the export.")]
OnnxDtypeOpt = Annotated[OnnxDtype, typer.Option(help="Float type of the exported graph.")]
OnnxInt8Opt = Annotated[
    Path | None,
    typer.Option("--onnx-int8", help="Also export the folded model in INT8 (QDQ) here, ranges from the calibration data."),
]
Int8Opt = Annotated[
    str | None,
    typer.Option(
        "--int8", help='INT8 options (JSON object), e.g. {"target": "tensorrt", "method": "entropy"}; see docs/int8.md.'
    ),
]
ReportOpt = Annotated[Path | None, typer.Option(help="Where to write report.json.")]
EvalDataOpt = Annotated[
    str | None,
    typer.Option(
        help="Evaluate before and after on this data: image folder/archive with class folders or .npz "
        "with x and y (accuracy), or any calibration data format (prediction change only); "
        "local or s3://bucket/key-or-prefix."
    ),
]
EvalMaxSamplesOpt = Annotated[int | None, typer.Option(help="Evaluate on only the first M samples.", min=1)]
ReportHtmlOpt = Annotated[
    Path | None, typer.Option(help="Where to write the report as one self-contained HTML page (charts inline).")
]

ServerOpt = Annotated[str, typer.Option(envvar="BNRECAL_SERVER", help="URL of the bnrecal service.")]
ApiKeyOpt = Annotated[str | None, typer.Option(envvar="BNRECAL_API_KEY", help="API key (Bearer).")]
JobIdArg = Annotated[str, typer.Argument(help="The job's id, as submit printed it (bnrecal jobs lists them).")]

WORKERS = default("workers")
BATCH_SIZE = default("batch_size")
MODE = Mode(default("mode"))
ORDER = Order(default("order"))
SEED = default("seed")
DEVICE = Device(default("device"))
OPSET = DEFAULT_OPSET


def data_source(value: str | None, flag: str) -> Path | str | None:
    """A data flag's value: a local path, or a checked ``s3://`` URI kept as written (read
    with this machine's AWS credentials; no allowlist: the CLI is the operator's own tool)."""
    if value is None:
        return None
    if "://" in value:  # only a URI needs the object-storage reader (and torch, which it imports)
        from bnrecal.workers.data.objectstore import is_data_uri, parse_data_uri

        if is_data_uri(value):
            return parse_data_uri(value, flag)
    return Path(value)


def run_options(
    *,
    arch: str | None,
    model_kwargs: str | None,
    workers: int,
    batch_size: int,
    mode: Enum,
    max_samples: str | int | None,
    device: Enum,
    transform: str | None,
    placement: Enum | None,
    max_retries: int | None,
    order: Enum | None = None,
    seed: int | None = None,
    tolerance: float | None = None,
) -> RunOptions:
    """The run options of a command line, validated (a bad value names its flag's field)."""
    sampling: dict[str, Any] = {"max_samples": parse_max_samples(max_samples)}
    if order is not None:
        sampling["order"] = order.value
    if seed is not None:
        sampling["seed"] = seed
    if tolerance is not None:
        sampling["tolerance"] = tolerance
    return RunOptions.checked(
        arch=arch,
        model_kwargs=parse_json_object(model_kwargs, "--model-kwargs") or {},
        workers=workers,
        batch_size=batch_size,
        mode=mode.value,
        device=device.value,
        transform=parse_json_object(transform, "--transform"),
        placement=placement.value if placement is not None else None,
        max_retries=max_retries,
        **sampling,
    )


def int8_options(onnx_int8: Path | None, int8: str | None) -> Any:
    """The ``--int8`` options checked before any work (exit 2 naming the field), or None
    without ``--onnx-int8``."""
    from bnrecal.service.export.int8.options import int8_options as checked

    if int8 is not None and onnx_int8 is None:
        raise SpecError("--int8 sets the INT8 export's options: give --onnx-int8 PATH too", field="--int8")
    return checked(parse_json_object(int8, "--int8"), "--int8") if onnx_int8 is not None else None


def parse_max_samples(value: str | int | None) -> int | str | None:
    """``--max-samples``: a count, or ``auto``; anything else is left for the run options to
    refuse, naming the field."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        if text.isdigit():
            return int(text)
    return value
