"""The HTTP API as a pipeline's client: a team with an API key and the API's URL runs
``Pipeline.run(RemoteClient(url, key))`` as another runs it on Redis and SQL with ``Client()``.

```python
from jobs import Pipeline, RemoteClient

client = RemoteClient("https://kvbatch.example.com", api_key="kvb-…")  # or $KVBATCH_API_URL,
pipeline.run(client, output="qa.jsonl")                                 # $KVBATCH_API_KEY
```

It speaks ``jobs.api.rows``' two routes (standard library only: no HTTP package is needed) and
satisfies :class:`jobs.pipeline_client.PipelineClient`. Both routes are idempotent (a row's
``custom_id`` is its key), so a request that fails on the way (a connection refused or reset,
a 5xx, a timeout) is sent again, :data:`TRIES` times at most with a growing pause. The
batches and jobs are the key's: another key neither sees nor resumes them.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

from jobs.constants import DEFAULT_MODEL
from jobs.pipeline_client import JobFeed, Submitted
from jobs.schemas import JobInfo
from jobs.settings import ENV_PREFIX

URL_ENV, KEY_ENV = f"{ENV_PREFIX}API_URL", f"{ENV_PREFIX}API_KEY"
TRIES = 5  # tries of a request that failed on the way
FIRST_PAUSE_S = 0.5  # then doubled each try
WAIT_S = 10.0  # the longest one wait request blocks on the server
MAX_BODY_BYTES = 512 * 1024  # rows a submission request carries (the server takes 1 MiB)
MAX_WAIT_IDS = 10_000  # the server's bound on the ids of a wait


class RemoteError(Exception):
    """The API refused a request (4xx), or it failed :data:`TRIES` times.

    Attributes:
        status: the HTTP status (None: no answer).
        message: the API's message.
    """

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status, self.message = status, message


class RemoteClient:
    """A pipeline's client on the HTTP API (``kvbatch serve``).

    Args:
        url: the API's base URL (default ``$KVBATCH_API_URL``).
        api_key: a key made by ``kvbatch keys create`` (default ``$KVBATCH_API_KEY``).
        model: served model name of the stages that name none.
        timeout_s: the longest a request may take beyond its own waiting.

    Raises:
        ValueError: no URL or no key.
    """

    def __init__(self, url: str | None = None, api_key: str | None = None, *,
                 model: str = DEFAULT_MODEL, timeout_s: float = 60.0) -> None:
        url = url or os.environ.get(URL_ENV)
        api_key = api_key or os.environ.get(KEY_ENV)
        if not url or urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise ValueError(f"the HTTP API needs its http(s) URL: --api or ${URL_ENV}")
        if not api_key:
            raise ValueError(f"the HTTP API needs a key: --api-key or ${KEY_ENV} (kvbatch keys "
                             "create NAME makes one)")
        self.url, self.model, self.timeout_s = url.rstrip("/"), model, timeout_s
        self._key = api_key

    def __repr__(self) -> str:  # never the key
        return f"RemoteClient({self.url!r})"

    def __enter__(self) -> RemoteClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to release: each request is its own connection."""

    def submit_rows(self, batch_id: str, rows: Sequence[Mapping[str, Any]], *,
                    model: str | None = None, priority: int = 0,
                    sampling: Mapping[str, Any] | None = None) -> Submitted:
        """Submit ``rows`` to the key's batch ``batch_id`` (``custom_id`` the key; rows it
        holds already are not run again), in requests of up to :data:`MAX_BODY_BYTES`.

        Args:
            batch_id: the batch's name (the key's own: another key's of the same name is
                another batch).
            rows: plain rows, each with a ``custom_id``.
            model: served model name (default: the client's).
            priority: the rows' priority (lower runs first), -1000 to 1000.
            sampling: sampling fields of every row.

        Raises:
            RemoteError: the API refused the request (a bad key, an unknown model, a quota).
        """
        job_ids: dict[str, str] = {}
        rejected: dict[str, str] = {}
        path = f"/v1/kvbatch/batches/{urllib.parse.quote(batch_id, safe='')}/rows"
        for chunk in _chunks([json.dumps(r) for r in rows]):  # ASCII: a character a byte
            reply = self._post(path, f'{{"model": {json.dumps(model or self.model)}, '
                                     f'"priority": {int(priority)}, '
                                     f'"sampling": {json.dumps(dict(sampling or {}))}, '
                                     f'"rows": [{",".join(chunk)}]}}')
            job_ids.update(reply["job_ids"])
            rejected.update(reply["rejected"])
        return Submitted(job_ids, rejected)

    def follow_jobs(self, job_ids: Collection[str], timeout_s: float | None = None) -> JobFeed:
        """Follow the key's ``job_ids`` to their ends, more added as it goes (long polls of
        ``POST /v1/kvbatch/jobs/wait``).

        Args:
            job_ids: the jobs to follow first.
            timeout_s: iterating raises ``TimeoutError`` if they are not all done by then.
        """
        return _RemoteFeed(self, job_ids, timeout_s)

    def wait(self, job_ids: Sequence[str], timeout_s: float) -> tuple[list[JobInfo], list[str]]:
        """(those of ``job_ids`` that are terminal, waiting up to ``timeout_s`` for one;
        those the key has no job of)."""
        reply = self._post("/v1/kvbatch/jobs/wait", json.dumps(
            {"ids": list(job_ids), "timeout_s": timeout_s}), wait_s=timeout_s)
        return [JobInfo.model_validate(x) for x in reply["data"]], reply["unknown"]

    def _post(self, path: str, body: str, wait_s: float = 0.0) -> Any:
        request = urllib.request.Request(
            self.url + path, data=body.encode(), method="POST",
            headers={"Authorization": f"Bearer {self._key}",
                     "Content-Type": "application/json"})
        pause_s = FIRST_PAUSE_S
        for attempt in range(1, TRIES + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s + wait_s) as reply:
                    return json.load(reply)
            except urllib.error.HTTPError as exc:
                if exc.code < 500 or attempt == TRIES:
                    raise RemoteError(exc.code, _message(exc)) from None
            except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out
                if attempt == TRIES:
                    raise RemoteError(None, f"{self.url} did not answer: {exc}") from None
            time.sleep(pause_s)
            pause_s *= 2
        raise AssertionError("unreachable")


class _RemoteFeed:
    """A :class:`~jobs.pipeline_client.JobFeed` of long polls: each names the pending jobs
    (:data:`MAX_WAIT_IDS` of them, in turn, past that) and returns once one is done."""

    def __init__(self, client: RemoteClient, job_ids: Collection[str],
                 timeout_s: float | None) -> None:
        self.client = client
        self.pending = set(job_ids)
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._turn = 0

    def add(self, job_ids: Collection[str]) -> None:
        self.pending |= set(job_ids)

    def __iter__(self) -> Iterator[list[JobInfo]]:
        while self.pending:
            left_s = WAIT_S if self.deadline is None else self.deadline - time.monotonic()
            if left_s <= 0:
                raise TimeoutError(f"{len(self.pending)} jobs not finished in time")
            ids = sorted(self.pending)
            if len(ids) > MAX_WAIT_IDS:  # in turn, a short wait each
                start = self._turn % len(ids)
                ids, left_s = (ids[start:] + ids[:start])[:MAX_WAIT_IDS], min(left_s, 1.0)
                self._turn += MAX_WAIT_IDS
            done, unknown = self.client.wait(ids, min(left_s, WAIT_S))
            if unknown:
                raise KeyError(f"{len(unknown)} jobs are not this key's (or do not exist), "
                               f"as {unknown[0]!r}")
            done = [info for info in done if info.id in self.pending]
            self.pending -= {info.id for info in done}
            if done:
                yield done


def _chunks(rows: list[str]) -> Iterator[list[str]]:
    """The encoded rows in runs of at most :data:`MAX_BODY_BYTES` (a longer row alone)."""
    chunk: list[str] = []
    size = 0
    for row in rows:
        if chunk and size + len(row) > MAX_BODY_BYTES:
            yield chunk
            chunk, size = [], 0
        chunk.append(row)
        size += len(row) + 1
    if chunk:
        yield chunk


def _message(exc: urllib.error.HTTPError) -> str:
    """The API's error message (OpenAI's shape), else the status's reason."""
    try:
        return str(json.load(exc)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return str(exc.reason)
