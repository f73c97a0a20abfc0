"""Operator settings: one pydantic-settings class, environment variables ``BNRECAL_*``."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


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
        description="Existing Ray cluster to use; empty starts an embedded local instance.",
    )
    model_modules: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Module prefixes allowed in `<module.path>:<callable>` architectures."
    )
    cpus_per_worker: float | None = Field(
        default=None, gt=0, description="CPUs (and torch threads) per rank; default splits the local CPUs."
    )
    gpus_per_worker: float = Field(default=1.0, gt=0, description="GPUs per rank when the device is CUDA.")
    placement_strategy: Literal["SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK"] = "SPREAD"
    collective_timeout_s: float = Field(default=300.0, gt=0, description="Longest a job may go without progress.")
    placement_timeout_s: float = Field(default=120.0, gt=0, description="Longest to wait for the ranks' resources.")
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list, description="Bearer keys; empty: no auth.")
    max_upload_bytes: int = Field(default=8 * 1024**3, gt=0)
    data_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)

    @field_validator("model_modules", "api_keys", "data_roots", mode="before")
    @classmethod
    def _csv(cls, value: object) -> object:
        return _split_csv(value)


@lru_cache
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()
