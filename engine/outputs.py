"""What the engine returns: per-request outputs, their metrics and engine-wide statistics
(torch-free: the worker process reads them without loading torch)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FinishReason(StrEnum):
    """Why a sample ended: the engine's word, stored with the job (OpenAI's view maps
    ``abort`` to ``stop``)."""

    STOP = "stop"  # EOS, a stop token or string, or a complete grammar
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # cancelled, past its deadline, or handed back
    ERROR = "error"  # failed alone (bad input, or its part of a step raised)


@dataclass
class RequestMetrics:
    """Timing (``time.monotonic()`` seconds) and memory figures of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    peak_kv_blocks: int = 0
    peak_kv_bytes: int = 0
    num_preemptions: int = 0
    # The request's share of the engine steps it took part in: each step's time (its forward
    # and sampling, ``LLMEngine.step_clock`` seconds) split equally among the requests in it.
    # On a GPU worker these are GPU-seconds; the shares of a step add up to its time.
    gpu_s: float = 0.0


@dataclass
class CompletionOutput:
    """One sample of a request. ``text`` is filled in when the sample finishes. An embedding
    request's one output has no tokens and holds its L2-normalized ``embedding``."""

    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[dict[int, float]] | None = None
    embedding: list[float] | None = None


@dataclass
class RequestOutput:
    """A request's state after a step; ``finished`` once every sample has finished."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def embedding(self) -> list[float] | None:
        return self.outputs[0].embedding if self.outputs else None

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason if self.outputs else FinishReason.ERROR


@dataclass
class SchedulerCounters:
    """What the scheduler has done since the engine started (cumulative)."""

    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0
    num_swaps: int = 0  # of those, preemptions that swapped the KV out rather than dropping it
    num_prompt_tokens: int = 0  # prefill tokens actually run through the model
    num_generated_tokens: int = 0
    num_steps: int = 0
    num_batched_tokens: int = 0  # tokens run through the model, all steps


@dataclass(kw_only=True)
class EngineStats(SchedulerCounters):
    """Engine-wide counters (cumulative: the scheduler's, and grammar compiles) and gauges
    (current)."""

    num_running: int
    num_waiting: int
    num_swapped: int  # preempted, KV in the host pool
    num_kv_blocks_total: int
    num_kv_blocks_free: int
    kv_usage: float
    kv_bytes_per_block: int
    num_grammar_compiles: int = 0  # response formats compiled (each distinct one once)
    cpu_threads: int = 0  # threads of its CPU work, as its own thread sees them

    @property
    def tokens_per_step(self) -> float:
        return self.num_batched_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries
