"""What a pipeline run needs of a client, and no more: submit rows to a named batch (its
``custom_id`` the key: rows the batch holds already are not submitted again), and follow jobs
to their ends while more are added. Two clients satisfy it: :class:`jobs.sdk.Client` (Redis and
SQL, one tenant) and :class:`jobs.remote.RemoteClient` (the HTTP API, with an API key: the
batches and jobs are that key's). :mod:`jobs.pipeline_run` talks to this interface only.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from jobs.schemas import JobInfo


@dataclass(frozen=True)
class Submitted:
    """What one submission of rows to a batch did.

    ``job_ids``: ``custom_id`` -> job id of each row the batch now holds (stored now, or held
    from an earlier submission: not run again); ``rejected``: ``custom_id`` -> why a row
    cannot run (nothing was stored for it)."""

    job_ids: dict[str, str]
    rejected: dict[str, str]


class JobFeed(Protocol):
    """Jobs followed to their ends: iterating yields the jobs found terminal together (each
    once, in completion order) until none followed is left; :meth:`add` follows more between
    two of its results. Iterating raises ``TimeoutError`` past the feed's time limit."""

    def add(self, job_ids: Collection[str]) -> None: ...

    def __iter__(self) -> Iterator[list[JobInfo]]: ...


class PipelineClient(Protocol):
    """The transport of a pipeline run (see the module)."""

    def submit_rows(self, batch_id: str, rows: Sequence[Mapping[str, Any]], *,
                    model: str | None, priority: int,
                    sampling: Mapping[str, Any]) -> Submitted:
        """Submit plain rows (``custom_id``, ``prompt`` or ``messages``, ``metadata``) to batch
        ``batch_id`` with the sampling fields ``sampling``, on ``model`` (None: the client's);
        a row that cannot run is rejected alone."""
        ...

    def follow_jobs(self, job_ids: Collection[str], timeout_s: float | None) -> JobFeed:
        """A feed of ``job_ids`` (more may be added), ``TimeoutError`` after ``timeout_s``."""
        ...
