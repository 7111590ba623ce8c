"""One run of a :class:`jobs.pipeline.Pipeline`: submit, follow in completion order, feed
the next stages, write the rows out.

Every job of the run is followed by one :class:`jobs.follow.Follower` that grows as rows move
on: when a job finishes, its row is parsed (or retried with another seed), filtered, exploded
into the stages it feeds and submitted there at once (one submission per stage for the jobs
one read found done), so a stage starts on its first rows while the stage before is still
running. A stage's jobs have priority ``-depth`` (0 for a first stage, -1 for the stages it
feeds, ...): they pass the backlog of the stages before them. Submissions go through the
client's ``submit_rows`` with the row's key as ``custom_id``: a row the stage's batch already
holds (from a run that was interrupted, or finished) is not submitted again, and its stored
result is used. The client is any :class:`jobs.pipeline_client.PipelineClient`: the SDK's
``Client`` (Redis and SQL) or ``RemoteClient`` (the HTTP API with a key), the same run.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic_core import to_jsonable_python

from jobs.pipeline import Pipeline, RowDict, Stage, canonical
from jobs.pipeline_client import JobFeed, PipelineClient
from jobs.pipeline_output import RecordSink, open_sink, output_record, to_dataset
from jobs.schemas import JobInfo, JobStatus

if TYPE_CHECKING:
    import datasets


@dataclass
class StageSummary:
    """What one stage did in a run (rows it reused from an earlier run included)."""

    rows_in: int = 0
    rows_out: int = 0
    filtered: int = 0
    failed: int = 0
    retried: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    gpu_s: float = 0.0  # its jobs' cost in GPU-seconds (``JobStats.gpu_s``), retries included
    started_at: datetime | None = None  # the first of its jobs to start on a worker
    finished_at: datetime | None = None  # the last of its jobs to finish

    def add_job(self, info: JobInfo) -> None:
        """Count a finished job's tokens, cost and times."""
        if info.stats is not None:
            self.gpu_s += info.stats.gpu_s or 0.0
        if info.result is not None:
            usage = info.result.usage
            self.prompt_tokens += usage.prompt_tokens
            self.cached_prompt_tokens += usage.cached_prompt_tokens
            self.generated_tokens += usage.completion_tokens
        if info.started_at is not None:
            self.started_at = min(filter(None, (self.started_at, info.started_at)))
        if info.finished_at is not None:
            self.finished_at = max(filter(None, (self.finished_at, info.finished_at)))

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache, over all prompt tokens."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class PipelineResult:
    """The rows out of the last stages (``lineage[i]``: stage -> key of the rows ``rows[i]``
    came from), the rows that failed, and each stage's summary."""

    rows: list[RowDict] = field(default_factory=list)
    lineage: list[dict[str, str]] = field(default_factory=list)
    failed: list[RowDict] = field(default_factory=list)
    summary: dict[str, StageSummary] = field(default_factory=dict)

    def records(self) -> list[RowDict]:
        """The rows as the output file has them: JSON-able, with the lineage columns
        (``_stage``, ``_key``, ``_parent``, ``_lineage``; :mod:`jobs.pipeline_output`)."""
        return [output_record(row, lin) for row, lin in zip(self.rows, self.lineage,
                                                            strict=True)]

    def dataset(self) -> datasets.Dataset:
        """The rows as a Hugging Face ``datasets.Dataset``, the columns of :meth:`records`."""
        return to_dataset(self.records())

    def table(self) -> str:
        """The summary as a text table, a line per stage; ``active s``: from its first job's
        start to its last job's end, in seconds from the first start of any stage (the
        stages overlap: no barrier); ``GPU s``: its jobs' cost in GPU-seconds
        (:attr:`StageSummary.gpu_s`)."""
        starts = [s.started_at for s in self.summary.values() if s.started_at]
        zero = min(starts) if starts else None

        def active(s: StageSummary) -> str:
            if zero is None or s.started_at is None or s.finished_at is None:
                return "-"
            return (f"{(s.started_at - zero).total_seconds():.1f}-"
                    f"{(s.finished_at - zero).total_seconds():.1f}")

        head = ("stage", "in", "out", "filtered", "failed", "retried", "prompt", "generated",
                "GPU s", "active s", "cache hit")
        lines = [head] + [(name, *(str(getattr(s, f)) for f in (
            "rows_in", "rows_out", "filtered", "failed", "retried", "prompt_tokens",
            "generated_tokens")), f"{s.gpu_s:.2f}", active(s), f"{s.prefix_cache_hit_rate:.0%}")
            for name, s in self.summary.items()]
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True))
                         for line in lines)


@dataclass(frozen=True)
class _Task:
    """A row in a stage: its job's try ``attempt``."""

    stage: Stage
    row: RowDict
    lineage: dict[str, str]  # stage name -> key of this row's ancestors
    parent: str  # the key of the row it came from ("" for a first stage's row)
    key: str
    attempt: int


class PipelineRun:
    """The state of one run: the jobs followed, what each stage did, the open outputs."""

    def __init__(self, pipeline: Pipeline, client: PipelineClient,
                 progress: bool | None) -> None:
        self.pipeline, self.client = pipeline, client
        self.fed = {s: [c for c in pipeline.stages if c.source is s] for s in pipeline.stages}
        self.depth: dict[Stage, int] = {}  # stages from a first stage (sources come first)
        for s in pipeline.stages:
            self.depth[s] = 0 if s.source is None else self.depth[s.source] + 1
        self.pending: dict[str, _Task] = {}  # job id -> its task
        self.outbox: dict[tuple[Stage, int], list[_Task]] = {}  # (stage, try) -> to submit
        self.feed: JobFeed | None = None  # made once the first rows are submitted
        self.result = PipelineResult(summary={s.name: StageSummary() for s in pipeline.stages})
        enabled = sys.stderr.isatty() if progress is None else progress
        from tqdm import tqdm

        self.bars = {s.name: tqdm(total=0, desc=s.name, unit="row", position=i, leave=True,
                                  file=sys.stderr, disable=not enabled, dynamic_ncols=True)
                     for i, s in enumerate(pipeline.stages)}
        self.output: RecordSink | None = None
        self.errors: RecordSink | None = None
        self.finished = False  # every job followed to its end

    def run(self, output: str | Path | None, errors: str | Path | None,
            timeout_s: float | None) -> PipelineResult:
        """Submit the first stages' rows, then follow every job to its end, feeding each
        done row to the stages it feeds (the arguments are ``Pipeline.run``'s)."""
        with contextlib.ExitStack() as stack:
            for bar in self.bars.values():
                stack.callback(bar.close)
            if output is not None:
                self.output = open_sink(output)
                stack.callback(self._close, self.output)
            if errors is not None:
                self.errors = open_sink(errors)
                stack.callback(self._close, self.errors)
            for stage in self.pipeline.stages:
                if stage.source is None:
                    self._enter(stage, self.pipeline.rows[stage.name], {}, "")
            self._flush()
            self.feed = self.client.follow_jobs(list(self.pending), timeout_s)
            for infos in self.feed:
                for info in infos:
                    self._done(self.pending.pop(info.id), info)
                self._flush()  # what they feed: a submission per stage and try
            self.finished = True
        return self.result

    def _close(self, sink: RecordSink) -> None:
        sink.close(self.finished)

    def _enter(self, stage: Stage, rows: Iterable[RowDict], lineage: dict[str, str],
               parent_key: str) -> None:
        """Submit the rows that enter ``stage`` from one parent row (or the first rows)."""
        seen: Counter[str] = Counter()
        tasks = []
        for row in rows:
            content = canonical(row)
            seen[content] += 1
            key = stage.row_key(parent_key, row, seen[content] - 1)
            tasks.append(_Task(stage, row, lineage, parent_key, key, 0))
        self.result.summary[stage.name].rows_in += len(tasks)
        self.bars[stage.name].total += len(tasks)
        self.bars[stage.name].refresh()
        self.outbox.setdefault((stage, 0), []).extend(tasks)

    def _flush(self) -> None:
        outbox, self.outbox = self.outbox, {}
        for (stage, attempt), tasks in outbox.items():
            self._submit(stage, attempt, tasks)

    def _submit(self, stage: Stage, attempt: int, tasks: list[_Task]) -> None:
        by_id: dict[str, _Task] = {}
        rows = []
        for task in tasks:
            custom_id = task.key if attempt == 0 else f"{task.key}.{attempt}"
            try:
                prompt = stage.prompt(task.row)
            except Exception as exc:  # the user's function failed on this row: it fails alone
                self._fail(task, f"prompt: {exc!r}")
                continue
            by_id[custom_id] = task
            rows.append({"custom_id": custom_id,
                         ("prompt" if isinstance(prompt, str) else "messages"): prompt,
                         "metadata": {"pipeline": self.pipeline.name, "stage": stage.name,
                                      "key": task.key, "parent": task.parent,
                                      "attempt": attempt}})
        if not rows:
            return
        # a later stage's jobs go first (lower priority runs first): a row done in one stage
        # passes the backlog of the stage before, so rows reach the end from the start
        done = self.client.submit_rows(stage.batch_id, rows, model=stage.model,
                                       priority=-self.depth[stage],
                                       sampling=stage.job_sampling(attempt))
        for custom_id, error in done.rejected.items():
            self._fail(by_id[custom_id], error)
        submitted = {job_id: by_id[c] for c, job_id in done.job_ids.items()}
        self.pending.update(submitted)
        if self.feed is not None:
            self.feed.add(list(submitted))

    def _done(self, task: _Task, info: JobInfo) -> None:
        stage, summary = task.stage, self.result.summary[task.stage.name]
        summary.add_job(info)
        if info.status is not JobStatus.SUCCEEDED or info.result is None:
            self._fail(task, info.error or info.status.value)
            return
        texts = [c.text for c in info.result.choices] or [info.result.text]
        try:
            values = [stage.value(task.row, text) for text in texts]
        except Exception as exc:  # did not parse: another seed, while tries are left
            if task.attempt < stage.retries:
                summary.retried += 1
                self.outbox.setdefault((stage, task.attempt + 1), []).append(
                    replace(task, attempt=task.attempt + 1))
            else:
                self._fail(task, f"parse: {exc}")
            return
        row = {**task.row, stage.name: values if stage.sampling.get("n", 1) > 1 else values[0]}
        try:  # the user's functions: one that raises on this row fails the row alone
            kept = stage.keep is None or stage.keep(row)
            fed = [(child, list(child.explode(row)) if child.explode else [row])
                   for child in self.fed[stage] if kept]
        except Exception as exc:
            self._fail(task, f"keep or explode: {exc!r}")
            return
        self.bars[stage.name].update()
        if not kept:
            summary.filtered += 1
            return
        summary.rows_out += 1
        lineage = {**task.lineage, stage.name: task.key}
        for child, rows in fed:
            self._enter(child, rows, lineage, task.key)
        if not fed:
            self.result.rows.append(row)
            self.result.lineage.append(lineage)
            if self.output is not None:
                self.output.write(output_record(row, lineage))

    def _fail(self, task: _Task, error: str | None) -> None:
        self.result.summary[task.stage.name].failed += 1
        self.bars[task.stage.name].update()
        failure = {"stage": task.stage.name, "key": task.key, "lineage": task.lineage,
                   "error": error, "row": to_jsonable_python(task.row)}
        self.result.failed.append(failure)
        if self.errors is not None:
            self.errors.write(failure)
