"""Per-request sampling parameters, validated at construction.

The one definition of a job's sampling fields: the engine takes it as is, and the job schema
(``jobs.schemas.JobSpec.sampling``) uses it as a pydantic field type, so a value is checked
where the job is submitted, with the same rules and messages. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

MAX_LOGPROBS = 20
# Integer fields are 32-bit (token ids, counts); seeds are 63-bit, so that ``seed + i`` of
# sample i of a request still fits the generator's seed.
MAX_INT32 = 2**31 - 1
MAX_N = 2**16
MAX_SEED = 2**63 - 1 - MAX_N


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output.

    Args:
        n: parallel samples of the same prompt; they share the prompt's KV blocks.
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: keep the smallest set of tokens whose probability reaches ``top_p`` (1 = off).
        top_k: keep the ``top_k`` most likely tokens (0 = off).
        min_p: drop tokens less likely than ``min_p`` times the most likely one (0 = off).
        seed: per-request seed; the same request with the same seed gives the same tokens.
        max_tokens: most tokens to generate.
        min_tokens: EOS, stop tokens and stop strings are ignored before this many tokens.
        stop: strings that end generation (not included in the text).
        stop_token_ids: token ids that end generation, besides EOS.
        ignore_eos: keep generating past EOS.
        repetition_penalty: > 1 discourages tokens already in the prompt or output (1 = off).
        presence_penalty: subtracted from logits of tokens already generated.
        frequency_penalty: subtracted per occurrence from logits of generated tokens.
        logprobs: return the log-probabilities of the sampled token and of the top ``logprobs``
            tokens at each step (None = off).
    """

    # Read by pydantic where this dataclass is a field type (the job schema): unknown fields
    # are refused and inf/NaN are not JSON. Plain dict: no pydantic import here.
    __pydantic_config__: ClassVar[dict[str, Any]] = {"extra": "forbid", "allow_inf_nan": False}

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] | list[str] | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Normalise lists to tuples so params stay hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _check_int(self, "n", lo=1, hi=MAX_N)
        _check_float(self, "temperature", lo=0.0)
        _check_float(self, "top_p", lo=0.0, lo_open=True, hi=1.0)
        _check_int(self, "top_k", lo=0, hi=MAX_INT32)
        _check_float(self, "min_p", lo=0.0, hi=1.0)
        if self.seed is not None:
            _check_int(self, "seed", lo=0, hi=MAX_SEED)
        _check_int(self, "max_tokens", lo=1, hi=MAX_INT32)
        _check_int(self, "min_tokens", lo=0, hi=MAX_INT32)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT32
                   for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of integers in [0, 2**31 - 1]")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        _check_float(self, "repetition_penalty", lo=0.0, lo_open=True)
        _check_float(self, "presence_penalty", lo=-2.0, hi=2.0)
        _check_float(self, "frequency_penalty", lo=-2.0, hi=2.0)
        if self.logprobs is not None:
            _check_int(self, "logprobs", lo=0, hi=MAX_LOGPROBS)
        if self.n > 1 and self.temperature == 0.0:
            raise ValueError("n > 1 needs temperature > 0: greedy samples would all be equal")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _check_int(p: SamplingParams, name: str, lo: int, hi: int | None = None) -> None:
    value = getattr(p, name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _check_float(
    p: SamplingParams, name: str, lo: float, hi: float | None = None, lo_open: bool = False
) -> None:
    value = getattr(p, name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    too_low = value <= lo if lo_open else value < lo
    if too_low or (hi is not None and value > hi):
        left = "(" if lo_open else "["
        bound = f"> {lo}" if hi is None and lo_open else (
            f">= {lo}" if hi is None else f"in {left}{lo}, {hi}]"
        )
        raise ValueError(f"{name} must be {bound}, got {value}")
