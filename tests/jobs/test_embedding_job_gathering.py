"""An embedding job's texts are engine requests of their own, gathered into one output
(``worker.embed_jobs.EmbedJobs``), with a stand-in engine: in order, ended by the first text
that fails or aborts (the others aborted), refused whole when the engine refuses one text."""

from __future__ import annotations

import pytest

from engine.outputs import CompletionOutput, FinishReason, RequestMetrics, RequestOutput
from engine.pooling_params import PoolingParams
from worker.embed_jobs import EmbedJobs
from worker.messages import Embed


class StandIn:
    """Records what the worker asks of the engine; refuses the text ``"bad"``."""

    def __init__(self) -> None:
        self.added: list[str] = []
        self.aborted: list[str] = []

    def add_request(self, request_id: str, prompt: object, params: object, *,
                    priority: int = 0) -> None:
        if prompt == "bad":
            raise ValueError("prompt refused")
        self.added.append(request_id)

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)


def done(request_id: str, vector: list[float] | None, reason: FinishReason = FinishReason.STOP,
         error: str | None = None, tokens: int = 3, at: float = 1.0) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=at, first_scheduled_time=at + 1,
                             first_token_time=at + 2, finish_time=at + 3,
                             num_prompt_tokens=tokens, num_cached_tokens=1, peak_kv_blocks=tokens)
    return RequestOutput(request_id, [], [CompletionOutput(0, [], finish_reason=reason,
                                                           embedding=vector)],
                         finished=True, metrics=metrics, error=error)


def test_texts_gather_into_one_output_in_order() -> None:
    engine, jobs = StandIn(), EmbedJobs()
    jobs.add(engine, Embed("j", ["a", "b", "c"], PoolingParams()))  # type: ignore[arg-type]
    assert engine.added == ["j#0", "j#1", "j#2"]
    other = done("gen", None)
    assert jobs.gather(engine, [done("j#2", [2.0], tokens=5, at=3.0), other]) == [other]  # type: ignore[arg-type]
    (out,) = jobs.gather(engine, [done("j#0", [0.0], at=0.0), done("j#1", [1.0], tokens=4)])  # type: ignore[arg-type]
    assert out.request_id == "j" and out.finished and out.error is None
    assert [c.embedding for c in out.outputs] == [[0.0], [1.0], [2.0]]
    assert out.finish_reason is FinishReason.STOP
    m = out.metrics
    assert (m.arrival_time, m.first_token_time, m.finish_time) == (0.0, 2.0, 6.0)
    assert (m.num_prompt_tokens, m.num_cached_tokens, m.peak_kv_blocks) == (12, 3, 5)
    assert engine.aborted == []


@pytest.mark.parametrize(("reason", "error"), [(FinishReason.ERROR, "too long"),
                                               (FinishReason.ABORT, None)])
def test_the_first_text_that_does_not_finish_ends_the_job(reason: FinishReason,
                                                          error: str | None) -> None:
    engine, jobs = StandIn(), EmbedJobs()
    jobs.add(engine, Embed("j", ["a", "b", "c"], PoolingParams()))  # type: ignore[arg-type]
    assert jobs.gather(engine, [done("j#1", None, reason, error)]) == []  # type: ignore[arg-type]
    assert engine.aborted == ["j#0", "j#2"]
    (out,) = jobs.gather(engine, [done("j#0", None, FinishReason.ABORT),  # type: ignore[arg-type]
                                  done("j#2", [1.0])])
    assert out.error == error and out.finish_reason is reason
    assert [c.embedding for c in out.outputs] == [None]  # no vectors for a job that ended so


def test_a_refused_text_refuses_the_job_and_aborts_the_others() -> None:
    engine, jobs = StandIn(), EmbedJobs()
    with pytest.raises(ValueError, match="prompt refused"):
        jobs.add(engine, Embed("j", ["a", "bad", "c"], PoolingParams()))  # type: ignore[arg-type]
    assert engine.aborted == ["j#0", "j#1", "j#2"]
    # the aborted text's output belongs to no job: dropped
    assert jobs.gather(engine, [done("j#0", None, FinishReason.ABORT)]) == []  # type: ignore[arg-type]
    assert not jobs.abort(engine, "j")  # type: ignore[arg-type]


def test_abort_reaches_every_unfinished_text() -> None:
    engine, jobs = StandIn(), EmbedJobs()
    jobs.add(engine, Embed("j", ["a", "b"], PoolingParams()))  # type: ignore[arg-type]
    jobs.gather(engine, [done("j#0", [0.0])])  # type: ignore[arg-type]
    assert jobs.abort(engine, "j")  # type: ignore[arg-type]
    assert engine.aborted == ["j#1"]
    (out,) = jobs.gather(engine, [done("j#1", None, FinishReason.ABORT)])  # type: ignore[arg-type]
    assert out.finish_reason is FinishReason.ABORT and out.error is None
