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
import json
import sys
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from jobs.rows import Row, RowKind, output_line, parse_row, rejected_line, rejected_row
from jobs.schemas import JobInfo, JobStatus
from jobs.sdk import Client


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


@dataclass
class RunTally:
    """What this run wrote."""

    written: int = 0
    failed: int = 0
    generated_tokens: int = 0
    skipped: int = 0  # already in the output before the run
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


def read_rows(path: Path, strict: bool = True) -> list[Row]:
    """Rows of a JSONL file (plain or OpenAI batch rows) or of a CSV file (a header with
    ``prompt``, optionally ``custom_id`` and sampling columns).

    Args:
        path: the file.
        strict: a bad row raises; else it is kept with its ``error`` (to be reported under its
            ``custom_id``), and only a line that has no ``custom_id`` to report it by raises.

    Raises:
        ValueError: naming the line of the first bad row.
    """
    rows: list[Row] = []
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
                rows.append(parse_row(obj, len(rows)))
            except ValueError as exc:
                if strict or obj is None:
                    raise ValueError(f"{path}:{line_no}: {exc}") from exc
                try:
                    rows.append(rejected_row(obj, len(rows), f"line {line_no}: {exc}"))
                except ValueError:
                    raise ValueError(f"{path}:{line_no}: {exc}") from exc
    return rows


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
                    for n, line in enumerate(complete.decode(errors="replace").splitlines(), 1)
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


def run_bulk(client: Client, rows: list[Row], opts: BulkOptions) -> RunTally:
    """Submit the rows not yet in the output and write each result as it completes.

    Interrupting it (Ctrl-C, a kill) loses nothing: jobs keep running on the workers, and
    the next run with the same options writes what is missing.
    """
    files = OutputFiles(opts.output, opts.errors)
    tally = RunTally()
    try:
        ids = {r.custom_id for r in rows}
        foreign = sorted(files.done - ids)
        if foreign:  # its rows with the same custom_id would count as done
            files.close()
            _remove(files.created)
            raise ValueError(f"{opts.output} holds results of rows this input does not have "
                             f"(custom_id {foreign[0]!r}): give another -o")
        record = batch_id_file(opts.output)
        previous = record.read_text() if record.exists() else None
        if previous is None:
            files.created.append(record)
        # Recorded before the jobs exist: a run killed right after submitting resumes them.
        record_batch_id(opts.input, opts.output, opts.batch_id)
        todo = [r for r in rows if r.custom_id not in files.done]
        tally.skipped = len(rows) - len(todo)
        rejected: dict[str, Row] | None = None if opts.strict else {}
        try:
            batch = client.submit_batch(todo, batch_id=opts.batch_id, model=opts.model,
                                        system_prompt=opts.system_prompt,
                                        priority=opts.priority, webhook_url=opts.webhook_url,
                                        rejected=rejected, **opts.defaults)
        except ValueError:  # refused before anything was stored: leave the files as they were
            files.close()
            _remove(files.created)
            if previous is not None:
                record.write_text(previous)
            raise
        kinds = {batch.job_ids[r.custom_id]: r.kind for r in todo
                 if r.custom_id in batch.job_ids}
        whole = len(kinds) == len(batch.job_ids)
        with _progress(len(rows), tally.skipped, opts.progress) as bar:
            for row in (rejected or {}).values():  # refused before it became a job
                files.write_rejected(row)
                tally.written += 1
                tally.failed += 1
                bar.update(1)
            for info in batch.jobs.follow(list(kinds), batch_id=batch.id if whole else None):
                files.write(kinds[info.id], info)
                tally.written += 1
                tally.failed += info.status is not JobStatus.SUCCEEDED
                tally.generated_tokens += info.stats.generated_tokens if info.stats else 0
                bar.update(1)
                elapsed = max(time.monotonic() - tally.started, 1e-9)
                bar.set_postfix(failed=tally.failed,
                                tok_s=f"{tally.generated_tokens / elapsed:.1f}", refresh=False)
    finally:
        files.close()
    return tally


def _remove(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def _progress(total: int, initial: int, enabled: bool):  # type: ignore[no-untyped-def]
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="row", desc="rows", file=sys.stderr,
                disable=not enabled, dynamic_ncols=True, smoothing=0.1)
