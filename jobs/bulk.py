"""``kvbatch submit``: a dataset file through the queue into a results file, resumably.

Resume rests on two keys. The output file: rows whose ``custom_id`` is already written are
not submitted or written again. The batch id (derived from the input and output paths
unless given): rows the batch already holds in SQL are not enqueued again, only followed,
so re-running the same command after an interruption writes the missing rows and reruns
nothing, whether those rows finished meanwhile or are still queued.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from jobs.rows import Row, RowKind, output_line, parse_row, rejected_line, rejected_row
from jobs.schemas import JobInfo, JobStatus
from jobs.sdk import Client

SUBMIT_CHUNK = 5000  # rows read, checked and stored at a time


@dataclass(frozen=True)
class BulkOptions:
    """One ``kvbatch submit`` run.

    Args:
        input: the dataset file (recorded beside the output with the batch id).
        output: results file (JSON lines), appended to.
        errors: file for rows that did not succeed; None writes them inline in ``output``.
        batch_id: the batch; keep it to resume.
        model: served model name for every row.
        system_prompt: prepended to rows without a system message.
        defaults: sampling fields for rows that do not set them.
        priority: default priority.
        webhook_url: the batch's completion webhook (POSTed by ``kvbatch control``).
        progress: show a progress bar (on stderr).
        strict: a row that cannot run refuses the whole file (nothing is submitted); else it
            gets an error line and the other rows run.
        wait: follow the jobs and write their results; else return once they are submitted
            (running the command again collects them).
    """

    input: Path
    output: Path
    errors: Path | None
    batch_id: str
    model: str
    system_prompt: str | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    webhook_url: str | None = None
    progress: bool = True
    strict: bool = False
    wait: bool = True


@dataclass
class RunTally:
    """What this run wrote."""

    written: int = 0
    failed: int = 0
    generated_tokens: int = 0
    skipped: int = 0  # already in the output before the run
    submitted: int = 0  # rows stored as jobs (or found stored by an earlier run)
    started: float = field(default_factory=time.monotonic)


def batch_id_file(output: Path) -> Path:
    """Where the batch of ``output`` is recorded, so that running the command again resumes it."""
    return output.with_name(output.name + ".batch")


def resume_batch_id(input_path: Path, output: Path, given: str | None = None) -> str:
    """The batch of ``output``: ``given``, else the one an earlier run on the same input
    recorded beside it, else a new random (unguessable) one.

    Raises:
        ValueError: ``output`` holds the results of another input (its rows would count as
            done for this one).
    """
    if given:
        return given
    recorded = batch_id_file(output)
    if recorded.is_file():
        text = recorded.read_text().strip()
        try:
            record = json.loads(text)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            return text  # recorded by a kvbatch that wrote the id alone
        if record.get("input") != str(input_path.resolve()):
            raise ValueError(f"{output} holds the results of {record.get('input')}, not of "
                             f"{input_path}: give another -o, or --batch-id to mix them")
        return str(record["batch_id"])
    if output.is_file() and output.stat().st_size:
        # Started by a kvbatch that derived the id from the paths: resume that batch.
        key = f"{input_path.resolve()}\n{output.resolve()}"
        return "ds-" + hashlib.sha256(key.encode()).hexdigest()[:24]
    return f"ds-{uuid.uuid4().hex}"


def record_batch_id(input_path: Path, output: Path, batch_id: str) -> None:
    batch_id_file(output).write_text(json.dumps({"batch_id": batch_id,
                                                 "input": str(input_path.resolve())}) + "\n")


def iter_rows(path: Path, strict: bool = True) -> Iterator[Row]:
    """The rows of a JSONL file (plain or OpenAI batch rows) or of a CSV file (a header with
    ``prompt``, optionally ``custom_id`` and sampling columns), read as they are needed: memory
    holds one line, whatever the file's size.

    Args:
        path: the file.
        strict: a bad row raises; else it is kept with its ``error`` (to be reported under its
            ``custom_id``), and only a line that has no ``custom_id`` to report it by raises.

    Raises:
        ValueError: naming the line of the first bad row.
    """
    index = 0
    with path.open(newline="" if path.suffix == ".csv" else None) as f:
        records: Iterable[tuple[int, Any]]
        if path.suffix == ".csv":
            records = ((i + 2, {k: v for k, v in rec.items() if v not in ("", None)})
                       for i, rec in enumerate(csv.DictReader(f)))
        else:
            records = ((i + 1, line) for i, line in enumerate(f) if line.strip())
        for line_no, record in records:
            obj = None
            try:
                obj = json.loads(record) if isinstance(record, str) else record
                row = parse_row(obj, index)
            except ValueError as exc:
                if strict or obj is None:
                    raise ValueError(f"{path}:{line_no}: {exc}") from exc
                try:
                    row = rejected_row(obj, index, f"line {line_no}: {exc}")
                except ValueError:
                    raise ValueError(f"{path}:{line_no}: {exc}") from exc
            index += 1
            yield row


def count_rows(path: Path) -> int:
    """How many rows ``path`` holds (non-blank lines, less a CSV's header), for progress."""
    with path.open("rb") as f:
        lines = sum(1 for line in f if line.strip())
    return max(lines - (path.suffix == ".csv"), 0)


def _custom_id(path: Path, line_no: int, line: str) -> str:
    try:
        return str(json.loads(line)["custom_id"])
    except (ValueError, TypeError, KeyError):
        raise ValueError(f"{path}:{line_no}: not a result line (JSON with a custom_id); "
                         "refusing to append to a file that is not a kvbatch results "
                         "file") from None


class OutputFiles:
    """Result lines appended as jobs finish, flushed line by line.

    On opening, the ``custom_id`` of every complete line already in the files is read; a
    partial last line (the run was killed while writing it) is cut off.
    """

    def __init__(self, output: Path, errors: Path | None) -> None:
        self.done: set[str] = set()
        self.created: list[Path] = []  # files this run made (removed if the run is refused)
        self._out = self._open(output)
        self._err = self._open(errors) if errors is not None else self._out

    def _open(self, path: Path) -> IO[str]:
        if not path.exists():
            self.created.append(path)
        else:
            data = path.read_bytes()
            complete = data[: data.rfind(b"\n") + 1]
            partial = data[len(complete):]
            # Read everything before changing anything: a file that is not a results file
            # is refused untouched.
            done = {_custom_id(path, n, line)
                    for n, line in enumerate(complete.decode(errors="replace").split("\n"), 1)
                    if line.strip()}
            if partial and not partial.lstrip().startswith(b"{"):
                raise ValueError(f"{path}: its last line is not a result line; refusing to "
                                 "append to a file that is not a kvbatch results file")
            self.done |= done
            if partial:
                path.write_bytes(complete)  # a line cut off by a kill: written again
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("a")

    def write(self, kind: RowKind, info: JobInfo) -> None:
        f = self._out if info.status is JobStatus.SUCCEEDED else self._err
        self._line(f, output_line(kind, info), str(info.custom_id))

    def write_rejected(self, row: Row) -> None:
        self._line(self._err, rejected_line(row), row.custom_id)

    def _line(self, f: IO[str], line: dict[str, Any], custom_id: str) -> None:
        f.write(json.dumps(line, ensure_ascii=False) + "\n")
        f.flush()
        self.done.add(custom_id)

    def close(self) -> None:
        self._out.close()
        self._err.close()


def run_bulk(client: Client, rows: Callable[[], Iterable[Row]], opts: BulkOptions,
             total: int | None = None) -> RunTally:
    """Submit the rows not yet in the output, :data:`SUBMIT_CHUNK` at a time as they are read,
    then (unless ``opts.wait`` is off) write each result as it completes.

    Args:
        client: the SDK client.
        rows: gives the rows afresh each call: read once, or twice when ``opts.strict`` (the
            whole file is checked before anything is stored) or when the output already holds
            results (they must all be rows of this input).
        opts: the run.
        total: how many rows there are, for the progress bar.

    Interrupting it (Ctrl-C, a kill) loses nothing: jobs keep running on the workers, and
    the next run with the same options writes what is missing.
    """
    files = OutputFiles(opts.output, opts.errors)
    tally = RunTally()
    record = batch_id_file(opts.output)
    previous = record.read_text() if record.exists() else None
    stored = False
    try:
        _first_pass(client, rows(), files.done, opts)
        # Rows of a batch this run creates are new to it (the first pass saw each once).
        new_batch = client.jobs.batch_settings(opts.batch_id) is None
        if previous is None:
            files.created.append(record)
        # Recorded before the jobs exist: a run killed right after submitting resumes them.
        record_batch_id(opts.input, opts.output, opts.batch_id)
        follow: set[str] = set()
        kinds: dict[str, RowKind] = {}  # by custom_id, for rows of another kind than the first
        first_kind: RowKind | None = None
        with _progress(total, opts.progress) as bar:
            # Each chunk is checked while the one before is stored (a thread: the database's
            # waits release the GIL).
            with client.jobs.store_behind():
                for chunk in _batched(rows(), SUBMIT_CHUNK):
                    todo = [row for row in chunk if row.custom_id not in files.done]
                    tally.skipped += len(chunk) - len(todo)
                    rejected: dict[str, Row] = {}
                    submitted: Mapping[str, str] = {}
                    if todo:
                        submitted = client.submit_batch(
                            todo, batch_id=opts.batch_id, model=opts.model,
                            system_prompt=opts.system_prompt, priority=opts.priority,
                            webhook_url=opts.webhook_url, chunk_size=SUBMIT_CHUNK,
                            new_rows=new_batch,
                            rejected=None if opts.strict else rejected, **opts.defaults).submitted
                        stored = True
                    for row in todo if opts.wait else ():  # what to follow, if waiting
                        if row.custom_id in submitted:
                            follow.add(submitted[row.custom_id])
                            first_kind = first_kind or row.kind
                            if row.kind is not first_kind:
                                kinds[row.custom_id] = row.kind
                    for row in rejected.values():  # refused before it became a job
                        files.write_rejected(row)
                        tally.written += 1
                        tally.failed += 1
                    tally.submitted += len(submitted)
                    bar.update(len(chunk))
            client.jobs.bulk_loaded(tally.submitted)
            if not opts.wait:
                return tally
            bar.reset(total=tally.submitted + tally.written)
            bar.update(tally.written)
            bar.set_description("rows")
            whole = sum(client.jobs.count_by_status(batch_id=opts.batch_id).values()) \
                == len(follow)
            for info in client.jobs.follow(follow, batch_id=opts.batch_id if whole else None):
                files.write(kinds.get(str(info.custom_id), first_kind or RowKind.PLAIN), info)
                tally.written += 1
                tally.failed += info.status is not JobStatus.SUCCEEDED
                tally.generated_tokens += info.stats.generated_tokens if info.stats else 0
                bar.update(1)
                elapsed = max(time.monotonic() - tally.started, 1e-9)
                bar.set_postfix(failed=tally.failed,
                                tok_s=f"{tally.generated_tokens / elapsed:.1f}", refresh=False)
    except ValueError:
        if not stored:  # refused before anything was stored: leave the files as they were
            files.close()
            _remove(files.created)
            if previous is not None:
                record.write_text(previous)
        raise
    finally:
        files.close()
    return tally


def _first_pass(client: Client, rows: Iterable[Row], done: set[str], opts: BulkOptions) -> None:
    """Check the whole input before anything is stored: every ``custom_id`` once (it keys the
    output and the resume), the output holding results of this input's rows only, and under
    ``opts.strict`` every row (as ``Client.submit_batch`` would, without storing). Memory
    holds the ids, not the rows.

    Raises:
        ValueError: naming the first row that cannot run, a repeated ``custom_id``, or a
            result of another input.
    """
    ids: set[str] = set()
    for chunk in _batched(rows, SUBMIT_CHUNK):
        for row in chunk:
            if row.custom_id in ids:
                raise ValueError(f"custom_id {row.custom_id!r} appears more than once in "
                                 f"batch {opts.batch_id!r}")
            ids.add(row.custom_id)
        if opts.strict:
            client.check_batch(chunk, batch_id=opts.batch_id, model=opts.model,
                               system_prompt=opts.system_prompt, priority=opts.priority,
                               **opts.defaults)
    foreign = sorted(done - ids)
    if foreign:  # its rows with the same custom_id would count as done
        raise ValueError(f"{opts.output} holds results of rows this input does not have "
                         f"(custom_id {foreign[0]!r}): give another -o")


def _batched(rows: Iterable[Row], n: int) -> Iterator[list[Row]]:
    it = iter(rows)
    while chunk := list(itertools.islice(it, n)):
        yield chunk


def _remove(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def _progress(total: int | None, enabled: bool):  # type: ignore[no-untyped-def]
    from tqdm import tqdm

    return tqdm(total=total, unit="row", desc="submitted", file=sys.stderr,
                disable=not enabled, dynamic_ncols=True, smoothing=0.1)
