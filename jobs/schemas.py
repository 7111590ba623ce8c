"""The job contract shared by producers (SDK, CLI) and workers: pydantic v2 models, JSON only.

A job travels as the JSON of :class:`JobSpec` in a Redis stream entry and is stored in SQL;
results and statistics come back as :class:`JobResult` and :class:`JobStats`, and a worker
reports a job's end as an :class:`Outcome`. Each contract is declared here once: the sampling
fields are the engine's own ``SamplingParams`` and an embedding job's pooling fields its
``PoolingParams`` (both torch-free), the SQL tables derive their status
checks and the per-job stats columns from :class:`JobStatus` and :class:`JobStats`, and the
CLI's job table its columns.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal, Self
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticSerializationError

from engine.outputs import FinishReason
from engine.pooling_params import PoolingParams
from engine.prompts import TextOrChat
from engine.sampling_params import SamplingParams
from jobs.constants import MAX_PAYLOAD_BYTES

JOB_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,64}$"
# Served model names: printable, no spaces or control characters (they reach terminals, logs
# and Redis key names), no leading dash; a Hugging Face directory path fits.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9/._][A-Za-z0-9._:/@+-]{0,254}$"
# A job naming ``base:ADAPTER`` runs with that LoRA adapter on the workers of ``base``.
ADAPTER_SEPARATOR = ":"
WEBHOOK_URL_MAX_CHARS = 2048


def queue_model(model: str) -> str:
    """The served model whose queue (streams, SQL backlog, workers) a job naming ``model``
    waits in: ``base:ADAPTER`` waits in ``base``'s, whose workers serve the LoRA adapter
    (``kvbatch worker --lora ADAPTER=DIR``); any other name in its own."""
    return model.partition(ADAPTER_SEPARATOR)[0]


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset(
    {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED}
)
ACTIVE_STATUSES = frozenset({JobStatus.QUEUED, JobStatus.RUNNING})


class BatchStatus(StrEnum):
    """A batch's one lifecycle, whichever door it came in by (SDK, ``kvbatch submit``, HTTP)::

        validating ──▶ in_progress ──▶ completed | expired | cancelled
             └──▶ failed

    ``validating``: an input file is being read (HTTP batches only; the others start
    ``in_progress``); ``failed``: it held invalid lines, nothing runs. ``in_progress`` ends when
    every job is terminal (``completed``, or ``cancelled`` when a cancel was asked for) or when
    its deadline passes (``expired``); set once, by ``jobs.store.BatchStore``. Finalization
    (exports, the completion event, the webhook) follows the end and is bookkeeping of its own,
    not a status; OpenAI's states are a view of this (``jobs.api.objects.openai_status``)."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        """Whether the batch has ended: it is finalized next (``failed`` has nothing to
        finalize but its event)."""
        return self not in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)


ENDED_BATCH = [s.value for s in BatchStatus if s.ended]


class _Strict(BaseModel):
    # No inf/NaN: they are not JSON, and PostgreSQL's json type refuses them.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


EncodingFormat = Literal["float", "base64"]


class EmbeddingInput(_Strict):
    """What an embedding job embeds (OpenAI's ``/v1/embeddings`` request, less its model).

    Args:
        input: the texts, each embedded as it is (never templated), in this order.
        pooling: the engine's ``PoolingParams`` (``dimensions``), validated here with its own
            rules; whether the model allows them is the worker's to say (the job fails,
            naming why).
        encoding_format: how the result holds each vector: a list of floats, or ``base64``
            of its little-endian float32 bytes (as OpenAI sends them).
    """

    input: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)
    pooling: PoolingParams = PoolingParams()
    encoding_format: EncodingFormat = "float"


_id_lock = threading.Lock()
_id_last = [0, 0]  # (milliseconds, random part) of this process's last id


def new_job_id() -> str:
    """32 hex digits laid out as a UUIDv7: milliseconds since the epoch, then 74 bits that are
    random at each new millisecond and counted up within one (RFC 9562's monotonic random),
    so a process's ids increase in the order it made them: the feeder serves a batch oldest
    first by id. Ids of jobs submitted together are near each other, so inserting a million of
    them appends to the primary-key index instead of touching pages all over it (a random id
    made a 1M-row submission slow down as the index outgrew PostgreSQL's buffers)."""
    with _id_lock:
        ms = max(time.time_ns() // 1_000_000, _id_last[0])  # never back with the clock
        if ms > _id_last[0]:
            rand = int.from_bytes(os.urandom(10)) & ((1 << 73) - 1)  # room to count up
        else:
            rand = _id_last[1] + 1
        _id_last[:] = [ms, rand]
    value = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | (rand >> 62) << 64 | 0b10 << 62 | (
        rand & ((1 << 62) - 1))
    return f"{value:032x}"


class JobSpec(_Strict):
    """One job as submitted: a generation, or with ``embed`` an embedding of its texts.

    Args:
        id: unique job id (generated when omitted).
        batch_id: the batch this job belongs to, if any.
        custom_id: the caller's own id (unique within a batch), e.g. a JSONL row key.
        model: the served model name; workers only run jobs of their own model, or of one
            of its LoRA adapters as ``<model>:<adapter>`` (see :func:`queue_model`).
        prompt: the user's request as text: on a model with a chat template it becomes one
            user message (as ``messages=[{"role": "user", "content": prompt}]``), else it is
            the raw text.
        raw_prompt: text given to the model as it is, never templated (completions).
        messages: chat messages (one at least), rendered with the model's chat template.
        embed: texts to embed instead of a prompt to continue (an embedding job, which takes
            no ``sampling``).
            A job has exactly one of ``prompt``, ``raw_prompt``, ``messages`` and ``embed``.
        sampling: the engine's ``SamplingParams``, validated here with its own rules.
        priority: lower values are scheduled first (the engine's convention).
        metadata: free-form JSON kept with the job.
        deadline: the job expires, unrun, if not finished by then (a timezone-aware time).
        submitted_at: wall-clock submission time (``time.time()``), set on submission.
    """

    id: str = Field(default_factory=new_job_id, pattern=JOB_ID_PATTERN)
    batch_id: str | None = Field(default=None, pattern=JOB_ID_PATTERN)
    custom_id: str | None = Field(default=None, max_length=255)
    model: str = Field(pattern=MODEL_NAME_PATTERN)
    prompt: str | None = None
    raw_prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    embed: EmbeddingInput | None = None
    sampling: SamplingParams = SamplingParams()
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)  # the SQL column is a 32-bit integer
    metadata: dict[str, Any] = Field(default_factory=dict)
    deadline: datetime | None = None
    submitted_at: float = Field(default_factory=time.time)

    @field_validator("deadline")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value

    @field_validator("metadata")
    @classmethod
    def _strict_json(cls, value: dict[str, Any]) -> dict[str, Any]:
        if not value:  # most jobs carry none
            return value
        try:  # NaN and infinities are not JSON: SQL JSON columns refuse them
            json.dumps(value, allow_nan=False)
        except ValueError as exc:
            raise ValueError(f"metadata must be strict JSON: {exc}") from exc
        return value

    @model_validator(mode="after")
    def _one_prompt(self) -> JobSpec:
        given = [self.prompt, self.raw_prompt, self.messages, self.embed]
        if sum(p is not None for p in given) != 1:
            raise ValueError("a job needs exactly one of 'prompt', 'raw_prompt', 'messages' "
                             "and 'embed'")
        if self.embed is not None and self.sampling != SamplingParams():
            raise ValueError("an embedding job takes no sampling parameters")
        return self

    @model_validator(mode="after")
    def _storable_text(self) -> JobSpec:
        # The JSON form is quick to make, fails on a lone surrogate and spells NUL "\u0000";
        # only then (or for a literal backslash-u0000) is every string looked at.
        try:
            suspect = "\\u0000" in self.wire_json
        except PydanticSerializationError:
            suspect = True
        bad = _unstorable_text(self.model_dump(mode="json")) if suspect else None
        if bad:
            raise ValueError(f"the job contains {bad}, which the database cannot store")
        return self

    @functools.cached_property
    def wire_json(self) -> str:
        """The job's JSON (``model_dump_json()``), made once: the check that it is storable,
        its stream entry and its SQL row all take it (made three times a row, once as a dict
        then ``json.dumps``, it was a third of the cost of submitting a plain row). Pydantic
        leaves it out of comparisons and dumps."""
        return self.model_dump_json()

    def model_copy(self, *, update: Mapping[str, Any] | None = None,
                   deep: bool = False) -> Self:
        copy = super().model_copy(update=update, deep=deep)
        if update:  # the JSON of the fields before the update
            copy.__dict__.pop("wire_json", None)
        return copy

    def engine_prompt(self, chat: bool) -> TextOrChat:
        """What the engine takes: chat messages or raw text (a generation job's).

        Args:
            chat: the model has a chat template (a plain ``prompt`` becomes a user message).
        """
        if self.messages is not None:
            return [m.model_dump() for m in self.messages]
        if self.prompt is not None:
            return [{"role": "user", "content": self.prompt}] if chat else self.prompt
        assert self.raw_prompt is not None, "an embedding job has texts, not a prompt"
        return self.raw_prompt

    def expired(self, now_s: float | None = None) -> bool:
        now_s = time.time() if now_s is None else now_s
        return self.deadline is not None and self.deadline.timestamp() <= now_s


def check_webhook_url(url: str) -> str:
    """``url`` if it is an absolute ``http(s)`` URL with a host and no credentials, spaces or
    control characters; else ``ValueError`` saying why. (Where it may point is checked when
    the event is sent, against the addresses its host resolves to then.)"""
    if len(url) > WEBHOOK_URL_MAX_CHARS:
        raise ValueError(f"webhook URL is over {WEBHOOK_URL_MAX_CHARS} characters")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise ValueError("webhook URL contains spaces or control characters")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"webhook URL must be http(s), got {parts.scheme or 'no'} scheme")
    if not parts.hostname:
        raise ValueError("webhook URL has no host")
    if parts.username is not None or parts.password is not None:
        raise ValueError("webhook URL must not carry credentials (sign events with "
                         "KVBATCH_WEBHOOK_SECRET instead)")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError as exc:
        raise ValueError(f"webhook URL: {exc}") from None
    return url


def _unstorable_text(value: Any) -> str | None:
    """Name the first character SQL text/JSON cannot hold (NUL, a lone surrogate), if any."""
    if isinstance(value, str):
        if "\x00" in value:
            return "a NUL character (U+0000)"
        if any("\ud800" <= c <= "\udfff" for c in value):
            return "an unpaired UTF-16 surrogate"
        return None
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, list):
        for item in value:
            bad = _unstorable_text(item)
            if bad:
                return bad
    return None


def encode_job(spec: JobSpec) -> str:
    """The job's wire form; raises ``ValueError`` when it exceeds :data:`MAX_PAYLOAD_BYTES`."""
    payload = spec.wire_json
    if len(payload.encode()) > MAX_PAYLOAD_BYTES:
        raise ValueError(
            f"job {spec.id}: payload is {len(payload.encode())} bytes, "
            f"over the {MAX_PAYLOAD_BYTES}-byte limit"
        )
    return payload


def decode_job(payload: str | bytes) -> JobSpec:
    """Parse a job from the wire; raises ``ValueError`` (pydantic's included) on bad input.
    The size limit counts UTF-8 bytes, as :func:`encode_job` does, not characters."""
    size = len(payload.encode("utf-8", "surrogatepass") if isinstance(payload, str) else payload)
    if size > MAX_PAYLOAD_BYTES:
        raise ValueError(f"payload is {size} bytes, over the {MAX_PAYLOAD_BYTES}-byte limit")
    return JobSpec.model_validate_json(payload)


class Usage(BaseModel):
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0


class TopLogprob(BaseModel):
    """A candidate token at one step: its text, id, log-probability and UTF-8 bytes (a token
    may hold part of a character; its ``token`` text then shows U+FFFD)."""

    token: str
    token_id: int
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    """The sampled token at one step, and the most likely tokens there (``logprobs`` of
    them, the sampled one included when it is among them). OpenAI's chat shape, plus ids."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


def _legacy_logprobs(value: Any) -> Any:
    """Logprobs stored before tokens had texts (``[{"<token id>": logprob, …}]`` per step,
    the sampled token first) as :class:`TokenLogprob`s without texts or bytes."""
    if not isinstance(value, list) or not value or not isinstance(value[0], dict) \
            or "token_id" in value[0]:
        return value
    steps = []
    for step in value:
        entries = [{"token": "", "token_id": int(k), "logprob": v, "bytes": []}
                   for k, v in step.items()]
        steps.append({**entries[0], "top_logprobs": sorted(entries, key=lambda e: -e["logprob"])})
    return steps


Logprobs = Annotated[list[TokenLogprob] | None, BeforeValidator(_legacy_logprobs)]


class Choice(BaseModel):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: Logprobs = None


class JobResult(BaseModel):
    """What a job produced; the top-level fields are those of the first (or only) sample."""

    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: Logprobs = None
    usage: Usage = Usage()
    # Every sample when n > 1 (the first repeats the top-level fields); empty when n == 1.
    choices: list[Choice] = Field(default_factory=list)
    # An embedding job's vectors, one per input in order: lists of floats, or base64 strings
    # (``EmbeddingInput.encoding_format``).
    embeddings: list[list[float]] | list[str] | None = None


class Bytes:
    """Marks a :class:`JobStats` field that counts bytes: a 64-bit SQL column, shown in binary
    units by the command line."""


class JobStats(BaseModel):
    """Latency and memory of one job: the one declaration of the per-job stats row.

    The ``job_metrics`` table (``jobs.models``), the stats query behind ``Client.stats`` and the
    CLI's job table derive their columns from these fields (a field's ``title`` is its CLI
    column heading); a parity test holds the migrations and the ``job_stats`` view to them.
    Times are seconds measured from submission (vLLM's "arrival"): queue_wait until first
    scheduled, ttft until the first token, e2e until done; tpot is the mean time between output
    tokens; gpu_s is its cost in GPU-seconds (its share of the engine steps it ran in).
    """

    queue_wait_s: float | None = Field(None, title="wait s")
    ttft_s: float | None = Field(None, title="ttft s")
    tpot_s: float | None = Field(None, title="tpot s")
    e2e_s: float | None = Field(None, title="e2e s")
    prompt_tokens: int = Field(0, title="prompt")
    cached_prompt_tokens: int = Field(0, title="cached")
    generated_tokens: int = Field(0, title="generated")
    peak_kv_blocks: int = Field(0, title="KV blocks")
    peak_kv_bytes: Annotated[int, Bytes] = Field(0, title="peak KV")
    preemptions: int = Field(0, title="preempted")
    # The job's share of the engine steps it ran in: each step's time (forward and sampling)
    # split equally among the jobs in it, summed over its steps (``RequestMetrics.gpu_s``).
    gpu_s: float | None = Field(None, title="GPU s")


def is_bytes(name: str) -> bool:
    """Whether the :class:`JobStats` field ``name`` counts bytes."""
    return Bytes in JobStats.model_fields[name].metadata


@dataclass(frozen=True)
class Outcome:
    """A job's terminal state as a worker (or the control plane) reports it to the store."""

    job_id: str
    status: JobStatus
    finished_at: float
    error: str | None = None
    result: JobResult | None = None
    stats: JobStats | None = None


class JobInfo(BaseModel):
    """A job as stored: request summary, status, and result/stats once terminal."""

    id: str
    batch_id: str | None
    custom_id: str | None
    model: str
    status: JobStatus
    priority: int
    metadata: dict[str, Any]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    deadline: datetime | None
    attempts: int
    worker_id: str | None
    error: str | None
    result: JobResult | None = None
    stats: JobStats | None = None
