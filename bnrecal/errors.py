"""The one error hierarchy of bnrecal.

Every error a user can cause or see derives from :class:`BnrecalError`, whichever part of
the product raised it (the CLI, the HTTP API, the Python API, a rank on the cluster), so
``except bnrecal.InputError`` catches a bad checkpoint the same way everywhere. A message
is one line, written whole where the error is raised, and names the thing to fix (a key,
a field, a setting, the file as the user named it).

This module knows nothing of how an error is shown: the command line's exit code (2 for
an :class:`InputError`, 1 otherwise) lives in ``bnrecal.service.cli.console``, each class's
HTTP status, problem title and problem ``type`` in ``bnrecal.service.jobserver.problems``
(docs/errors.md). It imports nothing, so every part of the product may import it.

    BnrecalError
    ├── InputError                 bad input from the user; fixing the input fixes it
    │   ├── ArchitectureError      unknown or disallowed ``arch``
    │   ├── CheckpointError        unreadable, unsafe or mismatching checkpoint
    │   ├── ProgramError           a ``torch.export`` program that cannot be loaded
    │   │                          safely or calibrated
    │   ├── DatasetError           unreadable, empty or unsafe calibration data
    │   │   └── DatasetOptionError a data option with an invalid value (also a SpecError)
    │   ├── ModelInputError        the model rejects the data (shape, dtype)
    │   ├── EvaluationError        the model's output or the labels cannot be evaluated
    │   ├── NoBatchNormError       nothing to recalibrate
    │   ├── UnsupportedLayerError  a BN layer that never normalises through
    │   │                          F.batch_norm, so it cannot be calibrated
    │   ├── SpecError              an invalid option or job field
    │   ├── NotFoundError          unknown blob, job or artifact
    │   ├── ConflictError          the request conflicts with a job's or blob's state
    │   ├── AuthenticationError    missing or wrong API key
    │   ├── PayloadTooLargeError   an upload over the byte cap
    │   │   └── QuotaExceededError an upload past the tenant's byte quota
    │   ├── TooManyJobsError       a job past the tenant's queued-job limit
    │   ├── TooManyStreamsError    a change stream past the tenant's open-stream limit
    │   ├── CorruptBlobError       a stored blob whose bytes no longer hash to its
    │   │                          digest: quarantined, to be uploaded again
    │   └── HeadersTooLargeError   request headers over the server's limit
    ├── ServiceUnavailableError    the server is shutting down
    ├── RunError                   the run itself failed: a rank died, a collective
    │   │                          timed out, the cluster is unreachable
    │   ├── CallOrderError         ranks reduced different BN layers in one
    │   │                          collective (their BN call order differs)
    │   └── CancelledError         the run was cancelled
    ├── ExportError                the ONNX export could not be made or verified
    │   ├── Int8GuardError         the INT8 file failed its accuracy guard (the
    │   │                          other outputs are still written)
    │   └── Int8GuardUnreachableError  the guard cannot hold within max_float_ops
    ├── InsufficientStorageError   the server's disk is full
    └── TrackingError              the job's files are written, but its MLflow run
                                   could not be logged

:func:`first_line` and :func:`one_line` quote a wrapped cause inside such a message.
"""

from __future__ import annotations

__all__ = [
    "ArchitectureError",
    "AuthenticationError",
    "BnrecalError",
    "CallOrderError",
    "CancelledError",
    "CheckpointError",
    "ConflictError",
    "CorruptBlobError",
    "DatasetError",
    "DatasetOptionError",
    "EvaluationError",
    "ExportError",
    "HeadersTooLargeError",
    "InputError",
    "InsufficientStorageError",
    "Int8GuardError",
    "Int8GuardUnreachableError",
    "ModelInputError",
    "NoBatchNormError",
    "NotFoundError",
    "PayloadTooLargeError",
    "ProgramError",
    "QuotaExceededError",
    "RunError",
    "ServiceUnavailableError",
    "SpecError",
    "TooManyJobsError",
    "TooManyStreamsError",
    "TrackingError",
    "UnsupportedLayerError",
]


class BnrecalError(Exception):
    """Base of every error bnrecal raises on purpose; ``message`` is its one line."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InputError(BnrecalError):
    """The user's input is wrong; fixing the input fixes the problem."""


class ArchitectureError(InputError):
    """The ``arch`` reference is unknown, unavailable or not allowed."""

    field = "arch"  # the job spec field (and CLI flag --arch) at fault


class CheckpointError(InputError):
    """The checkpoint cannot be read safely or does not match the architecture."""


class ProgramError(InputError):
    """A ``torch.export`` program (``.pt2``) that is not a valid archive, would need code
    run to load (a pickle, an arbitrary callable), or whose graph cannot be calibrated."""

    field = "program"  # the job spec field (and CLI flag --program) at fault


class DatasetError(InputError):
    """The calibration data cannot be read, is empty, or is unsafe to unpack."""


class ModelInputError(InputError):
    """The model rejects the calibration samples (wrong shape or type)."""


class EvaluationError(InputError):
    """The model's output or the evaluation data's labels cannot be evaluated as asked."""


class NoBatchNormError(InputError):
    """The model has no BatchNorm layer whose statistics could be recalibrated."""


class UnsupportedLayerError(InputError):
    """A BN layer whose forward never normalises through ``F.batch_norm`` with its own
    running buffers: its statistics cannot be replaced, so it cannot be calibrated."""

    def __init__(self, message: str, layer: str | None = None, layer_class: str | None = None) -> None:
        super().__init__(message)
        self.layer = layer
        self.layer_class = layer_class


class SpecError(InputError):
    """An option or job field has an invalid value; ``field`` names it where known."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class DatasetOptionError(DatasetError, SpecError):
    """A data option (``transform``, ``max_samples``, an unpack bound) has an invalid value.

    It is both a :class:`DatasetError` (the data cannot be prepared as asked) and a
    :class:`SpecError` (``field`` names the option), so callers catching either see it.
    """


class NotFoundError(InputError):
    """The blob, job or artifact does not exist (or belongs to another tenant)."""


class ConflictError(InputError):
    """The request conflicts with the resource's state (e.g. cancelling a finished job)."""


class AuthenticationError(InputError):
    """The request carries no valid API key."""


class PayloadTooLargeError(InputError):
    """An upload is larger than the operator allows."""


class QuotaExceededError(PayloadTooLargeError):
    """An upload would take the tenant past its storage quota (``BNRECAL_TENANT_QUOTA_BYTES``)."""


class TooManyJobsError(InputError):
    """A tenant already has as many queued jobs as it may (``BNRECAL_TENANT_MAX_QUEUED_JOBS``);
    the request may be retried once some have started."""


class TooManyStreamsError(InputError):
    """A tenant already holds as many change streams open as it may."""


class CorruptBlobError(InputError):
    """A stored blob whose bytes no longer hash to its digest (damaged on disk or in the
    bucket): it was quarantined, so the next upload of the right bytes stores it again."""

    def __init__(self, message: str, field: str | None = None, digest: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.digest = digest


class HeadersTooLargeError(InputError):
    """A request whose header section is larger than the server reads."""


class ServiceUnavailableError(BnrecalError):
    """The server is shutting down and takes no new work; the request may be retried later."""


class RunError(BnrecalError):
    """The calibration run failed for a reason other than its input; ``rank`` and ``node``
    say where, when known."""

    def __init__(self, message: str, rank: int | None = None, node: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.node = node


class CallOrderError(RunError):
    """In ``sync`` mode, ranks entered one collective for different BN layers."""


class CancelledError(RunError):
    """The run was cancelled before it finished."""


class ExportError(BnrecalError):
    """The ONNX export could not be produced or failed its verification."""


class Int8GuardError(ExportError):
    """The INT8 output failed its accuracy guard (``max_top1_drop``): the run's other
    outputs (checkpoint, FP32 export, report) are still written; ``section`` is the report's
    ``int8`` section saying why there is no INT8 file (``"written": false``): an
    ``Int8Section``, read by attribute or by its JSON key (``section["failure"]``)."""

    def __init__(self, message: str, section: object = None) -> None:
        super().__init__(message)
        self.section = section


class Int8GuardUnreachableError(ExportError):
    """The guard's bound cannot hold within ``max_float_ops`` ops kept in float: no INT8
    file. ``kept`` lists the ops tried in float, as the report gives them (``KeptFloat``)."""

    def __init__(self, message: str, kept: list[object] | None = None) -> None:
        super().__init__(message)
        self.kept: list[object] = kept if kept is not None else []


class InsufficientStorageError(BnrecalError):
    """The server ran out of disk space while writing; nothing partial was kept."""


class TrackingError(BnrecalError):
    """The job ran and wrote its files, but its run could not be logged to MLflow (the
    tracking store went away meanwhile): the files stand; the run says ``FAILED`` where
    the store can still be told."""


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first non-empty line of an exception's message (or its class name), at most
    ``limit`` characters: what a one-line error shows of a cause it wraps."""
    for line in str(exc).strip().splitlines():
        if line.strip():
            return line.strip()[:limit]
    return type(exc).__name__


def message_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's whole message on one line, whitespace collapsed, at most ``limit``
    characters (or its class name): for a reader's error whose cause a user must see whole."""
    return " ".join(str(exc).split())[:limit] or type(exc).__name__


def one_line(exc: BaseException, limit: int = 200) -> str:
    """``Type: message`` of an exception on one line, whitespace collapsed, at most about
    ``limit`` characters: for causes whose type tells as much as their text."""
    text = " ".join(str(exc).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
