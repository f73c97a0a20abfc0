"""The run options: how to recalibrate, declared once.

``RecalibrationOptions`` is the one declaration of every option a recalibration takes,
whatever the model and data (``bnrecal.RecalibrationOptions``, what ``bnrecal.recalibrate``
takes); ``RunOptions`` adds the model as a job names it (an architecture and its kwargs).
The HTTP job spec (``JobSpec``) and the engine's request (``RecalibrationRequest``) extend
``RunOptions``, and the command line takes its choices, defaults and help from it, so adding
an option touches this model and the code that uses it, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError, PydanticKnownError

from bnrecal.workers.engine.modes import Mode
from bnrecal.errors import SpecError

from bnrecal.service.export.opsets import DEFAULT_OPSET
from bnrecal.service.settings import Placement

Device = Literal["cpu", "cuda"]

Order = Literal["shuffled", "given"]
"""The sample orders of ``workers.data.order`` (declared here too, so that declaring the
options loads no torch; tests/service/run/test_order_options.py checks they agree)."""

AUTO = "auto"
DEFAULT_TOLERANCE = 0.05
"""``max_samples: "auto"`` stops once every layer's standard errors, worst channel, are below
this: 5% on the variance (relative) and on the mean (in std units). Measured
(docs/calibration.md#how-many-samples, bench/sample_count.py): on the digits value case
held-out accuracy is already within its noise of all the data's at 0.1 (about 600
samples); 0.05 keeps a factor of two in hand."""

MAX_WORKERS = 1024

STARTING_PHASE = "starting workers"
"""The progress phase of a job whose rank actors are starting, before any sample is processed:
the ledger's first phase of a running job, and one the CLI shows without a count."""

OptionsT = TypeVar("OptionsT", bound="RecalibrationOptions")


class RecalibrationOptions(BaseModel):
    """How to recalibrate, whatever the model and data are: every option of a recalibration,
    once (docs/python.md, "Options"). ``bnrecal.recalibrate(model, data, options)`` takes it;
    keywords given beside it override its fields.

    Counts are strict integers: ``true`` or ``"2"`` for ``workers`` is refused, naming the
    field, rather than read as 1 or 2 (a JSON spec with a quoted number is a client bug).
    """

    model_config = ConfigDict(extra="forbid")

    mode: Mode = Field(default="sync", description="sync: SyncBN statistics across ranks; local: per-rank statistics.")
    workers: StrictInt = Field(default=1, ge=1, le=MAX_WORKERS, description="Ray actors (ranks).")
    batch_size: StrictInt = Field(default=32, ge=1, le=1_000_000, description="Global batch size B.")
    max_samples: StrictInt | Literal["auto"] | None = Field(
        default=None,
        description='Use only the first M samples of the order, or "auto": read until the statistics converge '
        "(every layer's standard errors below tolerance; sync mode).",
    )
    order: Order = Field(
        default="shuffled",
        description="shuffled: the samples in a seeded random order, so any subset and every batch is a fair "
        "draw; given: the file order.",
    )
    seed: StrictInt = Field(default=0, ge=0, le=2**63 - 1, description="Seed of the shuffled order.")
    tolerance: float | None = Field(
        default=None,
        gt=0,
        lt=1,
        description=f'With max_samples "auto": the standard error to reach (default {DEFAULT_TOLERANCE:g}, '
        "i.e. 5% on the variance, worst channel).",
    )
    image_column: str | None = Field(
        default=None, min_length=1, max_length=256,
        description="Parquet, Arrow or MDS data (calibration and evaluation alike): the column of encoded images "
        "(default: image, or the one column that holds image bytes).",
    )
    label_column: str | None = Field(
        default=None, min_length=1, max_length=256,
        description="Parquet, Arrow or MDS evaluation data: the column of integer labels (default: label).",
    )
    device: Device = Field(default="cpu", description="Where the ranks compute.")
    transform: dict[str, Any] | None = Field(
        default=None, description='Image transform (image data only), e.g. {"resize": 256, "crop": 224}.'
    )
    placement: Placement | None = Field(
        default=None, description="Spread ranks across nodes or pack them (default: BNRECAL_PLACEMENT_STRATEGY)."
    )
    max_retries: StrictInt | None = Field(
        default=None, ge=0, le=10, description="Re-run a failed pass from scratch (default: BNRECAL_MAX_RETRIES)."
    )

    @field_validator("max_samples", mode="before")
    @classmethod
    def _samples(cls, value: object, info: ValidationInfo) -> object:
        """A count or ``auto``, one message for both; ``auto`` needs the global statistics every
        step (sync mode)."""
        if value == AUTO:
            if info.data.get("mode", "sync") != "sync":
                raise ValueError(
                    'max_samples "auto" needs mode sync: in local mode the ranks see no global statistics '
                    "until the end, so they cannot stop together; give a number of samples"
                )
            return value
        if value is None:
            return value
        if isinstance(value, bool) or not isinstance(value, int):  # worded like pydantic's own type errors
            raise PydanticCustomError("int_type", 'Input should be a valid integer or "auto"')
        if value < 1:
            raise PydanticKnownError("greater_than_equal", {"ge": 1})
        if value > 2**53:
            raise PydanticKnownError("less_than_equal", {"le": 2**53})
        return value

    @field_validator("tolerance")
    @classmethod
    def _tolerance_with_auto(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and info.data.get("max_samples") != AUTO:
            raise ValueError('tolerance applies only with max_samples "auto"')
        return value

    @property
    def auto_samples(self) -> bool:
        """Whether the run reads until its statistics converge (``max_samples: "auto"``)."""
        return self.max_samples == AUTO

    @property
    def sample_limit(self) -> int | None:
        """The number of samples asked for, None for all of them (or ``auto``)."""
        return None if self.max_samples == AUTO else self.max_samples  # type: ignore[return-value]

    @property
    def stop_tolerance(self) -> float:
        """The tolerance ``auto`` stops at."""
        return DEFAULT_TOLERANCE if self.tolerance is None else self.tolerance

    @classmethod
    def checked(cls: type[OptionsT], **values: Any) -> OptionsT:
        """Validate ``values``, turning the first problem into a ``SpecError`` naming its field."""
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise spec_error(exc) from None

    def explicit(self) -> dict[str, Any]:
        """The fields given when it was made (not their defaults): what a caller asked for."""
        return self.model_dump(include=self.model_fields_set)


class RunOptions(RecalibrationOptions):
    """What to recalibrate and how, whatever the checkpoint and data are: the recalibration
    options and the model as a job names it (an architecture and its kwargs; a job may give
    a program instead)."""

    arch: str | None = Field(
        default=None,
        min_length=3,
        max_length=256,
        description=(
            "torchvision:<name>, timm:<name>, transformers:<ModelClass> (model_kwargs: its config.json) "
            "or <module.path>:<callable> (allowlisted); not with a program, which carries its own architecture."
        ),
        examples=["torchvision:resnet18"],
    )
    model_kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the model factory.")

    def run_options(self) -> dict[str, Any]:
        """Just the run options, e.g. to build the engine's request from a job spec."""
        return self.model_dump(include=set(RunOptions.model_fields))


def spec_error(exc: ValidationError) -> SpecError:
    """The first validation problem as one line naming the field (``workers: ...``)."""
    first = exc.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or None
    text = first["msg"].removeprefix("Value error, ")
    message = f"{field}: {text}" if field else text
    return SpecError(message, field=field)


def default(name: str) -> Any:
    """The default of one run option (what the CLI shows and uses)."""
    return RunOptions.model_fields[name].get_default(call_default_factory=True)


def description(name: str) -> str:
    """The help text of one run option."""
    return RunOptions.model_fields[name].description or ""


def flag_of(field: str) -> str:
    """The command-line flag of a run option's field (``image_column`` -> ``--image-column``)."""
    return f"--{field.replace('_', '-')}"


def check_model_choice(
    arch: str | None, checkpoint: object | None, program: object | None, model_kwargs: dict[str, Any] | None,
    *, flags: bool = False,
) -> None:
    """Refuse a request that names no model, or both kinds: an architecture takes a
    checkpoint, a program carries both. ``flags`` words the error for the command line."""
    def name(field: str) -> str:
        return flag_of(field) if flags else field

    if program is not None:
        for field, value in (("arch", arch), ("checkpoint", checkpoint)):
            if value is not None:
                raise SpecError(
                    f"{name(field)} does not go with {name('program')}: a program carries its architecture and weights",
                    field=name(field),
                )
        if model_kwargs:
            raise SpecError(f"{name('model_kwargs')} does not go with {name('program')}", field=name("model_kwargs"))
        return
    if arch is None and checkpoint is None:
        raise SpecError(
            f"give {name('program')} (a torch.export .pt2), or {name('arch')} with {name('checkpoint')}",
            field=name("program"),
        )
    for field, value in (("arch", arch), ("checkpoint", checkpoint)):
        if value is None:
            raise SpecError(f"{name(field)} is required with an architecture (or give {name('program')})", field=name(field))


@dataclass(frozen=True)
class ExportOptions:
    """How a run's folded ONNX export is made (docs/onnx.md): the opset, the float type, a
    dynamic batch axis, and the per-sample shape to export at (default: the data's)."""

    opset: int = DEFAULT_OPSET
    dtype: Literal["float32", "float16"] = "float32"
    dynamic_batch: bool = True
    input_shape: tuple[int, ...] | None = None
