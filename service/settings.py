"""Operator settings: one pydantic-settings class, environment variables ``BNRECAL_*``."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

if TYPE_CHECKING:
    from bnrecal.workers.data import DataAccess

Placement = Literal["spread", "pack", "strict_spread", "strict_pack"]
"""How Ray places a job's ranks (a placement group strategy): the operator's default here,
a job's own choice in the run options."""


def _split_csv(value: object) -> object:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


class Settings(BaseSettings):
    """Everything an operator can set, each with a safe default for a laptop."""

    model_config = SettingsConfigDict(env_prefix="BNRECAL_", extra="ignore")

    data_dir: Path = Field(default=Path(".bnrecal"), description="SQLite ledger, blobs, artifacts, unpacked data.")
    ray_address: str | None = Field(
        default=None,
        validation_alias=AliasChoices("BNRECAL_RAY_ADDRESS", "RAY_ADDRESS"),
        description="Existing Ray cluster to use (its RAY_AUTH_TOKEN in the environment); empty or 'local' "
        "starts an embedded instance on loopback with a token of its own.",
    )
    model_modules: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Module prefixes allowed in `<module.path>:<callable>` architectures."
    )
    cpus_per_worker: float | None = Field(
        default=None, gt=0, description="CPUs (and torch threads) per rank; default splits the local CPUs."
    )
    gpus_per_worker: float = Field(default=1.0, gt=0, description="GPUs per rank when the device is CUDA.")
    placement_strategy: Placement = Field(
        default="spread", description="Default placement of a job's ranks (a job's own `placement` wins)."
    )
    data_transport: Literal["auto", "object_store", "shared"] = Field(
        default="auto",
        description="How data reaches the ranks: the object store, or a path every node sees (shared); "
        "auto shares only on a single-node cluster that includes this process.",
    )
    kept_memory_mb: int = Field(
        default=2048,
        ge=0,
        description="Memory each rank keeps a job's decoded samples in for the job's later passes; beyond it "
        'they spill to local disk (docs/data.md, "Read once per job").',
    )
    kept_disk_mb: int = Field(
        default=16384,
        ge=0,
        description="Local disk each rank may spill a job's decoded samples to, beyond kept_memory_mb; past both, "
        "a sample is decoded again when a later pass reads it.",
    )
    max_model_bytes: int = Field(
        default=4 * 2**30,
        gt=0,
        description="Largest model (bytes of weights) a job may build: checked on the meta device at submission, "
        "before anything is allocated.",
    )
    memory_format: Literal["auto", "contiguous", "channels_last"] = Field(
        default="auto",
        description="Layout ranks compute in; auto: channels-last for image batches (4-D/5-D), "
        "the default layout otherwise.",
    )
    max_retries: int = Field(default=0, ge=0, description="Re-runs of a failed pass, from scratch (0: off).")
    job_max_retries: int = Field(
        default=1, ge=0, description="Re-runs of a server job's failed pass when its spec gives no max_retries "
        "(a retry gives identical bytes; 0: off).",
    )
    collective_timeout_s: float = Field(default=300.0, gt=0, description="Longest a job may go without progress.")
    placement_timeout_s: float = Field(default=120.0, gt=0, description="Longest to wait for the ranks' resources.")
    capacity_check: bool = Field(
        default=True,
        description="Refuse (422) at submission a job the cluster as it is now could never place (more CPUs or "
        "GPUs per job than it has, cuda without GPUs); false for a cluster that autoscales to fit.",
    )
    warm_pool_idle_s: float = Field(
        default=60.0,
        ge=0,
        description="Seconds the server keeps a finished job's rank actors warm for the next job of the "
        "same shape before giving their CPUs back; 0: no warm pool.",
    )
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list, description="Bearer keys; empty: no auth.")
    max_upload_bytes: int = Field(default=8 * 1024**3, gt=0, description="Largest accepted upload, in bytes.")
    max_unpacked_bytes: int | None = Field(
        default=None, gt=0,
        description="Largest total an archive (or a compressed .npz array) may unpack to, in bytes; "
        "default: 2 x max_upload_bytes.",
    )
    max_compression_ratio: float = Field(
        default=50.0, ge=1,
        description="An archive member (or archive, or compressed .npz array) that expands more than this "
        "is refused as a bomb.",
    )
    data_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=list, description="Server folders a job may read `data: {path}` from; empty: none."
    )
    data_uris: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Object-storage prefixes a job may read `data: {uri}` from (`s3://bucket/prefix`, "
        "comma-separated); empty: none. Credentials come from the server's AWS environment.",
    )
    s3_endpoint_url: str | None = Field(
        default=None,
        description="S3-compatible endpoint for `s3://` data (e.g. MinIO); default: the AWS environment's "
        "(AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, else AWS itself).",
    )
    blob_store: str | None = Field(
        default=None,
        description="Where blobs and artifacts are kept: empty, files under data_dir; `s3://bucket/prefix`, "
        "S3-compatible object storage shared by the replicas of a replicated service (reached with "
        "s3_endpoint_url and the AWS environment), each replica caching what it reads under data_dir.",
    )
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL of the job ledger: `sqlite:///path` or, shared by the replicas of a replicated "
        "service, `postgresql+psycopg://user:password@host/db` (the `postgres` extra); default: SQLite "
        "`ledger.db` in data_dir.",
    )
    max_concurrent_jobs: int | None = Field(
        default=None, ge=1, description="Jobs run at once; default: as many as the cluster's CPUs hold."
    )
    tenant_max_running_jobs: int | None = Field(
        default=None, ge=1,
        description="Jobs one API key may run at once; the dispatcher skips a key at its limit and starts "
        "others' jobs; default: no limit beyond the cluster.",
    )
    tenant_max_queued_jobs: int | None = Field(
        default=100, ge=1,
        description="Jobs one API key may have queued; a submission past it is 429; empty: no limit.",
    )
    job_lease_s: float = Field(
        default=30.0, gt=0,
        description="A running job's lease in the ledger, renewed every third of it by the replica running it; "
        "a job whose replica died is taken over by another replica once its lease has run out.",
    )
    ledger_poll_s: float = Field(
        default=0.5, gt=0,
        description="With a Postgres ledger shared by replicas: how often each replica reads the ledger for "
        "other replicas' job changes, for its event streams.",
    )
    rerun_interrupted: bool = Field(
        default=True, description="Run a job a crash left `running` again (once); false: fail it."
    )
    shutdown_grace_s: float = Field(
        default=30.0,
        ge=0,
        description="On SIGTERM, how long running jobs may still finish (new uploads and jobs get 503) "
        "before the rest go back to the queue.",
    )
    embedded_cpus: int | None = Field(
        default=None, ge=1, description="Logical CPUs of the embedded Ray instance of `serve`; default: the machine's."
    )
    job_retention_s: float = Field(
        default=7 * 86400.0, ge=0,
        description="Finished jobs (and their artifacts) are deleted this long after they ended.",
    )
    blob_retention_s: float = Field(
        default=86400.0, ge=0,
        description="Blobs no retained or live job references are deleted once unused this long (by mtime).",
    )
    unpack_retention_s: float = Field(
        default=6 * 3600.0, ge=0,
        description="Unpacked archives no queued or running job uses are deleted once unused this long.",
    )
    gc_interval_s: float = Field(
        default=600.0, ge=0, description="How often the server collects expired storage (0: never; `bnrecal gc`)."
    )
    scrub_interval_s: float = Field(
        default=86400.0, ge=0,
        description="How often every stored blob is re-hashed against its digest (a corrupt one is quarantined; "
        "0: never). Downloads and jobs check the blobs they read whatever this is.",
    )
    scrub_bytes_per_s: int = Field(
        default=128 * 2**20, ge=0,
        description="Most bytes a second the scrub reads, so it does not starve jobs of the disk (0: no limit).",
    )
    min_free_bytes: int = Field(
        default=256 * 2**20, ge=0,
        description="Free-space reserve of the data dir: under it, submissions are refused (507) and queued jobs "
        "fail before they run, so a job never fills the disk the ledger and the blobs live on (0: no reserve).",
    )
    tenant_quota_bytes: int | None = Field(
        default=None, gt=0,
        description="Bytes one tenant may store: blobs, artifacts and unpacked archives; default: unlimited.",
    )

    def data_access(self) -> DataAccess:
        """How this server's processes reach and unpack data (for ``describe_dataset``):
        archives unpack under ``data_dir/unpacked`` within the bounds set here, and ``s3://``
        data is read through ``s3_endpoint_url``; the rest as ``DataAccess`` defaults it."""
        from bnrecal.workers.data import DataAccess  # torch and numpy: loaded when data is described

        return DataAccess(
            unpack_root=Path(self.data_dir) / "unpacked",
            max_unpacked_bytes=self.max_unpacked_bytes or 2 * self.max_upload_bytes,
            max_compression_ratio=self.max_compression_ratio,
            endpoint_url=self.s3_endpoint_url,
        )

    @field_validator("placement_strategy", mode="before")
    @classmethod
    def _lowercase(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("tenant_max_queued_jobs", mode="before")
    @classmethod
    def _empty_is_unlimited(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("model_modules", "api_keys", "data_roots", "data_uris", mode="before")
    @classmethod
    def _csv(cls, value: object) -> object:
        return _split_csv(value)


@lru_cache
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()
