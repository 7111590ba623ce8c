"""Paged-KV LLM engine: continuous batching, chunked prefill, prefix caching, preemption.

Exports resolve lazily: ``engine.config``, ``engine.sampling_params`` and ``engine.outputs``
are torch-free, and the job side imports them without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names, for type checkers and readers
    from engine.config import EngineConfig as EngineConfig
    from engine.llm_engine import LLMEngine as LLMEngine
    from engine.outputs import CompletionOutput as CompletionOutput
    from engine.outputs import EngineStats as EngineStats
    from engine.outputs import FinishReason as FinishReason
    from engine.outputs import RequestMetrics as RequestMetrics
    from engine.outputs import RequestOutput as RequestOutput
    from engine.pooling_params import PoolingParams as PoolingParams
    from engine.sampling_params import SamplingParams as SamplingParams

_EXPORTS = {
    "CompletionOutput": "engine.outputs",
    "EngineConfig": "engine.config",
    "EngineStats": "engine.outputs",
    "FinishReason": "engine.outputs",
    "LLMEngine": "engine.llm_engine",
    "PoolingParams": "engine.pooling_params",
    "RequestMetrics": "engine.sequence",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
