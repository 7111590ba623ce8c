"""``worker.outcome.engine_outcome``: a finished engine output becomes the job's outcome, every
value known: the status and error, the latencies from submission, usage, samples, logprobs
with their texts and bytes, embeddings as floats or base64, and the result size limit."""

from __future__ import annotations

import base64
import struct
import time

import pytest

from engine.outputs import CompletionOutput, FinishReason, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from jobs.schemas import (
    EmbeddingInput,
    JobSpec,
    JobStats,
    JobStatus,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from worker.outcome import engine_outcome

METRICS = dict(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0,
               finish_time=103.0, num_prompt_tokens=7, num_cached_tokens=3,
               num_generated_tokens=5, peak_kv_blocks=2, peak_kv_bytes=4096, num_preemptions=1,
               gpu_s=1.25)


def _out(*outputs: CompletionOutput, error: str | None = None, **metrics: object,
         ) -> RequestOutput:
    return RequestOutput("j", [1, 2], list(outputs), finished=True,
                         metrics=RequestMetrics(**{**METRICS, **metrics}),  # type: ignore[arg-type]
                         error=error)


def _spec(**kw: object) -> JobSpec:
    return JobSpec(id="j", model="m", submitted_at=1000.0,
                   **({"prompt": "p"} | kw))  # type: ignore[arg-type]


def _outcome(out: RequestOutput, spec: JobSpec | None = None, *,
             abort_as: JobStatus | None = None, token_bytes: dict[int, bytes] | None = None,
             max_result_bytes: int | None = None):  # type: ignore[no-untyped-def]
    return engine_outcome(out, spec or _spec(), admitted_at=1002.0, abort_as=abort_as,
                          token_bytes=token_bytes or {}, max_result_bytes=max_result_bytes)


def test_a_finished_generation_succeeds_with_every_figure() -> None:
    before = time.time()
    o = _outcome(_out(CompletionOutput(0, [5, 6, 7, 8, 9], "hello", FinishReason.LENGTH)))
    assert (o.job_id, o.status, o.error) == ("j", JobStatus.SUCCEEDED, None)
    assert before <= o.finished_at <= time.time()  # the wall clock when it finished
    # 2 s between submission and the engine, then the engine's own durations
    assert o.stats == JobStats(queue_wait_s=2.5, ttft_s=3.0, tpot_s=0.5, e2e_s=5.0,
                               prompt_tokens=7, cached_prompt_tokens=3, generated_tokens=5,
                               peak_kv_blocks=2, peak_kv_bytes=4096, preemptions=1,
                               gpu_s=1.25)
    r = o.result
    assert r is not None
    assert (r.text, r.token_ids, r.finish_reason, r.logprobs, r.choices, r.embeddings) == (
        "hello", [5, 6, 7, 8, 9], FinishReason.LENGTH, None, [], None)
    assert r.usage == Usage(prompt_tokens=7, cached_prompt_tokens=3, completion_tokens=5)


def test_times_the_engine_did_not_reach_are_none() -> None:
    o = _outcome(_out(CompletionOutput(0, [5, 6], "", FinishReason.ABORT),
                      first_scheduled_time=None, first_token_time=None, finish_time=None))
    assert o.stats is not None
    assert (o.stats.queue_wait_s, o.stats.ttft_s, o.stats.tpot_s, o.stats.e2e_s) == (
        None, None, None, None)


@pytest.mark.parametrize(("tokens", "first", "finish", "tpot"), [
    ([5], 101.0, 103.0, None),  # one token: no time per output token
    ([5, 6], 101.0, 103.0, 2.0),
    ([5, 6, 7], 101.0, 102.0, 0.5),
    ([5, 6, 7], None, 103.0, None),
    ([5, 6, 7], 101.0, None, None),
])
def test_time_per_output_token_is_after_the_first(tokens, first, finish, tpot) -> None:  # type: ignore[no-untyped-def]
    o = _outcome(_out(CompletionOutput(0, tokens, "x", FinishReason.STOP),
                      first_token_time=first, finish_time=finish))
    assert o.stats is not None and o.stats.tpot_s == tpot


def test_time_per_output_token_counts_the_longest_sample() -> None:
    o = _outcome(_out(CompletionOutput(0, [1, 2], "a", FinishReason.STOP),
                      CompletionOutput(1, [1, 2, 3, 4, 5], "b", FinishReason.STOP)),
                 _spec(sampling=SamplingParams(n=2)))
    assert o.stats is not None and o.stats.tpot_s == 0.5


@pytest.mark.parametrize(("reason", "error", "abort_as", "status", "message"), [
    (FinishReason.ERROR, None, None, JobStatus.FAILED, "engine error"),
    (FinishReason.ERROR, "prompt is too long", None, JobStatus.FAILED, "prompt is too long"),
    (FinishReason.STOP, "boom", None, JobStatus.FAILED, "boom"),
    (FinishReason.ABORT, None, None, JobStatus.CANCELLED, "cancelled"),
    (FinishReason.ABORT, None, JobStatus.CANCELLED, JobStatus.CANCELLED, "cancelled"),
    (FinishReason.ABORT, None, JobStatus.EXPIRED, JobStatus.EXPIRED, "deadline passed"),
    (FinishReason.STOP, None, JobStatus.EXPIRED, JobStatus.SUCCEEDED, None),
])
def test_status_and_error(reason, error, abort_as, status, message) -> None:  # type: ignore[no-untyped-def]
    o = _outcome(_out(CompletionOutput(0, [5], "x", reason), error=error), abort_as=abort_as)
    assert (o.status, o.error) == (status, message)


def test_an_output_without_samples_failed() -> None:
    o = _outcome(_out())
    assert (o.status, o.error) == (JobStatus.FAILED, "engine error")
    assert o.result is not None
    assert (o.result.text, o.result.token_ids, o.result.finish_reason, o.result.choices) == (
        "", [], FinishReason.ERROR, [])
    assert o.stats is not None and o.stats.tpot_s is None


def test_every_sample_is_a_choice_when_there_are_several() -> None:
    o = _outcome(_out(CompletionOutput(0, [1, 2], "ab", FinishReason.STOP),
                      CompletionOutput(1, [3], "c", FinishReason.LENGTH)),
                 _spec(sampling=SamplingParams(n=2)))
    r = o.result
    assert r is not None and (r.text, r.token_ids, r.finish_reason) == (
        "ab", [1, 2], FinishReason.STOP)
    assert [(c.index, c.text, c.token_ids, c.finish_reason, c.logprobs) for c in r.choices] == [
        (0, "ab", [1, 2], FinishReason.STOP, None), (1, "c", [3], FinishReason.LENGTH, None)]


BYTES = {1: b"a", 2: b"b\x00", 3: b"\xe2\x82", 4: b"d"}


def test_logprobs_carry_each_tokens_text_and_bytes_and_the_top_ranked() -> None:
    steps = [{3: -1.5, 1: -0.25, 2: -3.0, 4: -1}, {2: -0.5, 4: -0.75}]
    o = _outcome(_out(CompletionOutput(0, [3, 2], "x", FinishReason.STOP, logprobs=steps)),
                 _spec(sampling=SamplingParams(logprobs=2)), token_bytes=BYTES)
    assert o.result is not None
    # the sampled token first (not the most likely here); NUL and a cut character as U+FFFD
    assert o.result.logprobs == [
        TokenLogprob(token="\ufffd", token_id=3, logprob=-1.5, bytes=[0xE2, 0x82], top_logprobs=[
            TopLogprob(token="a", token_id=1, logprob=-0.25, bytes=[97]),
            TopLogprob(token="d", token_id=4, logprob=-1.0, bytes=[100])]),
        TokenLogprob(token="b\ufffd", token_id=2, logprob=-0.5, bytes=[98, 0], top_logprobs=[
            TopLogprob(token="b\ufffd", token_id=2, logprob=-0.5, bytes=[98, 0]),
            TopLogprob(token="d", token_id=4, logprob=-0.75, bytes=[100])])]
    assert isinstance(o.result.logprobs[1].top_logprobs[1].logprob, float)


def test_logprobs_without_top_ones_keep_the_sampled_token_only() -> None:
    o = _outcome(_out(CompletionOutput(0, [1], "a", FinishReason.STOP,
                                       logprobs=[{1: -0.5, 4: -0.1}])),
                 _spec(sampling=SamplingParams(logprobs=0)), token_bytes=BYTES)
    assert o.result is not None and o.result.logprobs is not None
    (step,) = o.result.logprobs
    assert (step.token, step.token_id, step.logprob, step.top_logprobs) == ("a", 1, -0.5, [])


def _embed_out(*vectors: list[float], error: str | None = None) -> RequestOutput:
    return _out(*[CompletionOutput(i, [], "", FinishReason.STOP, embedding=v)
                  for i, v in enumerate(vectors)],
                CompletionOutput(9, [], "", FinishReason.STOP), error=error)


def test_embeddings_as_floats_or_base64_float32() -> None:
    vectors = ([0.5, -1.0], [0.25, 2.0])
    floats = _outcome(_embed_out(*vectors), _spec(prompt=None, embed=EmbeddingInput(
        input=["a", "b"])))
    assert floats.status is JobStatus.SUCCEEDED and floats.result is not None
    assert floats.result.embeddings == [[0.5, -1.0], [0.25, 2.0]]
    assert floats.result.finish_reason is FinishReason.STOP
    assert floats.result.usage.prompt_tokens == 7
    b64 = _outcome(_embed_out(*vectors), _spec(prompt=None, embed=EmbeddingInput(
        input=["a", "b"], encoding_format="base64")))
    assert b64.result is not None and b64.result.embeddings == [
        base64.b64encode(struct.pack("<2f", *v)).decode() for v in vectors]
    assert base64.b64decode(b64.result.embeddings[0]) == b"\x00\x00\x00?\x00\x00\x80\xbf"


def test_a_failed_embedding_has_no_vectors() -> None:
    o = _outcome(_embed_out([0.5], error="dimensions not supported"),
                 _spec(prompt=None, embed=EmbeddingInput(input=["a"])))
    assert (o.status, o.error) == (JobStatus.FAILED, "dimensions not supported")
    assert o.result is not None and o.result.embeddings is None
    assert o.result.finish_reason is FinishReason.STOP


def _size(o) -> int:  # type: ignore[no-untyped-def]
    return len(o.result.model_dump_json().encode())


def test_a_result_over_the_limit_is_not_stored_and_fails() -> None:
    out = _out(CompletionOutput(0, [5, 6], "hello", FinishReason.STOP))
    size = _size(_outcome(out))
    at = _outcome(out, max_result_bytes=size)  # at the limit: stored
    assert at.status is JobStatus.SUCCEEDED and at.result is not None and at.error is None
    over = _outcome(out, max_result_bytes=size - 1)
    assert (over.status, over.result) == (JobStatus.FAILED, None)
    assert over.error == (f"result is {size} bytes, over the limit of {size - 1} "
                          "(KVBATCH_MAX_RESULT_BYTES): lower n, max_tokens or logprobs")
    assert over.stats is not None and over.stats.generated_tokens == 5
    assert over.job_id == "j" and abs(over.finished_at - time.time()) < 60


def test_a_cancelled_job_over_the_limit_stays_cancelled() -> None:
    out = _out(CompletionOutput(0, [5, 6], "hello", FinishReason.ABORT))
    o = _outcome(out, abort_as=JobStatus.EXPIRED, max_result_bytes=1)
    assert (o.status, o.error, o.result) == (JobStatus.EXPIRED, "deadline passed", None)
    assert o.stats is not None and o.stats.preemptions == 1
