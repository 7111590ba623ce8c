"""Per-job limits (``jobs.limits.JobLimits``) value by value, on specs built by hand: each limit
allows a job exactly at it and refuses one a unit over it, prompts are measured in UTF-8 bytes
whichever field holds them, the result estimate's formula, and the documented defaults."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from jobs.limits import LOGPROB_ENTRY_BYTES, JobLimits
from jobs.schemas import ChatMessage, EmbeddingInput, JobSpec


def _spec(**sampling: object) -> JobSpec:
    return JobSpec(model="tiny", prompt="hi", sampling=SamplingParams(**sampling))  # type: ignore[arg-type]


def _refusal(limits: JobLimits, spec: JobSpec) -> str | None:
    try:
        limits.check(spec)
    except ValueError as exc:
        return str(exc)
    return None


def test_the_documented_defaults() -> None:
    limits = JobLimits()
    assert (limits.max_prompt_bytes, limits.max_job_tokens, limits.max_stop_strings,
            limits.max_stop_string_chars, limits.max_result_bytes) == (
        512 * 1024, 65536, 16, 256, 8 * 1024 * 1024)
    assert LOGPROB_ENTRY_BYTES == 112


@pytest.mark.parametrize("field", ["prompt", "raw_prompt", "messages", "embed"])
def test_prompt_bytes_are_utf8_bytes_of_whichever_field_holds_the_prompt(field: str) -> None:
    text = "é" * 50  # 50 characters, 100 bytes
    value: object = {"messages": [ChatMessage(role="system", content=text[:20]),
                                  ChatMessage(role="user", content=text[20:])],
                     "embed": EmbeddingInput(input=[text[:10], text[10:]])}.get(field, text)
    spec = JobSpec(model="tiny", **{field: value})  # type: ignore[arg-type]
    assert _refusal(JobLimits(max_prompt_bytes=100), spec) is None
    assert _refusal(JobLimits(max_prompt_bytes=99), spec) == (
        "prompt is 100 bytes, over the limit of 99 (KVBATCH_MAX_PROMPT_BYTES)")


def test_job_tokens_are_n_times_max_tokens() -> None:
    limits = JobLimits(max_job_tokens=100)
    assert _refusal(limits, _spec(n=4, max_tokens=25, temperature=1.0)) is None
    assert _refusal(limits, _spec(n=1, max_tokens=100)) is None
    assert _refusal(limits, _spec(n=4, max_tokens=26, temperature=1.0)) == (
        "n x max_tokens is 104, over the limit of 100 (KVBATCH_MAX_JOB_TOKENS)")
    assert _refusal(limits, _spec(n=1, max_tokens=101)) == (
        "n x max_tokens is 101, over the limit of 100 (KVBATCH_MAX_JOB_TOKENS)")


def test_stop_strings_count_and_length() -> None:
    limits = JobLimits(max_stop_strings=3, max_stop_string_chars=5)
    assert _refusal(limits, _spec(stop=["a", "b", "12345"])) is None
    assert _refusal(limits, _spec(stop=["a", "b", "c", "d"])) == (
        "stop has 4 strings, over the limit of 3 (KVBATCH_MAX_STOP_STRINGS)")
    assert _refusal(limits, _spec(stop=["a", "123456", "b"])) == (
        "a stop string has 6 characters, over the limit of 5 (KVBATCH_MAX_STOP_STRING_CHARS)")
    assert _refusal(JobLimits(max_stop_strings=0), _spec()) is None  # no stop strings at all
    assert _refusal(JobLimits(max_stop_strings=0), _spec(stop=["x"])) is not None


def test_result_estimate_is_n_max_tokens_logprobs_plus_one_entries() -> None:
    # 2 x 10 x (3 + 1) entries of 112 bytes: 8960
    spec = _spec(n=2, max_tokens=10, logprobs=3, temperature=1.0)
    assert _refusal(JobLimits(max_result_bytes=8960), spec) is None
    assert _refusal(JobLimits(max_result_bytes=8959), spec) == (
        "n x max_tokens x (logprobs + 1) could store about 8960 bytes, over the result limit "
        "of 8959 (KVBATCH_MAX_RESULT_BYTES): lower n, max_tokens or logprobs")
    # logprobs=0 still stores the sampled token's entry: 1 x 10 x 1 x 112
    assert _refusal(JobLimits(max_result_bytes=1119), _spec(max_tokens=10, logprobs=0)) \
        is not None
    assert _refusal(JobLimits(max_result_bytes=1120), _spec(max_tokens=10, logprobs=0)) is None
    # without logprobs nothing is estimated: the worker enforces the stored size
    assert _refusal(JobLimits(max_result_bytes=1024), _spec(n=4, max_tokens=1000,
                                                            temperature=1.0)) is None
