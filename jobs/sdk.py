"""The Python SDK: submit jobs and batches, follow them, read results and statistics.

```python
from jobs import Client

client = Client()                       # KVBATCH_REDIS_URL / KVBATCH_DATABASE_URL
job = client.submit(prompt="Why is the sky blue?", max_tokens=64)
print(job.result(timeout_s=60).text)

batch = client.submit_batch([{"custom_id": "a", "prompt": "…"}, …], batch_id="my-dataset")
for info in batch.results():            # completion order
    print(info.custom_id, info.status, info.result.text if info.result else info.error)
```

Everything is validated (pydantic) before anything is enqueued. The async twin is
:class:`jobs.aio.AsyncClient`.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from engine.sampling_params import SamplingParams
from jobs.client import JobClient
from jobs.constants import DEFAULT_MODEL, EMBED_TEXTS_PER_JOB
from jobs.echo import quote
from jobs.follow import Follower
from jobs.pipeline_client import JobFeed, Submitted
from jobs.rows import Row, parse_row, rejected_row
from jobs.schemas import (
    BatchStatus,
    JobInfo,
    JobResult,
    JobSpec,
    JobStatus,
    check_webhook_url,
)
from jobs.settings import connection_settings
from jobs.stats import Stats


class JobFailed(Exception):
    """A job ended without a result: failed, cancelled or expired.

    Attributes:
        info: the stored job; ``info.status`` and ``info.error`` (the stored reason).
    """

    def __init__(self, info: JobInfo) -> None:
        super().__init__(f"job {info.id} {info.status.value}: {info.error or 'no reason'}")
        self.info = info

    @property
    def status(self) -> JobStatus:
        return self.info.status

    @property
    def reason(self) -> str | None:
        return self.info.error


@dataclass(frozen=True)
class BatchCounts:
    """How many jobs of a batch are in each status."""

    queued: int = 0
    running: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    expired: int = 0

    @classmethod
    def of(cls, counts: Mapping[JobStatus, int]) -> BatchCounts:
        """From ``JobReader.count_by_status`` (statuses without jobs are absent there)."""
        return cls(**{s.value: n for s, n in counts.items()})

    @property
    def total(self) -> int:
        return self.active + self.done

    @property
    def active(self) -> int:
        return self.queued + self.running

    @property
    def done(self) -> int:
        return self.succeeded + self.failed + self.cancelled + self.expired


def result_of(info: JobInfo) -> JobResult:
    """The result of a terminal job; :class:`JobFailed` unless it succeeded."""
    if info.status is not JobStatus.SUCCEEDED or info.result is None:
        raise JobFailed(info)
    return info.result


class JobHandle:
    """A submitted job. Cheap to create: it holds the id and reads state when asked."""

    def __init__(self, jobs: JobClient, job_id: str) -> None:
        self.jobs = jobs
        self.id = job_id

    def __repr__(self) -> str:
        return f"JobHandle({self.id!r})"

    def info(self) -> JobInfo:
        """The stored job (status, result, statistics)."""
        info = self.jobs.get(self.id)
        if info is None:
            raise KeyError(f"unknown job {self.id!r}")
        return info

    def status(self) -> JobStatus:
        """The job's current status."""
        return self.info().status

    def wait(self, timeout_s: float | None = None) -> JobInfo:
        """Block until the job is terminal (on the completion notice, not by tight polling).

        Args:
            timeout_s: raise ``TimeoutError`` after this long (None: wait forever).
        """
        return next(self.jobs.follow([self.id], timeout_s))

    def result(self, timeout_s: float | None = None) -> JobResult:
        """Wait for the job and return its result.

        Args:
            timeout_s: raise ``TimeoutError`` after this long (None: wait forever).

        Raises:
            JobFailed: the job failed, was cancelled or expired; carries the stored reason.
        """
        return result_of(self.wait(timeout_s))

    def cancel(self) -> JobStatus | None:
        """Cancel the job: a queued one at once, a running one by its worker. Returns the
        status right after the request (None for an unknown job)."""
        return self.jobs.cancel(self.id)


class BatchHandle:
    """A submitted batch: live counts, results in completion order, cancel."""

    def __init__(self, jobs: JobClient, batch_id: str,
                 job_ids: dict[str, str] | None = None,
                 submitted: Mapping[str, str] | None = None) -> None:
        self.jobs = jobs
        self.id = batch_id
        self._job_ids = job_ids  # kept, not copied: a large batch's would weigh as much again
        # custom_id -> job id of the rows the submission that made this handle named
        self.submitted: Mapping[str, str] = submitted if submitted is not None else {}

    def __repr__(self) -> str:
        return f"BatchHandle({self.id!r})"

    @property
    def job_ids(self) -> dict[str, str]:
        """``custom_id`` -> job id of every row."""
        if self._job_ids is None:
            self._job_ids = {cid or job_id: job_id for job_id, cid, _
                             in self.jobs.batch_jobs(self.id)}
        return self._job_ids

    def status(self) -> BatchStatus | None:
        """Where the batch is in its lifecycle, now (None: no job of it stored yet)."""
        return self.jobs.batch_status(self.id)

    def counts(self) -> BatchCounts:
        """How many of the batch's jobs are in each status, now."""
        return BatchCounts.of(self.jobs.count_by_status(batch_id=self.id))

    def results(self, timeout_s: float | None = None,
                poll_interval_s: float = 1.0) -> Iterator[JobInfo]:
        """Yield every job of the batch once it is terminal, in completion order (jobs
        finished before the call first). Failed jobs are yielded too: check ``status``.

        Args:
            timeout_s: raise ``TimeoutError`` if the batch is not done by then.
            poll_interval_s: how often SQL is read when no completion notice arrives.
        """
        return self.jobs.follow(list(self.job_ids.values()), timeout_s, poll_interval_s,
                                batch_id=self.id)

    def wait(self, timeout_s: float | None = None) -> BatchCounts:
        """Block until every job of the batch is terminal; return the final counts.

        Args:
            timeout_s: raise ``TimeoutError`` after this long.
        """
        self.jobs.wait_terminal(list(self.job_ids.values()), timeout_s, batch_id=self.id)
        return self.counts()

    def cancel(self) -> int:
        """Cancel every unfinished job of the batch; return how many were asked to stop."""
        return self.jobs.cancel_batch(self.id)

    def stats(self) -> Stats:
        """Aggregate statistics of the batch's finished jobs (from SQL)."""
        return self.jobs.stats(batch_id=self.id)


class Client:
    """Submit generation and embedding jobs to kvbatch workers and read their results.

    Args:
        redis_url: the queue (default ``$KVBATCH_REDIS_URL``, else local Redis).
        database_url: the SQL database (default ``$KVBATCH_DATABASE_URL``, else
            ``sqlite:///kvbatch.db``).
        key_prefix: Redis key prefix shared with the workers (default
            ``$KVBATCH_KEY_PREFIX``, else ``kvbatch``).
        model: served model name used when a call names none.

    Raises:
        jobs.db.SchemaNotReady: the database is a SQLite file that does not exist (it is not
            created: ``kvbatch db upgrade`` makes it).
    """

    def __init__(self, redis_url: str | None = None, database_url: str | None = None, *,
                 key_prefix: str | None = None, model: str = DEFAULT_MODEL) -> None:
        conn = connection_settings(redis_url, database_url, key_prefix)
        self.jobs = JobClient(database=conn.database_url, redis_url=conn.redis_url,
                              key_prefix=conn.key_prefix)
        self.model = model

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the Redis and database connections."""
        self.jobs.close()

    def submit(self, prompt: str | None = None, *, raw_prompt: str | None = None,
               messages: list[dict[str, Any]] | None = None, model: str | None = None,
               max_tokens: int | None = None, temperature: float | None = None,
               priority: int = 0, metadata: dict[str, Any] | None = None,
               deadline: datetime | None = None, **sampling: Any) -> JobHandle:
        """Submit one job.

        Args:
            prompt: the request as text; on a chat model, one user message.
            raw_prompt: text given to the model as it is (no chat template).
            messages: chat messages (``{"role", "content"}``), rendered with the chat template.
                Exactly one of ``prompt``, ``raw_prompt`` and ``messages``.
            model: served model name (default: the client's).
            max_tokens: most tokens to generate (default 16).
            temperature: sampling temperature; 0 is greedy (default 1.0).
            priority: lower runs first.
            metadata: JSON kept with the job.
            deadline: the job expires, unrun or aborted, if not finished by then.
            **sampling: any other ``SamplingParams`` field (``top_p``, ``stop``, ``seed``,
                ``logprobs``, ``logit_bias``, ``response_format``, …).

        Raises:
            pydantic.ValidationError: invalid arguments (a sampling value out of range
                included: the message names the field); nothing was stored or enqueued.
            ValueError: the job is over a limit (``jobs.limits.JobLimits``: prompt bytes,
                n x max_tokens, stop strings, estimated result size); nothing was stored.
        """
        sampling = _given(sampling, max_tokens=max_tokens, temperature=temperature)
        spec = JobSpec.model_validate({
            "model": model or self.model, "prompt": prompt, "raw_prompt": raw_prompt,
            "messages": messages,
            "sampling": sampling, "priority": priority, "metadata": metadata or {},
            "deadline": deadline})
        self.jobs.submit([spec])
        return JobHandle(self.jobs, spec.id)

    def embed(self, texts: Sequence[str], *, model: str | None = None,
              dimensions: int | None = None, priority: int = 0,
              texts_per_job: int = EMBED_TEXTS_PER_JOB,
              timeout_s: float | None = None) -> list[list[float]]:
        """Embed ``texts`` and return their vectors, in order (each L2-normalized, pooled as
        the model's configuration says).

        The texts go as embedding jobs of up to ``texts_per_job`` each, which workers run in
        the same steps as generations (prefill only).

        Args:
            texts: the texts, each embedded as it is (no chat template).
            model: served model name (default: the client's).
            dimensions: keep this many dimensions (Matryoshka truncation); only on a model
                trained for it, else the jobs fail saying so.
            priority: lower runs first.
            texts_per_job: texts in one job.
            timeout_s: raise ``TimeoutError`` after this long (None: wait forever).

        Raises:
            pydantic.ValidationError: an empty text or a bad ``dimensions``; nothing was
                stored.
            JobFailed: a job failed (a text the model cannot take, ``dimensions`` it does
                not allow), was cancelled or expired.
        """
        specs = embedding_specs(texts, model=model or self.model, dimensions=dimensions,
                                priority=priority, texts_per_job=texts_per_job)
        self.jobs.submit(specs)
        ids = [spec.id for spec in specs]
        return embedding_vectors(ids, {info.id: info for info in self.jobs.follow(ids, timeout_s)})

    def submit_batch(self, rows: Iterable[Mapping[str, Any] | Row], *,
                     batch_id: str | None = None, model: str | None = None,
                     system_prompt: str | None = None, priority: int = 0,
                     deadline: datetime | None = None, webhook_url: str | None = None,
                     chunk_size: int = 1000, rejected: dict[str, Row] | None = None,
                     new_rows: bool = False, **defaults: Any) -> BatchHandle:
        """Submit many rows as one batch, streamed: ``rows`` (any iterable, a generator
        included) is read, checked and stored ``chunk_size`` rows at a time (one transaction
        and one Redis pipeline each, the next chunk checked while one is stored), so memory
        holds a chunk and the rows' ids, whatever the batch's length. ``custom_id`` is the
        idempotency key: rows the batch already holds are not submitted again, so
        resubmitting a batch never runs a row twice.

        Args:
            rows: plain rows (``{"custom_id", "prompt" | "messages", <sampling fields>,
                "priority", "metadata"}``) or OpenAI Batch API rows (``{"custom_id",
                "method", "url", "body"}``); a plain row without ``custom_id`` gets its index.
            batch_id: the batch (default: a new one); reuse it to resume.
            model: served model name for every row (default: the client's).
            system_prompt: prepended as a system message to rows without one (a plain
                ``prompt`` row becomes a chat; OpenAI ``/v1/completions`` rows stay raw text).
            priority: default priority of the rows.
            deadline: every row expires if not finished by then; the batch is marked expired
                then too (by the control plane).
            webhook_url: POSTed the batch's completion event by the control plane
                (``kvbatch control``), with retries; an ``http(s)`` URL, checked here. The
                webhook and the deadline belong to the batch's first submission: a later one
                naming other values is refused.
            chunk_size: rows per SQL transaction and Redis pipeline.
            rejected: when given, a row that cannot run (malformed, invalid, over a limit, or
                carrying an ``error``) is put there by ``custom_id``, with its ``error``, and
                the others are submitted; when None, such a row refuses its chunk and the
                rest (the chunks before it are stored: fix the row and submit again with the
                same ``batch_id`` to resume).
            new_rows: none of the rows can be in the batch already (the caller made the batch
                and submits distinct rows to it in parts): they are not looked up in SQL.
            **defaults: sampling fields for rows that do not set them (``max_tokens=…``).

        Raises:
            ValueError: a malformed row (its index is named) or one over a limit (its
                ``custom_id`` is named), or a ``custom_id`` given twice, unless ``rejected``
                is given; nothing of that row's chunk or after was enqueued.
            pydantic.ValidationError: as ``ValueError``, from the job schema.
        """
        batch_id = batch_id or f"batch-{uuid.uuid4().hex}"
        if webhook_url is not None:
            check_webhook_url(webhook_url)
        if deadline is not None and deadline.tzinfo is None:
            deadline = deadline.replace(tzinfo=UTC)
        current = self.jobs.batch_settings(batch_id)
        if current is not None and (
                (webhook_url is not None and webhook_url != current[0])
                or (deadline is not None and deadline != current[1])):
            raise ValueError(f"batch {batch_id!r} exists: its webhook and deadline were set by "
                             "its first submission and cannot be changed by another")
        # The custom_ids of the chunks before, each once in the batch: in job_ids if stored
        # (or already held), else in refused_ids (few). No third copy: a million rows' ids
        # take ~100 MB a mapping.
        job_ids: dict[str, str] = {}
        refused_ids: set[str] = set()
        it, read = iter(rows), 0
        with self.jobs.store_behind():  # a chunk is checked while the one before is stored
            while chunk := list(itertools.islice(it, chunk_size)):
                specs, valid, refused = self._specs(
                    chunk, start=read, batch_id=batch_id, model=model,
                    system_prompt=system_prompt, priority=priority, deadline=deadline,
                    rejected=rejected, defaults=defaults)
                dup = next((c for c in itertools.chain(valid, refused)
                            if c in job_ids or c in refused_ids), None)
                if dup is not None:
                    raise ValueError(f"custom_id {quote(dup)} appears more than once in batch "
                                     f"{batch_id!r}")
                read += len(chunk)
                over_limit: dict[str, str] | None = None if rejected is None else {}
                job_ids |= self.jobs.submit_batch(batch_id, specs, chunk_size,
                                                  webhook_url=webhook_url, deadline=deadline,
                                                  over_limit=over_limit,
                                                  new_rows=new_rows or current is None)
                refused_ids.update(refused, over_limit or ())
                if rejected is not None:
                    rejected |= refused
                    rejected |= {c: replace(valid[c], error=e)
                                 for c, e in (over_limit or {}).items()}
        # A batch that existed holds rows these did not name: its handle reads them all.
        return BatchHandle(self.jobs, batch_id, job_ids if current is None else None, job_ids)

    def submit_rows(self, batch_id: str, rows: Sequence[Mapping[str, Any]], *,
                    model: str | None = None, priority: int = 0,
                    sampling: Mapping[str, Any] | None = None) -> Submitted:
        """Submit ``rows`` to batch ``batch_id`` as :meth:`submit_batch` does (``custom_id``
        the key), each row that cannot run rejected alone: the pipeline run's transport
        (:class:`jobs.pipeline_client.PipelineClient`).

        Args:
            batch_id: the batch (made by the first submission).
            rows: plain rows, each with a ``custom_id``.
            model: served model name (default: the client's).
            priority: the rows' priority (lower runs first).
            sampling: sampling fields of every row.
        """
        rejected: dict[str, Row] = {}
        handle = self.submit_batch(rows, batch_id=batch_id, model=model, priority=priority,
                                   rejected=rejected, **(sampling or {}))
        return Submitted(dict(handle.submitted),
                         {c: row.error or "rejected" for c, row in rejected.items()})

    def follow_jobs(self, job_ids: Collection[str], timeout_s: float | None = None) -> JobFeed:
        """Follow ``job_ids`` to their ends, more added as it goes (a
        :class:`jobs.pipeline_client.JobFeed`: one done-channel subscription and SQL poll).

        Args:
            job_ids: the jobs to follow first.
            timeout_s: iterating raises ``TimeoutError`` if they are not all done by then.
        """
        return _FollowedJobs(self.jobs, self.jobs.follower(job_ids, timeout_s))

    def check_batch(self, rows: Iterable[Mapping[str, Any] | Row], *, batch_id: str,
                    model: str | None = None, system_prompt: str | None = None,
                    priority: int = 0, deadline: datetime | None = None,
                    **defaults: Any) -> None:
        """Check rows as :meth:`submit_batch` does, storing nothing: ``ValueError`` (or
        pydantic's) names the first that cannot run."""
        specs, _, _ = self._specs(rows, batch_id=batch_id, model=model,
                                  system_prompt=system_prompt, priority=priority,
                                  deadline=deadline, rejected=None, defaults=defaults)
        for spec in specs:
            try:
                self.jobs.check(spec)
            except ValueError as exc:
                raise ValueError(f"row {quote(spec.custom_id)}: {exc}") from exc

    def _specs(self, rows: Iterable[Mapping[str, Any] | Row], *, start: int = 0, batch_id: str,
               model: str | None, system_prompt: str | None, priority: int,
               deadline: datetime | None, rejected: dict[str, Row] | None,
               defaults: Mapping[str, Any]) -> tuple[list[JobSpec], dict[str, Row],
                                                      dict[str, Row]]:
        """(jobs of the rows that can run, those rows by custom_id, the refused rows by
        custom_id with their errors; with ``rejected`` None a refused row raises)."""
        specs, valid = [], {}
        refused: dict[str, Row] = {}
        sampling: dict[Hashable, SamplingParams] = {}
        for index, raw in enumerate(rows, start):
            row = None
            try:
                row = raw if isinstance(raw, Row) else parse_row(raw, index)
                if row.error is not None:
                    raise ValueError(row.error)
                specs.append(row_spec(row, model=model or self.model, batch_id=batch_id,
                                      system_prompt=system_prompt, defaults=defaults,
                                      priority=priority, deadline=deadline,
                                      sampling=sampling))
                valid[row.custom_id] = row
            except (ValidationError, ValueError) as exc:
                error = (validation_message(exc.errors(), "row")
                         if isinstance(exc, ValidationError)
                         else str(exc))
                try:  # a row without a custom_id to report it by refuses the batch
                    if rejected is None:
                        raise ValueError(error) from exc
                    bad = row or rejected_row(raw, index, error)
                except ValueError:
                    raise ValueError(f"row {index}: {error}") from exc
                if bad.custom_id in refused or bad.custom_id in valid:
                    raise ValueError(f"custom_id {quote(bad.custom_id)} appears more than once in "
                                     f"batch {batch_id!r}") from None
                refused[bad.custom_id] = replace(bad, error=error)
        dup = next((c for c in refused if c in valid), None)
        if dup is not None:
            raise ValueError(f"custom_id {quote(dup)} appears more than once in batch "
                             f"{batch_id!r}")
        return specs, valid, refused

    def job(self, job_id: str) -> JobHandle:
        """A handle on an existing job (``KeyError`` if unknown).

        Args:
            job_id: the job's id.
        """
        handle = JobHandle(self.jobs, job_id)
        handle.info()
        return handle

    def batch(self, batch_id: str) -> BatchHandle:
        """A handle on an existing batch (``KeyError`` if it has no jobs).

        Args:
            batch_id: the batch's id.
        """
        handle = BatchHandle(self.jobs, batch_id)
        if not handle.job_ids:
            raise KeyError(f"unknown batch {batch_id!r}")
        return handle

    def stats(self, batch_id: str | None = None,
              since: datetime | timedelta | None = None) -> Stats:
        """Aggregate tokens, throughput, latency percentiles, prefix-cache hit rate and peak
        KV memory of finished jobs, read from the ``job_stats`` view.

        Args:
            batch_id: only this batch.
            since: only jobs finished since then (a ``timedelta`` counts back from now).
        """
        return self.jobs.stats(batch_id=batch_id, since=since)

    def serves(self, model: str | None = None) -> bool:
        """Whether a live worker serves ``model`` (default: the client's).

        Args:
            model: served model name.
        """
        return self.jobs.serves(model or self.model)


class _FollowedJobs:
    """A :class:`~jobs.pipeline_client.JobFeed` on a ``JobClient`` follower."""

    def __init__(self, jobs: JobClient, follower: Follower) -> None:
        self.jobs, self.follower = jobs, follower

    def add(self, job_ids: Collection[str]) -> None:
        self.jobs.follow_more(self.follower, job_ids)

    def __iter__(self) -> Iterator[list[JobInfo]]:
        return self.jobs.follow_open(self.follower)


def embedding_specs(texts: Sequence[str], *, model: str, dimensions: int | None,
                    priority: int, texts_per_job: int) -> list[JobSpec]:
    """The embedding jobs of ``texts``, ``texts_per_job`` a job, in order (``Client.embed``)."""
    pooling = {} if dimensions is None else {"dimensions": dimensions}
    return [JobSpec.model_validate({"model": model, "priority": priority,
                                    "embed": {"input": list(texts[i : i + texts_per_job]),
                                              "pooling": pooling}})
            for i in range(0, len(texts), texts_per_job)]


def embedding_vectors(job_ids: Sequence[str], done: Mapping[str, JobInfo]) -> list[list[float]]:
    """The vectors of the finished embedding jobs ``job_ids`` (float-encoded), in order;
    :class:`JobFailed` for the first that did not succeed."""
    vectors: list[list[float]] = []
    for job_id in job_ids:
        embeddings = result_of(done[job_id]).embeddings
        vectors += [v for v in embeddings or () if isinstance(v, list)]
    return vectors


def row_spec(row: Row, *, model: str, batch_id: str | None, system_prompt: str | None,
             defaults: Mapping[str, Any], priority: int, deadline: datetime | None,
             sampling: dict[Hashable, SamplingParams] | None = None) -> JobSpec:
    """The job of one dataset row: the row's sampling fields over ``defaults``.

    ``sampling``, when given, keeps the ``SamplingParams`` made for rows of the same sampling
    fields (the same ``defaults`` each call): a row like one seen before takes them as they
    are, validated once (half the cost of a plain row's job)."""
    prompt, messages = row.prompt, row.messages
    if system_prompt is not None:  # a raw prompt stays raw
        if messages is None and prompt is not None:
            prompt, messages = None, [{"role": "user", "content": prompt}]
        if messages is not None and not isinstance(messages, list):
            raise ValueError("'messages' must be a list of {role, content} objects")
        if messages is not None and not any(isinstance(m, Mapping) and m.get("role") == "system"
                                            for m in messages):
            messages = [{"role": "system", "content": system_prompt}, *messages]
    key = _sampling_key(row.sampling) if sampling is not None else None
    known = sampling.get(key) if sampling is not None and key is not None else None
    if row.embed is not None:  # an embedding: no sampling, defaults included
        known = SamplingParams()
    spec = JobSpec.model_validate({
        "model": model, "batch_id": batch_id, "custom_id": row.custom_id, "prompt": prompt,
        "raw_prompt": row.raw_prompt, "messages": messages, "embed": row.embed,
        "sampling": known if known is not None else {**defaults, **row.sampling},
        "priority": priority if row.priority is None else row.priority,
        "metadata": row.metadata, "deadline": deadline})
    if sampling is not None and key is not None and known is None:
        sampling[key] = spec.sampling
    return spec


def _sampling_key(fields: Mapping[str, Any]) -> Hashable | None:
    """A key equal for rows whose sampling fields validate alike: scalars only, each with its
    type (``True == 1``, but pydantic may take one and refuse the other); None for others."""
    if not all(v is None or type(v) in (str, int, float, bool) for v in fields.values()):
        return None
    return tuple(sorted((k, type(v), v) for k, v in fields.items()))


def _given(sampling: dict[str, Any], **named: Any) -> dict[str, Any]:
    return {**sampling, **{k: v for k, v in named.items() if v is not None}}


def validation_message(errors: Iterable[ErrorDetails], whole: str = "") -> str:
    """Pydantic's ``errors()`` (of a model, settings or a request) as one line: ``field: what
    is wrong`` per error, never the input values; an error of the whole object is named
    ``whole`` (or given bare)."""
    return "; ".join(": ".join(filter(None, (".".join(map(str, e["loc"])) or whole, e["msg"])))
                     for e in errors)
