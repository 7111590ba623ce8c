"""A sequence: one stream of tokens the scheduler moves through waiting -> running -> finished."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.outputs import FinishReason, RequestMetrics
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from concurrent.futures import Future

    import xgrammar as xgr

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted, its KV in the host pool
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Tokens (prompt + output), how many have KV in the cache, and the blocks holding them.

    ``block_table``, ``host_block_table`` and ``block_hashes`` are maintained by the KV cache
    manager; ``num_computed_tokens`` by the scheduler. A swapped-out sequence keeps its
    ``num_computed_tokens``: ``host_block_table`` holds their KV, ``block_table`` is empty.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    priority: int = 0
    arrival_order: int = 0
    index: int = 0  # sample index within the request (n > 1)
    cache_salt: str | None = None
    lora: str | None = None  # the LoRA adapter it runs with (None: the base model)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    block_table: list[int] = field(default_factory=list)
    host_block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks of block_table registered in the prefix cache
    pending_forks: int = 0  # children still to fork at the first sample (n > 1)
    generator: torch.Generator | None = None
    fork_generators: list[torch.Generator] = field(default_factory=list)  # seeded children's
    logprobs: list[dict[int, float]] = field(default_factory=list)
    grammar: xgr.GrammarMatcher | None = None  # follows the output of a constrained request
    # Its grammar still compiling: the scheduler admits it once this is done (and cleared).
    pending_grammar: Future[xgr.CompiledGrammar] | None = None
    grammar_error: str | None = None  # a sampled token the grammar refused
    # A prompt-only (embedding) request: prefilled, pooled, finished; ``params`` unused.
    pooling: PoolingParams | None = None
    reads_cached_prefix: bool = True  # False: every prompt row is computed (mean/CLS pooling)
    pooled: torch.Tensor | None = None  # the sum of its chunks' pooling partials so far
    embedding: list[float] | None = None  # set when its prompt is done

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.pending_forks = self.params.n - 1
        seed = self.params.seed
        if seed is not None:
            # Sample i of a request draws from seed + i, as vLLM's parallel sampling does.
            self.generator = torch.Generator().manual_seed(seed + self.index)
            self.fork_generators = [
                torch.Generator().manual_seed(seed + self.index + k)
                for k in range(1, self.pending_forks + 1)
            ]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append(self, token: int, logprobs: dict[int, float] | None) -> None:
        """Add a sampled token; a constrained sequence's grammar accepts it too."""
        self.token_ids.append(token)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if self.grammar is not None and not self.grammar.accept_token(token):
            self.grammar_error = f"token {token} is not allowed by the response_format here"

    def sort_key(self) -> tuple[int, int, int]:
        """Scheduling order: lower priority value first, then arrival, then sample index."""
        return (self.priority, self.arrival_order, self.index)

    def fork(self, index: int) -> Sequence:
        """A sibling sample with the same tokens so far; the caller shares the blocks."""
        child = Sequence(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            params=self.params,
            metrics=self.metrics,
            priority=self.priority,
            arrival_order=self.arrival_order,
            index=index,
            cache_salt=self.cache_salt,
            lora=self.lora,
        )
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        child.block_hashes = list(self.block_hashes)
        child.num_cached_blocks = self.num_cached_blocks
        child.pending_forks = 0
        if self.fork_generators:
            child.generator = self.fork_generators[index - self.index - 1]
        else:
            child.generator = None
        child.fork_generators = []
        child.logprobs = list(self.logprobs)
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        return child


@dataclass(eq=False)
class Request:
    """A request and its samples: one sequence until its first token, then ``params.n``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs) and len(self.seqs) == self.params.n
