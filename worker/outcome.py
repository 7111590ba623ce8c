"""Turn an engine's finished ``RequestOutput`` into the job's stored outcome.

The engine measures with ``time.monotonic()`` from its own arrival time; jobs are measured from
submission (wall clock, maybe on another machine). Only durations cross over: the wall-clock
wait before the engine (``admitted_at - submitted_at``) plus monotonic durations inside it.
"""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from engine.outputs import FinishReason
from jobs.schemas import (
    Choice,
    EncodingFormat,
    JobResult,
    JobSpec,
    JobStats,
    JobStatus,
    Outcome,
    TokenLogprob,
    TopLogprob,
    Usage,
)

if TYPE_CHECKING:
    from engine.outputs import RequestOutput


TokenBytes = Mapping[int, bytes]  # a token id's bytes


def engine_outcome(out: RequestOutput, spec: JobSpec, admitted_at: float,
                   abort_as: JobStatus | None, token_bytes: TokenBytes,
                   max_result_bytes: int | None = None) -> Outcome:
    """The terminal outcome of ``spec`` from its finished engine output ``out``.

    Args:
        out: the finished ``engine.RequestOutput``.
        spec: the job.
        admitted_at: ``time.time()`` when the worker handed the job to the engine.
        abort_as: why the worker aborted it (CANCELLED or EXPIRED), if it did.
        token_bytes: the bytes of the tokens in the logprobs (``Stepped.token_bytes``).
        max_result_bytes: a result larger than this (as JSON) is not stored: the job fails
            with its size and the limit, its statistics kept.
    """
    reason = out.finish_reason
    error = None
    if out.error is not None or reason == FinishReason.ERROR:
        status, error = JobStatus.FAILED, out.error or "engine error"
    elif reason == FinishReason.ABORT:
        status = abort_as or JobStatus.CANCELLED
        error = "deadline passed" if status is JobStatus.EXPIRED else "cancelled"
    else:
        status = JobStatus.SUCCEEDED
    m = out.metrics
    lead_s = admitted_at - spec.submitted_at

    def since_submission(t: float | None) -> float | None:
        return None if t is None else lead_s + (t - m.arrival_time)

    n_tokens = max((len(c.token_ids) for c in out.outputs), default=0)
    tpot_s = None
    if m.first_token_time is not None and m.finish_time is not None and n_tokens > 1:
        tpot_s = (m.finish_time - m.first_token_time) / (n_tokens - 1)
    stats = JobStats(
        queue_wait_s=since_submission(m.first_scheduled_time),
        ttft_s=since_submission(m.first_token_time),
        tpot_s=tpot_s,
        e2e_s=since_submission(m.finish_time),
        prompt_tokens=m.num_prompt_tokens,
        cached_prompt_tokens=m.num_cached_tokens,
        generated_tokens=m.num_generated_tokens,
        peak_kv_blocks=m.peak_kv_blocks,
        peak_kv_bytes=m.peak_kv_bytes,
        preemptions=m.num_preemptions,
        gpu_s=m.gpu_s,
    )
    usage = Usage(prompt_tokens=m.num_prompt_tokens, cached_prompt_tokens=m.num_cached_tokens,
                  completion_tokens=m.num_generated_tokens)
    if spec.embed is not None:
        vectors = [c.embedding for c in out.outputs if c.embedding is not None]
        result = JobResult(finish_reason=reason, usage=usage, embeddings=_encoded(
            vectors, spec.embed.encoding_format) if status is JobStatus.SUCCEEDED else None)
    else:
        result = _generated(out, spec, reason, usage, token_bytes)
    if max_result_bytes is not None:
        size = len(result.model_dump_json().encode())
        if size > max_result_bytes:  # not stored; a cancelled or expired job stays so
            over = (f"result is {size} bytes, over the limit of {max_result_bytes} "
                    "(KVBATCH_MAX_RESULT_BYTES): lower n, max_tokens or logprobs")
            if status is JobStatus.SUCCEEDED:
                status, error = JobStatus.FAILED, over
            return Outcome(spec.id, status, time.time(), stats=stats, error=error)
    return Outcome(spec.id, status, time.time(), error=error, result=result, stats=stats)


def _generated(out: RequestOutput, spec: JobSpec, reason: FinishReason | None, usage: Usage,
               token_bytes: TokenBytes) -> JobResult:
    top = spec.sampling.logprobs or 0
    choices = [
        Choice(index=c.index, text=c.text, token_ids=list(c.token_ids),
               finish_reason=c.finish_reason, logprobs=_logprobs(c.logprobs, top, token_bytes))
        for c in out.outputs
    ]
    first = choices[0] if choices else Choice(index=0, text="", token_ids=[],
                                              finish_reason=reason)
    return JobResult(
        text=first.text, token_ids=first.token_ids, finish_reason=first.finish_reason,
        logprobs=first.logprobs, usage=usage, choices=choices if len(choices) > 1 else [],
    )


def _encoded(vectors: list[list[float]],
             encoding: EncodingFormat) -> list[list[float]] | list[str]:
    """Vectors as floats, or as OpenAI's base64 of their little-endian float32 bytes."""
    if encoding == "float":
        return vectors
    return [base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() for v in vectors]


def _logprobs(steps: list[dict[int, float]] | None, top: int,
              token_bytes: TokenBytes) -> list[TokenLogprob] | None:
    """Engine logprobs (per step {token id: logprob}: the sampled token, then the ``top``
    most likely) with each token's text and bytes."""
    if steps is None:
        return None
    result = []
    for step in steps:
        entries = [_entry(token, value, token_bytes) for token, value in step.items()]
        ranked = sorted(entries, key=lambda e: -e.logprob)[:top]
        result.append(TokenLogprob(**entries[0].model_dump(), top_logprobs=ranked))
    return result


def _entry(token: int, logprob: float, token_bytes: TokenBytes) -> TopLogprob:
    raw = token_bytes[token]
    # SQL text cannot hold NUL; the bytes keep the token exact.
    text = raw.decode("utf-8", errors="replace").replace("\x00", "\ufffd")
    return TopLogprob(token=text, token_id=token, logprob=float(logprob), bytes=list(raw))
