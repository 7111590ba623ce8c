"""kvbatch job contract and client SDK: ``from jobs import Client, AsyncClient, Pipeline``
(``RemoteClient``: a pipeline's client on the HTTP API)."""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Client": "jobs.sdk", "JobHandle": "jobs.sdk", "BatchHandle": "jobs.sdk",
    "BatchCounts": "jobs.sdk", "JobFailed": "jobs.sdk",
    "Pipeline": "jobs.pipeline", "RemoteClient": "jobs.remote",
    "AsyncClient": "jobs.aio", "AsyncJobHandle": "jobs.aio", "AsyncBatchHandle": "jobs.aio",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    # Lazy, so that workers importing jobs.constants do not load the SDK.
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jobs' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
