"""Embedding jobs in the engine: one engine request per text, one output per job.

A job embeds a list of texts (OpenAI's ``input``); the engine takes one prompt a request. So
:func:`~worker.engine_thread.serve` adds a request ``<job id>#<i>`` per text (job ids hold no
``#``) and :class:`EmbedJobs` gathers their outputs back into one ``RequestOutput`` under the
job's id, an output per text in order. The job ends when every text's request has: failed
(``error``) or aborted as the first of them that did, the others then aborted; its metrics are
those of its texts together (token counts, preemptions and GPU-seconds summed, times from the
first to the last, the peak KV of the largest).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.outputs import CompletionOutput, FinishReason, RequestMetrics, RequestOutput
from worker.messages import Embed

if TYPE_CHECKING:
    from worker.engine_thread import Engine

SEPARATOR = "#"


class EmbedJobs:
    """The embedding jobs an engine holds, by job id: each text's finished output so far."""

    def __init__(self) -> None:
        self._jobs: dict[str, list[RequestOutput | None]] = {}

    def add(self, engine: Engine, cmd: Embed) -> None:
        """Add a request per text; if the engine refuses one, abort those added and raise."""
        ids = [f"{cmd.job_id}{SEPARATOR}{i}" for i in range(len(cmd.inputs))]
        try:
            for request_id, text in zip(ids, cmd.inputs, strict=True):
                engine.add_request(request_id, text, cmd.params, priority=cmd.priority)
        except Exception:
            for request_id in ids:  # their outputs, when they come, belong to no job
                engine.abort_request(request_id)
            raise
        self._jobs[cmd.job_id] = [None] * len(ids)

    def abort(self, engine: Engine, job_id: str) -> bool:
        """Abort the unfinished texts of ``job_id``; whether it is an embedding job here."""
        parts = self._jobs.get(job_id)
        if parts is None:
            return False
        for i, part in enumerate(parts):
            if part is None:
                engine.abort_request(f"{job_id}{SEPARATOR}{i}")
        return True

    def gather(self, engine: Engine, outputs: Sequence[RequestOutput]) -> list[RequestOutput]:
        """A step's outputs with each text's replaced by its job's, once the job is done."""
        gathered = []
        for out in outputs:
            job_id, sep, index = out.request_id.rpartition(SEPARATOR)
            if not sep:
                gathered.append(out)
                continue
            parts = self._jobs.get(job_id)
            if parts is None or not out.finished:
                continue
            parts[int(index)] = out
            if out.error is not None or out.finish_reason is not FinishReason.STOP:
                self.abort(engine, job_id)  # the job cannot succeed: its other texts stop
            if all(p is not None for p in parts):
                del self._jobs[job_id]
                gathered.append(_joined(job_id, [p for p in parts if p is not None]))
        return gathered


def _joined(job_id: str, parts: list[RequestOutput]) -> RequestOutput:
    error = next((p.error for p in parts if p.error is not None), None)
    reasons = {p.finish_reason for p in parts}
    reason = (FinishReason.ERROR if error is not None or FinishReason.ERROR in reasons
              else FinishReason.ABORT if reasons != {FinishReason.STOP} else FinishReason.STOP)
    outputs = [CompletionOutput(index=i, token_ids=[], finish_reason=reason,
                                embedding=p.embedding) for i, p in enumerate(parts)]
    if reason is not FinishReason.STOP:  # no vectors for a job that did not complete
        outputs = [CompletionOutput(index=0, token_ids=[], finish_reason=reason)]
    ms = [p.metrics for p in parts]

    def first(times: list[float | None]) -> float | None:
        return min((t for t in times if t is not None), default=None)

    metrics = RequestMetrics(
        arrival_time=min(m.arrival_time for m in ms),
        first_scheduled_time=first([m.first_scheduled_time for m in ms]),
        first_token_time=first([m.first_token_time for m in ms]),
        finish_time=max((m.finish_time for m in ms if m.finish_time is not None), default=None),
        num_prompt_tokens=sum(m.num_prompt_tokens for m in ms),
        num_cached_tokens=sum(m.num_cached_tokens for m in ms),
        peak_kv_blocks=max(m.peak_kv_blocks for m in ms),
        peak_kv_bytes=max(m.peak_kv_bytes for m in ms),
        num_preemptions=sum(m.num_preemptions for m in ms),
        gpu_s=sum(m.gpu_s for m in ms),
    )
    return RequestOutput(request_id=job_id, prompt_token_ids=[], outputs=outputs, finished=True,
                         metrics=metrics, error=error)
