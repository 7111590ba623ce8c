"""Paged-KV LLM engine: continuous batching, chunked prefill, prefix caching, preemption."""

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, EngineStats, RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import RequestMetrics

__all__ = [
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
]
