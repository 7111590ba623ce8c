"""Rows of a key's named batches, submitted and followed job by job: the transport of a
pipeline run through the HTTP API (``jobs.remote.RemoteClient``; ``docs/pipelines.md``).

* ``POST /v1/kvbatch/batches/{name}/rows``: plain rows (``custom_id``, ``prompt`` or
  ``messages``, ``metadata``) with the batch's model, priority and sampling fields, checked as
  ``kvbatch submit`` checks them. ``custom_id`` is the key: a row the batch holds already is
  not stored again, so submitting again (a driver that was killed, a retried request) never
  runs a row twice. Answers each row's job id, and why each row that cannot run cannot.
* ``POST /v1/kvbatch/jobs/wait``: of the given job ids, those that are terminal, as stored
  (result and per-job statistics), waiting up to ``timeout_s`` for one when none is.

Tenancy: batch ``name`` of a key is stored as the batch ``<key id>:<name>`` (a hash of the name
past the id's 64 characters), tenant (``batches.owner``) that key: another key's batch of the
same name is another batch, its rows run again, and its jobs are unknown to this key. The
feeder shares the stream among tenants, and the key's queued rows count against its quota
(``max_queued_rows_per_key``), API batches' and these together.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations, and
# ``Owner`` is local to row_routes.
import contextlib
import hashlib
import re
from collections.abc import Callable, Collection, Generator
from typing import Annotated, Any, cast

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jobs.api.objects import ApiError
from jobs.api.quotas import Quotas
from jobs.api.records import ApiRecords
from jobs.client import JobClient
from jobs.echo import quote
from jobs.rows import parse_row
from jobs.schemas import JobInfo, JobSpec
from jobs.sdk import row_spec, validation_message

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}"  # a batch's name, as its key gives it
MAX_BATCH_ID_CHARS = 64  # batches.id
MAX_ROWS = 10_000  # rows a request
MAX_WAIT_IDS = 10_000  # job ids a wait names
MAX_WAIT_S = 30.0
MAX_REPLY_JOBS = 1000  # terminal jobs a wait answers (the others: the next wait)


def tenant_batch_id(owner: str, name: str) -> str:
    """The stored id of batch ``name`` of key ``owner``: ``<owner>:<name>``, or past 64
    characters ``<owner>::<48 hex digits of the name's SHA-256>`` (a name never starts with
    ``:``, so neither form can be the other)."""
    batch_id = f"{owner}:{name}"
    if len(batch_id) <= MAX_BATCH_ID_CHARS:
        return batch_id
    return f"{owner}::{hashlib.sha256(name.encode()).hexdigest()[:48]}"


# The priorities a key may give its rows (lower runs first): a row's own as the request's, so
# no row jumps the fleet's queue with a priority no request may ask for.
MAX_PRIORITY = 1000


class SubmitRows(BaseModel):
    """``POST /v1/kvbatch/batches/{name}/rows``."""

    model_config = ConfigDict(extra="forbid")

    rows: list[dict[str, Any]] = Field(max_length=MAX_ROWS)
    model: str
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    sampling: dict[str, Any] = Field(default_factory=dict)


class WaitJobs(BaseModel):
    """``POST /v1/kvbatch/jobs/wait``."""

    model_config = ConfigDict(extra="forbid")

    ids: list[str] = Field(max_length=MAX_WAIT_IDS)
    timeout_s: float = Field(10.0, ge=0.0, le=MAX_WAIT_S)


def row_routes(client: JobClient, records: ApiRecords, quotas: Quotas,
               owner: Callable[[Request], str],
               served_models: Callable[[], Collection[str]]) -> APIRouter:
    """The routes on the API's job client; ``owner`` is the key dependency of every route,
    ``served_models()`` the models a row may name."""
    router = APIRouter(prefix="/v1/kvbatch")
    Owner = Annotated[str, Depends(owner)]  # as app.Owner

    @router.post("/batches/{name}/rows")
    def submit_rows(name: str, body: SubmitRows, key: Owner) -> dict[str, Any]:
        if not re.fullmatch(NAME_PATTERN, name):
            raise ApiError(400, f"batch name {quote(name)} must match {NAME_PATTERN}",
                           param="name")
        if body.model not in served_models():
            raise ApiError(400, f"model {quote(body.model)} is not served here (GET /v1/models "
                                "lists those that are)", param="model", code="model_not_found")
        batch_id = tenant_batch_id(key, name)
        specs, rejected = _specs(body, batch_id)
        with records.session() as session, session.begin():
            quotas.check_rows(session, key, len(specs))
        if client.batches.open(batch_id, body.model, key, {"name": name}) != key:
            raise ApiError(409, f"batch {quote(name)} is not this key's")  # cannot happen
        over: dict[str, str] = {}
        try:
            job_ids = client.submit_batch(batch_id, specs, over_limit=over)
        except ValueError as exc:  # a custom_id twice in the request
            raise ApiError(400, str(exc), param="rows") from None
        return {"object": "kvbatch.rows", "batch": name, "job_ids": job_ids,
                "rejected": rejected | over}

    @router.post("/jobs/wait")
    def wait_jobs(body: WaitJobs, key: Owner) -> dict[str, Any]:
        owned = client.reader.owned_job_ids(key, body.ids)
        done = sorted(client.reader.terminal_ids(sorted(owned))) if owned else []
        infos: list[JobInfo] = []
        if done:
            infos = client.get_many(done[:MAX_REPLY_JOBS])
        elif owned and body.timeout_s > 0:
            follower = client.follower(owned, body.timeout_s)
            # a generator: closing it ends the follow (its notices) at once
            feed_gen = cast(Generator[list[JobInfo], None, None], client.follow_open(follower))
            with (contextlib.closing(feed_gen) as feed,
                  contextlib.suppress(TimeoutError)):
                infos = next(feed, [])[:MAX_REPLY_JOBS]
        infos.sort(key=lambda i: (i.finished_at is None, i.finished_at))
        return {"object": "list", "data": [i.model_dump(mode="json") for i in infos],
                "unknown": [i for i in body.ids if i not in owned]}

    return router


def _specs(body: SubmitRows, batch_id: str) -> tuple[list[JobSpec], dict[str, str]]:
    """The jobs of the rows that can run, and why each other row cannot (by ``custom_id``);
    a row without a ``custom_id`` refuses the request."""
    specs: list[JobSpec] = []
    rejected: dict[str, str] = {}
    sampling: dict[Any, Any] = {}
    for index, raw in enumerate(body.rows):
        custom_id = raw.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise ApiError(400, f"row {index}: a row needs a custom_id (the key that keeps it "
                                "from running twice)", param="rows")
        try:
            row = parse_row(raw, index)
            if row.error is not None:
                raise ValueError(row.error)
            if row.priority is not None and abs(row.priority) > MAX_PRIORITY:
                raise ValueError(f"priority {row.priority} is outside -{MAX_PRIORITY}.."
                                 f"{MAX_PRIORITY}, the priorities a key may ask for")
            specs.append(row_spec(row, model=body.model, batch_id=batch_id, system_prompt=None,
                                  defaults=body.sampling, priority=body.priority,
                                  deadline=None, sampling=sampling))
        except ValidationError as exc:
            rejected[custom_id] = validation_message(exc.errors(), "row")
        except ValueError as exc:
            rejected[custom_id] = str(exc)
    return specs, rejected
