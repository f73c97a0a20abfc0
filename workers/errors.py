"""The one error hierarchy of bnrecal.

Every error a user can cause or see derives from :class:`BnrecalError`. Each class
carries the HTTP status and problem ``title`` it maps to, so the CLI (exit code 2 for
:class:`InputError`, 1 otherwise) and the HTTP API (problem+json) render them the same
way. Messages are one line and name the thing to fix (a key, a field, a setting).

    BnrecalError
    ├── InputError                 bad input from the user: CLI exit 2, HTTP 4xx
    │   ├── ArchitectureError      unknown or disallowed ``arch``
    │   ├── CheckpointError        unreadable, unsafe or mismatching checkpoint
    │   ├── ProgramError           a ``torch.export`` program that cannot be loaded
    │   │                          safely or calibrated
    │   ├── DatasetError           unreadable, empty or unsafe calibration data
    │   ├── ModelInputError        the model rejects the data (shape, dtype)
    │   ├── NoBatchNormError       nothing to recalibrate
    │   ├── UnsupportedLayerError  a BN layer that never normalises through
    │   │                          F.batch_norm, so it cannot be calibrated
    │   ├── SpecError              an invalid option or job field
    │   ├── NotFoundError          unknown blob, job or artifact (HTTP 404)
    │   ├── AuthenticationError    missing or wrong API key (HTTP 401)
    │   ├── PayloadTooLargeError   an upload over the byte cap (HTTP 413)
    │   │   └── QuotaExceededError an upload past the tenant's byte quota (HTTP 413)
    │   ├── TooManyJobsError       a job past the tenant's queued-job limit (HTTP 429)
    │   ├── CorruptBlobError       a stored blob whose bytes no longer hash to its
    │   │                          digest: quarantined, to be uploaded again (HTTP 422)
    │   └── HeadersTooLargeError   request headers over the server's limit (HTTP 431)
    ├── ServiceUnavailableError    the server is shutting down (HTTP 503)
    ├── RunError                   the run itself failed: a rank died, a collective
    │   │                          timed out, the cluster is unreachable
    │   ├── CallOrderError         ranks reduced different BN layers in one
    │   │                          collective (their BN call order differs)
    │   └── CancelledError         the run was cancelled
    ├── ExportError                the ONNX export could not be made or verified
    └── InsufficientStorageError   the server's disk is full (HTTP 507)
"""

from __future__ import annotations


class BnrecalError(Exception):
    """Base of every error bnrecal raises on purpose."""

    status: int = 500
    title: str = "Internal error"
    exit_code: int = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def type(self) -> str:
        """A stable identifier for the problem type (used as problem+json ``type``)."""
        name = type(self).__name__.removesuffix("Error") or "Bnrecal"
        return "https://bnrecal.dev/problems/" + "".join(
            "-" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(name)
        )

    def __str__(self) -> str:
        return self.message


class InputError(BnrecalError):
    """The user's input is wrong; fixing the input fixes the problem."""

    status = 400
    title = "Bad input"
    exit_code = 2


class ArchitectureError(InputError):
    """The ``arch`` reference is unknown, unavailable or not allowed."""

    status = 422
    title = "Unknown or disallowed architecture"
    field = "arch"  # the job spec field (and CLI flag --arch) at fault


class CheckpointError(InputError):
    """The checkpoint cannot be read safely or does not match the architecture."""

    status = 422
    title = "Invalid checkpoint"


class ProgramError(InputError):
    """A ``torch.export`` program (``.pt2``) that is not a valid archive, would need code
    run to load (a pickle, an arbitrary callable), or whose graph cannot be calibrated."""

    status = 422
    title = "Invalid program"
    field = "program"  # the job spec field (and CLI flag --program) at fault


class DatasetError(InputError):
    """The calibration data cannot be read, is empty, or is unsafe to unpack."""

    status = 422
    title = "Invalid calibration data"


class ModelInputError(InputError):
    """The model rejects the calibration samples (wrong shape or type)."""

    status = 422
    title = "Data does not fit the model"


class NoBatchNormError(InputError):
    """The model has no BatchNorm layer whose statistics could be recalibrated."""

    status = 422
    title = "No BatchNorm layer to recalibrate"


class UnsupportedLayerError(InputError):
    """A BN layer whose forward never normalises through ``F.batch_norm`` with its own
    running buffers: its statistics cannot be replaced, so it cannot be calibrated."""

    status = 422
    title = "BatchNorm layer cannot be calibrated"

    def __init__(self, message: str, layer: str | None = None, layer_class: str | None = None) -> None:
        super().__init__(message)
        self.layer = layer
        self.layer_class = layer_class


class SpecError(InputError):
    """An option or job field has an invalid value."""

    status = 422
    title = "Invalid job specification"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class NotFoundError(InputError):
    """The blob, job or artifact does not exist (or belongs to another tenant)."""

    status = 404
    title = "Not found"


class AuthenticationError(InputError):
    """The request carries no valid API key."""

    status = 401
    title = "Unauthorized"


class PayloadTooLargeError(InputError):
    """An upload is larger than the operator allows."""

    status = 413
    title = "Payload too large"


class QuotaExceededError(PayloadTooLargeError):
    """An upload would take the tenant past its storage quota (``BNRECAL_TENANT_QUOTA_BYTES``)."""

    title = "Storage quota exceeded"


class TooManyJobsError(InputError):
    """A tenant already has as many queued jobs as it may (``BNRECAL_TENANT_MAX_QUEUED_JOBS``);
    the request may be retried once some have started."""

    status = 429
    title = "Too many queued jobs"


class CorruptBlobError(InputError):
    """A stored blob whose bytes no longer hash to its digest (damaged on disk or in the
    bucket): it was quarantined, so the next upload of the right bytes stores it again."""

    status = 422
    title = "Corrupt blob"

    def __init__(self, message: str, field: str | None = None, digest: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.digest = digest


class HeadersTooLargeError(InputError):
    """A request whose header section is larger than the HTTP server reads."""

    status = 431
    title = "Request header fields too large"


class ServiceUnavailableError(BnrecalError):
    """The server is shutting down and takes no new work; the request may be retried later."""

    status = 503
    title = "Service unavailable"


class RunError(BnrecalError):
    """The calibration run failed for a reason other than its input."""

    status = 500
    title = "Calibration run failed"

    def __init__(self, message: str, rank: int | None = None, node: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.node = node


class CallOrderError(RunError):
    """In ``sync`` mode, ranks entered one collective for different BN layers."""

    title = "BatchNorm call order differs between ranks"


class CancelledError(RunError):
    """The run was cancelled before it finished."""

    status = 409
    title = "Cancelled"


class ExportError(BnrecalError):
    """The ONNX export could not be produced or failed its verification."""

    status = 500
    title = "ONNX export failed"


class InsufficientStorageError(BnrecalError):
    """The server ran out of disk space while writing; nothing partial was kept."""

    status = 507
    title = "Insufficient storage"


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first non-empty line of an exception's message (or its class name), at most
    ``limit`` characters: what a one-line error shows of a cause it wraps."""
    for line in str(exc).strip().splitlines():
        if line.strip():
            return line.strip()[:limit]
    return type(exc).__name__


def one_line(exc: BaseException, limit: int = 200) -> str:
    """``Type: message`` of an exception on one line, whitespace collapsed, at most about
    ``limit`` characters: for causes whose type tells as much as their text."""
    text = " ".join(str(exc).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
