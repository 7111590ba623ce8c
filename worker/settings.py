"""Worker settings: flags or ``KVBATCH_*`` environment variables (pydantic settings)."""

from __future__ import annotations

import argparse
import os
import socket
import types
import uuid
from typing import Any, Union, get_args, get_origin

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from jobs.constants import DEFAULT_KEY_PREFIX
from jobs.db import DEFAULT_DATABASE_URL


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class WorkerSettings(BaseSettings):
    """One worker process: which model it serves, where the queue and database are, and how
    it leases jobs. Engine sizing fields are passed to ``EngineConfig`` unchanged."""

    model_config = SettingsConfigDict(env_prefix="KVBATCH_", frozen=True, extra="forbid")

    model: str = Field("smollm2-135m-instruct", description="model to load (name or HF dir)")
    served_model_name: str | None = Field(
        None, description="name jobs use for this model (default: --model)")
    redis_url: str = "redis://127.0.0.1:6379/0"
    database_url: str = DEFAULT_DATABASE_URL
    key_prefix: str = DEFAULT_KEY_PREFIX
    # The jobs.worker_id column holds 128 characters; the id also names Redis keys.
    worker_id: str = Field(default_factory=default_worker_id, min_length=1, max_length=128,
                           pattern=r"^[^\s]+$")
    metrics_port: int | None = Field(None, description="serve Prometheus /metrics on this port")
    # Engine.
    dtype: str = "float32"
    device: str = "auto"
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    block_size: int | None = Field(None, ge=1)  # 16 on CUDA, 8 on the CPU
    num_kv_blocks: int | None = Field(None, ge=1)
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    enable_prefix_caching: bool = True
    seed: int = 0
    # Queue.
    waiting_buffer: int = Field(8, ge=0, description="jobs held beyond max_num_seqs")
    lease_ttl_s: float = Field(10.0, gt=0, description="heartbeat TTL; dead workers' jobs "
                                                       "are claimed after it")
    max_deliveries: int = Field(3, ge=1, description="deliveries before dead-lettering")
    drain_timeout_s: float = Field(30.0, ge=0, description="on shutdown, time to finish "
                                                           "in-flight jobs")
    reconcile_interval_s: float = Field(30.0, gt=0)
    reconcile_grace_s: float = Field(10.0, ge=0, description="reconciler leaves younger "
                                                             "jobs alone")
    poll_interval_ms: int = Field(20, ge=1)

    @model_validator(mode="after")
    def _check(self) -> WorkerSettings:
        if self.num_kv_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("give at most one of num_kv_blocks and kv_cache_memory_bytes")
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def capacity(self) -> int:
        """Most jobs the worker holds at once."""
        return self.max_num_seqs + self.waiting_buffer


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per settings field; unset flags fall back to environment and defaults."""
    for name, field in WorkerSettings.model_fields.items():
        kind = _scalar(field.annotation)
        flag = "--" + name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS,
                                  "help": field.description}
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            parser.add_argument(flag, type=kind, **kwargs)


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    given = {k: v for k, v in vars(args).items() if k in WorkerSettings.model_fields}
    return WorkerSettings(**given)


def _scalar(annotation: Any) -> type:
    if get_origin(annotation) in (Union, types.UnionType):
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    return annotation if annotation in (int, float, bool) else str
