"""The flags of ``calibrate``, ``submit``, ``export`` and the job commands.

The run options' choices, defaults and help come from ``service.run.options.RunOptions``, the
one declaration the HTTP job spec and the engine share; only what is particular to the
command line (flag spellings, paths, output files) is declared here. The flags ``calibrate``
and ``submit`` share are declared once, as the fields of :class:`RunFlags`; each command is
written ``def command(flags: RunFlags, <its own flags>)`` under :func:`run_command`.

The rule that keeps ``bnrecal --help``, the job commands and every argument error under a
second: this module, and every module a command is declared in, imports no torch, Ray,
numpy or run pipeline at its top (``tests/service/cli/test_fast_commands.py`` checks it in a
fresh process). A flag's type, choices, default and help come from light declarations
(``service.run.options``, ``workers.engine.modes``, ``service.export.opsets``); what a
flag's value needs to be checked or used is imported inside the function that uses it.
"""

from __future__ import annotations

import functools
import inspect
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import MISSING, field, fields, make_dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, get_args, get_type_hints

import typer

from bnrecal.errors import BnrecalError, SpecError
from bnrecal.service.export.products import PRODUCTS, ExportProduct, ir_xml_path, product_named
from bnrecal.service.run.options import DEFAULT_OPSET, RunOptions, check_model_choice, default, description, flag_of
from bnrecal.service.run.options import Device as DeviceChoice
from bnrecal.service.run.options import Order as OrderChoice
from bnrecal.service.run.options import Placement as PlacementChoice
from bnrecal.workers.engine.modes import Mode as ModeChoice

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
    str, typer.Option(help="Calibration data: .npy/.npz, image dir or archive, shards (WebDataset, Parquet, MDS), "
                           "local or s3://bucket/key-or-prefix.")
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
ImageColumnOpt = Annotated[str | None, typer.Option(help=description("image_column"))]
LabelColumnOpt = Annotated[str | None, typer.Option(help=description("label_column"))]
DeviceOpt = Annotated[Device, typer.Option(help=description("device"))]
TransformOpt = Annotated[str | None, typer.Option(help=description("transform") + " (JSON object)")]
PlacementOpt = Annotated[Placement | None, typer.Option(help=description("placement"))]
MaxRetriesOpt = Annotated[int | None, typer.Option(help=description("max_retries"))]
OnnxOpsetOpt = Annotated[int, typer.Option(help="ONNX opset of the export.")]
OnnxDtypeOpt = Annotated[OnnxDtype, typer.Option(help="Float type of the exported graph.")]


def export_flag(product: ExportProduct) -> Any:
    """An exported file's flag on ``calibrate``, ``submit`` and ``export``: the path it is
    written to (an IR's ``.xml``, its ``.bin`` beside), spelt and described by its product
    (``service.export.products``)."""
    return Annotated[Path | None, typer.Option(product.flag, help=product.path_help,
                                               **({"metavar": "PATH.xml"} if product.openvino_ir else {}))]


def cell_flag(product: ExportProduct) -> Any:
    """An exported file's flag on ``sweep``: whether every cell writes it (its ``cell_file``)."""
    return Annotated[bool, typer.Option(product.flag, help=product.cell_help)]


OnnxInt8Opt = export_flag(product_named("onnx_int8"))
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
        help="Evaluate before and after on this data: image folder/archive with class folders, .npz "
        "with x and y, or shards with labels (accuracy); .npy, .npz without y or images without class "
        "folders (prediction change only); local or s3://bucket/key-or-prefix."
    ),
]
EvalMaxSamplesOpt = Annotated[int | None, typer.Option(help="Evaluate on only the first M samples.", min=1)]
ReportHtmlOpt = Annotated[
    Path | None, typer.Option(help="Where to write the report as one self-contained HTML page (charts inline).")
]

MlflowOpt = Annotated[bool, typer.Option(
    "--mlflow", help="Log the run to MLflow (MLFLOW_TRACKING_URI, else MLflow's default store): the flags as params, the "
                     "report's figures as metrics, the report and the files written as artifacts (bnrecal[mlflow]).")]

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


def _brace_pattern(value: str) -> bool:
    """Whether ``value`` names shards by a brace pattern (imports the data room, and so torch)."""
    from bnrecal.workers.data.shards.listing import has_brace_pattern

    return has_brace_pattern(value)


def _glob_hint(value: str) -> str:
    """'; ' and what to give instead of a glob (docs/data.md, "WebDataset"), '' for a plain path."""
    if not any(c in value for c in "*?["):  # only a glob needs the data room (and torch, which it imports)
        return ""
    from bnrecal.workers.data.shards.patterns import glob_hint

    return f"; {glob_hint(value)}"


def check_paths(
    inputs: dict[str, Path | str | None], outputs: dict[str, Path | None] | None = None
) -> None:
    """Check every path a command takes before any work (docs/cli.md, "Output and exit codes"): an input
    that does not exist or cannot be read, or an output whose folder does not exist or cannot
    be written, is a ``SpecError`` (exit 2) naming the flag and the path. ``s3://`` inputs are
    left to the object-storage reader."""
    import os

    for flag, value in inputs.items():
        if value is None or "://" in str(value):
            continue
        if "{" in str(value) and _brace_pattern(str(value)):  # shards by pattern: each shard must be there
            from bnrecal.workers.data.shards.listing import expand_braces

            missing = [name for name in expand_braces(str(value)) if not Path(name).exists()]
            if missing:
                raise SpecError(f"{flag} {value}: no shard {missing[0]} (no such file)", field=flag)
            continue
        path = Path(value)
        if not path.exists():
            raise SpecError(f"{flag} {value}: no such file or directory" + _glob_hint(str(value)), field=flag)
        if not os.access(path, os.R_OK) or (path.is_dir() and not os.access(path, os.X_OK)):
            raise SpecError(f"{flag} {value}: cannot be read (permission denied)", field=flag)
    for flag, value in (outputs or {}).items():
        if value is None:
            continue
        path = Path(value)
        folder = path.parent if str(path.parent) else Path(".")
        if path.is_dir():
            raise SpecError(f"{flag} {value}: is a directory; give a file name", field=flag)
        if not folder.is_dir():
            raise SpecError(f"{flag} {value}: its folder {folder} does not exist", field=flag)
        if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise SpecError(f"{flag} {value}: cannot be written (permission denied)", field=flag)


def data_source(value: str | None, flag: str) -> Path | str | None:
    """A data flag's value: a local path, or a checked ``s3://`` URI kept as written (read
    with this machine's AWS credentials; no allowlist: the CLI is the operator's own tool)."""
    if value is None:
        return None
    if "://" in value:  # only a URI needs the object-storage reader (and torch, which it imports)
        from bnrecal.workers.data.storage.objectstore import is_data_uri, parse_data_uri

        if is_data_uri(value):
            return parse_data_uri(value, flag)
    return Path(value)


class RunOptionFlags:
    """What a command whose fields include the run options' flags (``RunFlags``,
    ``SweepFlags``) makes of them."""

    def run_options(self) -> RunOptions:
        """The run options of the command line, validated (a bad value names its flag's field)."""
        flags: Any = self
        tolerance = {} if flags.tolerance is None else {"tolerance": flags.tolerance}
        return RunOptions.checked(
            arch=flags.arch,
            model_kwargs=parse_json_object(flags.model_kwargs, "--model-kwargs") or {},
            workers=flags.workers,
            batch_size=flags.batch_size,
            mode=flags.mode.value,
            device=flags.device.value,
            transform=parse_json_object(flags.transform, "--transform"),
            placement=flags.placement.value if flags.placement is not None else None,
            max_retries=flags.max_retries,
            max_samples=parse_max_samples(flags.max_samples),
            order=flags.order.value,
            seed=flags.seed,
            image_column=flags.image_column,
            label_column=flags.label_column,
            **tolerance,
        )


FlagField = tuple[str, Any, Any]
"""A flag as a field of a flags class: its name, its option (``Annotated`` type: spelling,
type, help) and its default (``MISSING``: the flag is required)."""

RECALIBRATION_FLAGS: list[FlagField] = [
    ("workers", WorkersOpt, WORKERS),
    ("batch_size", BatchOpt, BATCH_SIZE),
    ("mode", ModeOpt, MODE),
    ("max_samples", MaxSamplesOpt, None),
    ("order", OrderOpt, ORDER),
    ("seed", SeedOpt, SEED),
    ("tolerance", ToleranceOpt, None),
    ("device", DeviceOpt, DEVICE),
    ("transform", TransformOpt, None),
    ("image_column", ImageColumnOpt, None),
    ("label_column", LabelColumnOpt, None),
    ("placement", PlacementOpt, None),
    ("max_retries", MaxRetriesOpt, None),
]
"""The flags of ``bnrecal.RecalibrationOptions``' fields, one each, in ``--help``'s order: every
command that runs a recalibration (``calibrate``, ``submit``, ``sweep``) takes these
(tests/service/cli/test_options.py checks they are the options' fields)."""


def flags_class(name: str, doc: str, flags: list[FlagField], base: type, module: str = __name__) -> Any:
    """A frozen dataclass of ``module`` whose fields are ``flags`` in order (what
    :func:`run_command` makes a command's flags of), with ``base``'s methods."""
    return make_dataclass(
        name, [(flag, kind, field(default=default)) for flag, kind, default in flags], bases=(base,), frozen=True,
        namespace={"__doc__": doc, "__module__": module},
    )


class _RunFlagsMethods(RunOptionFlags):
    """What ``calibrate`` and ``submit`` make of their flags beyond the run options."""

    def check_model(self) -> None:
        """Refuse a model choice that cannot run (both or neither of --program and --arch, ...),
        naming the flag, before anything is read."""
        check_model_choice(
            self.arch, self.checkpoint, self.program, parse_json_object(self.model_kwargs, "--model-kwargs"), flags=True
        )

    def int8_options(self) -> Any:
        """The ``--int8`` options checked (see :func:`int8_options`), or None without an INT8
        output (``--onnx-int8``, ``--openvino-int8``)."""
        flags: Any = self
        return int8_options(next((path for product, path in self.exports().items() if product.int8), None), flags.int8)

    def exports(self) -> dict[ExportProduct, Path]:
        """The exported files asked for, each with the path its flag gives, in the products' order."""
        return {product: path for product in PRODUCTS if (path := getattr(self, product.name)) is not None}

    def output_paths(self) -> dict[str, Path | None]:
        """Every file the command may write, by flag: the model, the exports, the reports."""
        flags: Any = self
        return {"--out": flags.out, **{product.flag: getattr(self, product.name) for product in PRODUCTS},
                "--report": flags.report, "--report-html": flags.report_html}

    def check_openvino(self, *, here: bool) -> None:
        """Refuse an OpenVINO IR output that cannot be written: a path not ending ``.xml``
        (its ``.bin`` goes beside), or, made ``here``, OpenVINO not installed; before any
        worker starts or anything is uploaded."""
        from bnrecal.service.export.runtimes import openvino_version

        for product, path in self.exports().items():
            flag = product.flag
            if not product.openvino_ir:
                continue
            ir_xml_path(path, flag)
            if here and openvino_version() is None:
                raise SpecError(f"{flag} needs OpenVINO: pip install 'bnrecal[openvino]'", field=flag)


RunFlags = flags_class(
    "RunFlags",
    """The flags ``calibrate`` and ``submit`` share, declared once: a field's annotation is
    its option (spelling, type, help), its default the flag's default, and the field order
    the order ``--help`` lists them in. :func:`run_command` makes them the command's flags.""",
    [
        ("data", DataOpt, MISSING),
        ("out", OutOpt, MISSING),
        ("arch", ArchOpt, None),
        ("checkpoint", CheckpointOpt, None),
        ("program", ProgramOpt, None),
        ("model_kwargs", ModelKwargsOpt, None),
        *RECALIBRATION_FLAGS,
        ("report", ReportOpt, None),
        ("report_html", ReportHtmlOpt, None),
        ("eval_data", EvalDataOpt, None),
        ("eval_max_samples", EvalMaxSamplesOpt, None),
        *((product.name, export_flag(product), None) for product in PRODUCTS),  # --onnx, --onnx-int8, ...
        ("onnx_opset", OnnxOpsetOpt, OPSET),
        ("onnx_dtype", OnnxDtypeOpt, OnnxDtype.float32),
        ("int8", Int8Opt, None),
    ],
    _RunFlagsMethods,
)


def flag_message(error: BnrecalError) -> str:
    """An error's message as the command line words it. The run options are named by their
    field names everywhere else (``image_column``: the job spec's and the Python API's); an
    error that blames one (its ``field``) names them by the flags typed here instead: the
    options of several words wherever the message names them, the blamed one where the
    message starts with it (``seed must be ...``; a word such as ``data`` elsewhere is prose)."""
    field = getattr(error, "field", None)
    head = field.split(".")[0] if isinstance(field, str) else ""
    names = {item.name for item in fields(RunFlags)}
    if head not in names:
        return error.message
    words = sorted((name for name in names if "_" in name), key=len, reverse=True)
    assert isinstance(field, str)
    whole = field.replace(".", "_")  # a job spec's nested field that is a flag here: onnx.opset, --onnx-opset
    if whole in names and whole != head:
        head, message = whole, re.sub(rf"^{re.escape(field)}(?=[\s:]|$)", flag_of(whole), error.message)
    else:
        message = re.sub(rf"^{re.escape(head)}(?=[\s:.]|$)", flag_of(head), error.message)
    message = re.sub(rf"(?<![\w./'\"-])({'|'.join(words)})(?![\w/'\"-])", lambda m: flag_of(m.group(1)), message)
    # A hint written for both surfaces ("set model_kwargs V (--model-kwargs 'V')") names the flag twice here.
    return re.sub(r"(--[\w-]+) (\S.*?) \(\1 '\2'\)", r"\1 '\2'", message)


def run_command(
    flags_type: type[RunOptionFlags] | None = None, /, **after: str
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Make ``command(flags: RunFlags, **own)`` a typer command whose flags are the
    :class:`RunFlags` fields (or ``flags_type``'s: ``SweepFlags``) and its own parameters, each of those listed right after the
    shared flag ``after`` names for it (``run_command(server="out")``), as ``--help`` shows them.

    typer reads the command's parameters from its signature; the one built here is the
    shared fields followed, in place, by the command's own. The values come back as keyword
    arguments, the shared ones gathered into the ``RunFlags`` the command is called with.
    """
    kind: Any = flags_type or RunFlags
    hints = get_type_hints(kind, include_extras=True)
    shared = [
        inspect.Parameter(
            field.name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[field.name],
            default=inspect.Parameter.empty if field.default is MISSING else field.default,
        )
        for field in fields(kind)
    ]
    names = [parameter.name for parameter in shared]

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        first, *own = inspect.signature(command, eval_str=True).parameters.values()
        placed = {parameter.name for parameter in own}
        if first.annotation is not kind or placed != set(after) or not set(after.values()) <= set(names):
            raise TypeError(f"{command.__name__}: write it (flags: RunFlags, ...) and place each own flag after a shared one")
        parameters = []
        for parameter in shared:
            parameters.append(parameter)
            parameters += [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own if after[p.name] == parameter.name]

        @functools.wraps(command)
        def run(**values: Any) -> None:
            command(kind(**{name: values.pop(name) for name in names}), **values)

        run.__signature__ = inspect.Signature(parameters, return_annotation=None)  # type: ignore[attr-defined]
        run.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters}
        return run

    return decorate


def flag_params(flags: Any) -> dict[str, Any]:
    """A command's flags as an MLflow run's params: every flag's value as given or defaulted,
    by the flag's field name (paths and choices as text)."""
    values = {}
    for item in fields(flags):
        value = getattr(flags, item.name)
        values[item.name] = value.value if isinstance(value, Enum) else str(value) if isinstance(value, Path) else value
    return values


def start_tracking(enabled: bool, name: str, flags: Any) -> Any:
    """With ``--mlflow``, the command's MLflow run (``service.tracking.MlflowRun``) made before
    any worker starts, its flags as params; else None."""
    if not enabled:
        return None
    from bnrecal.service.tracking import MlflowRun

    return MlflowRun.start(name, flag_params(flags))


@contextmanager
def tracked_files(tracking: Any, report: Path | None, report_html: Path | None) -> Iterator[tuple[Path | None, Path | None]]:
    """Where a run writes ``report.json`` and ``report.html``: where the flags say, and with an
    MLflow run also where they do not (a temporary folder, gone after the run is logged), so
    that the run always has both as artifacts."""
    if tracking is None:
        yield report, report_html
        return
    with tempfile.TemporaryDirectory(prefix="bnrecal-mlflow-") as folder:
        yield report or Path(folder) / "report.json", report_html or Path(folder) / "report.html"


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
