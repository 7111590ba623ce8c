"""Worker settings: flags or ``KVBATCH_*`` environment variables (pydantic settings).

A worker's settings are three groups, each declared once:

* where the queue and database are: ``jobs.settings.ConnectionSettings``;
* the engine: every field of ``engine.EngineConfig``, with the engine's own defaults and help
  (``--max-num-seqs`` / ``KVBATCH_MAX_NUM_SEQS``), built into an ``EngineConfig``;
* what only a worker has (its id, leases, polling, draining): :class:`WorkerSettings`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import types
import typing
import uuid
from typing import Any, Union, get_args, get_origin

from pydantic import Field, create_model, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.config import EngineConfig
from engine.lora_config import parse_lora_flags
from jobs.constants import DEFAULT_MAX_DELIVERIES
from jobs.schemas import ADAPTER_SEPARATOR, MODEL_NAME_PATTERN
from jobs.settings import ENV_PREFIX, ConnectionSettings, DeploymentModels

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # worker processes' logs


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class _EngineSettingsBase(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="forbid")


def _engine_settings_class() -> type[BaseSettings]:
    """A settings class with one field per ``EngineConfig`` field: same type, default and
    help, read from ``KVBATCH_<FIELD>``. ``EngineConfig`` validates the values."""
    hints = typing.get_type_hints(EngineConfig)
    fields: dict[str, Any] = {
        f.name: (hints[f.name], Field(f.default, description=f.metadata.get("help")))
        for f in dataclasses.fields(EngineConfig)
    }
    return create_model("EngineSettings", __base__=_EngineSettingsBase, **fields)


EngineSettings = _engine_settings_class()
ENGINE_FIELDS = tuple(EngineSettings.model_fields)


def engine_config(**given: Any) -> EngineConfig:
    """An ``EngineConfig`` of ``given`` values over the environment over the defaults."""
    return EngineConfig(**EngineSettings(**given).model_dump())


class WorkerSettings(ConnectionSettings):
    """One worker process: the engine it runs (``engine``), where the queue and database are,
    and how it leases jobs."""

    engine: EngineConfig = Field(default_factory=engine_config,
                                 description="the engine (flags: one per EngineConfig field)")
    served_model_name: str | None = Field(
        None, description="name jobs use for this model (default: --model)")
    # The jobs.worker_id column holds 128 characters; the id also names Redis keys.
    worker_id: str = Field(default_factory=default_worker_id, min_length=1, max_length=128,
                           pattern=r"^[^\s]+$", description="default: host-pid-random")
    metrics_port: int | None = Field(None, description="serve Prometheus /metrics on this port")
    metrics_host: str = Field("127.0.0.1", description="address /metrics listens on (0.0.0.0 "
                                                       "to be scraped from other hosts)")
    waiting_buffer: int = Field(8, ge=0, description="jobs held beyond max_num_seqs")
    lease_ttl_s: float = Field(10.0, gt=0, description="heartbeat TTL; dead workers' jobs "
                                                       "are claimed after it")
    max_deliveries: int = Field(DEFAULT_MAX_DELIVERIES, ge=1,
                                description="deliveries before dead-lettering")
    drain_timeout_s: float = Field(30.0, ge=0, description="on shutdown, time to finish "
                                                           "in-flight jobs")
    feed_window: int | None = Field(None, ge=1, description="jobs kept in the model's Redis "
                                    "stream for this worker, from the SQL backlog (default: "
                                    "2 x (max_num_seqs + waiting_buffer))")
    affinity: bool = Field(True, description="read the routing buckets this worker owns "
                           "first, so jobs that share a prompt prefix meet in one engine "
                           "(--no-affinity: read all buckets alike)")
    reconcile_interval_s: float = Field(30.0, gt=0, description="how often SQL and the "
                                                                "stream are compared")
    reconcile_grace_s: float = Field(10.0, ge=0, description="reconciler leaves younger "
                                                             "jobs alone")
    poll_interval_ms: int = Field(100, ge=1, description="longest wait for engine outputs "
                                  "per pass (a step's outputs end it at once)")
    engine_process: bool = Field(True, description="run the engine in a child process "
                                 "(--no-engine-process: on a thread of the worker process, "
                                 "where the loop's Python slows its steps)")

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_from_env(cls, value: Any) -> Any:
        # KVBATCH_ENGINE is not a setting: the engine comes from its own fields' variables.
        return engine_config() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _servable_name(self) -> WorkerSettings:
        if not re.fullmatch(MODEL_NAME_PATTERN, self.model_name):
            raise ValueError(f"served model name {self.model_name!r} is not one jobs can name "
                             f"({MODEL_NAME_PATTERN}); give --served-model-name")
        served = DeploymentModels().models
        if served and self.model_name not in served:
            raise ValueError(f"served model name {self.model_name!r} is not one the "
                             f"deployment serves (KVBATCH_MODELS: {', '.join(served)}); add it "
                             "there or give --served-model-name")
        return self

    @property
    def model_name(self) -> str:
        """The served model name: the queue this worker pulls from."""
        return self.served_model_name or self.engine.model

    @property
    def adapters(self) -> tuple[str, ...]:
        """The names of the LoRA adapters this worker serves (``--lora NAME=DIR``)."""
        return tuple(spec.name for spec in parse_lora_flags(self.engine.lora))

    @property
    def served_adapters(self) -> tuple[str, ...]:
        """The adapters as jobs name them: ``<served model>:<adapter>``."""
        return tuple(f"{self.model_name}{ADAPTER_SEPARATOR}{a}" for a in self.adapters)

    @property
    def capacity(self) -> int:
        """Most jobs the worker holds at once."""
        return self.engine.max_num_seqs + self.waiting_buffer

    @property
    def window(self) -> int:
        """Jobs this worker wants kept in the stream (held or waiting): ``--feed-window``."""
        return self.feed_window or 2 * self.capacity


WORKER_FIELDS = tuple(name for name in WorkerSettings.model_fields if name != "engine")


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per engine field and per worker setting; unset flags fall back to the
    environment, then to the defaults shown by ``--help``."""
    engine = parser.add_argument_group("engine (EngineConfig; env KVBATCH_<FIELD>)")
    for name, field in EngineSettings.model_fields.items():
        add_flag(engine, name, field)
    worker = parser.add_argument_group("worker (env KVBATCH_<FIELD>)")
    for name in WORKER_FIELDS:
        add_flag(worker, name, WorkerSettings.model_fields[name])


def worker_settings(**given: Any) -> WorkerSettings:
    """Settings from flat values, as flags name them: engine fields (``max_num_seqs=…``) and
    worker settings side by side; what is not given comes from the environment."""
    unknown = set(given) - set(ENGINE_FIELDS) - set(WORKER_FIELDS)
    if unknown:
        raise ValueError(f"unknown worker settings: {', '.join(sorted(unknown))}")
    engine = engine_config(**{k: v for k, v in given.items() if k in ENGINE_FIELDS})
    return WorkerSettings(engine=engine, **{k: v for k, v in given.items() if k in WORKER_FIELDS})


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    known = set(ENGINE_FIELDS) | set(WORKER_FIELDS)
    return worker_settings(**{k: v for k, v in vars(args).items() if k in known})


def add_flag(group: Any, name: str, field: Any) -> None:
    """``--name`` for a pydantic field: its type, its description and default as help, a
    ``--no-`` form for booleans; unset, it falls back to the environment."""
    kind = _scalar(field.annotation)
    default = "computed" if field.default_factory is not None else field.default
    help_text = f"{field.description or ''} (default: {default})".lstrip()
    kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
    flag = "--" + name.replace("_", "-")
    if kind is bool:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
    elif get_origin(field.annotation) is tuple:  # a repeatable flag: --lora a=/x --lora b=/y
        group.add_argument(flag, action="append", **kwargs)
    else:
        group.add_argument(flag, type=kind, **kwargs)


def _scalar(annotation: Any) -> type:
    if get_origin(annotation) in (Union, types.UnionType):
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    return annotation if annotation in (int, float, bool) else str
