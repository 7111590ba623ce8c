"""A batch's life, as OpenAI's: ``validating`` → ``in_progress`` → ``finalizing`` →
``completed``, or ``failed`` (invalid input file), ``expired`` (completion window passed),
``cancelling`` → ``cancelled``.

* **validating**: the input file is read twice, streaming. The first pass checks every line
  (JSON, endpoint, model, the row's fields by the same rules as ``kvbatch submit``, limits,
  unique ``custom_id``); any bad line fails the batch, with up to :data:`MAX_ERRORS` line
  errors, and nothing runs. The second pass stores and enqueues the rows as jobs of a queue
  batch with the same id, in chunks; ``custom_id`` is the key, so a pass cut off by a crash is
  finished by the next one without running a row twice.
* **in_progress**: the jobs run on the workers; ``request_counts`` are read from SQL.
* **finalizing**: every job is terminal; the output file (succeeded rows) and the error file
  (the others) are sized by streaming their lines from SQL, then recorded. Their content is
  made from SQL again whenever it is read, never held whole anywhere.

A process takes a batch it validates or finalizes with a lease in its row, renewed as it
goes: a second API replica leaves it alone, and if the process dies the lease runs out and
another (or the same, restarted) takes it up. Every move is guarded by the status it leaves.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import Any, BinaryIO

from pydantic import ValidationError

from jobs.api.objects import ApiError, not_found
from jobs.api.records import ApiRecords, new_id
from jobs.api.settings import ApiSettings
from jobs.api.storage import FileStorage, read_chunks
from jobs.client import JobClient
from jobs.constants import MAX_PAYLOAD_BYTES
from jobs.models import ApiBatch, File
from jobs.rows import CHAT_URL, COMPLETIONS_URL, RowKind, output_line, parse_row
from jobs.schemas import JobSpec, JobStatus
from jobs.sdk import row_spec, validation_message
from jobs.store import MaintenanceStore, db_now
from jobs.store.transitions import aware

log = logging.getLogger(__name__)

ENDPOINTS = (CHAT_URL, COMPLETIONS_URL)
MAX_ERRORS = 100  # line errors kept on a failed batch
CHUNK_ROWS = 1000  # rows per transaction and Redis pipeline when submitting
PAGE_ROWS = 500  # jobs per read when writing output files
_WINDOW = re.compile(r"^([1-9][0-9]{0,3})([hd])$")
_WINDOW_S = {"h": 3600, "d": 86400}


class Status(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


UNFINISHED = (Status.VALIDATING, Status.IN_PROGRESS, Status.FINALIZING, Status.CANCELLING)


def window_seconds(window: str) -> int:
    """Seconds of a completion window: ``24h`` (OpenAI's one value), or any ``<n>h`` / ``<n>d``
    up to 9999."""
    match = _WINDOW.match(window)
    if not match:
        raise ApiError(400, f"completion_window {window!r} is not supported: give hours or "
                            "days, as '24h' or '7d'", param="completion_window")
    return int(match[1]) * _WINDOW_S[match[2]]


@dataclass
class LineError(Exception):
    """Why one line of an input file cannot run (OpenAI's ``errors.data`` entries)."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None

    def entry(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param,
                "line": self.line}


class BatchRunner:
    """Creates and cancels batches, and moves them along (:meth:`run`, in a thread)."""

    def __init__(self, client: JobClient, records: ApiRecords, storage: FileStorage,
                 settings: ApiSettings) -> None:
        self.client, self.records, self.storage, self.settings = (
            client, records, storage, settings)
        self.maintenance = MaintenanceStore(client.engine)
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="batch")
        self._busy: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.holder = uuid.uuid4().hex[:16]  # this process, as a lease holder

    # -- requests --------------------------------------------------------------------------

    def served_models(self) -> list[str]:
        """The models batches may name: the configured ones and those of live workers."""
        return sorted(set(self.settings.models) | self.client.served_models())

    def create(self, owner: str, input_file_id: str, endpoint: str, completion_window: str,
               metadata: dict[str, str] | None) -> ApiBatch:
        """A new batch, ``validating``; the runner takes it from there."""
        if endpoint not in ENDPOINTS:
            raise ApiError(400, f"endpoint {endpoint!r} is not supported: "
                                f"{' or '.join(ENDPOINTS)}", param="endpoint")
        window_s = window_seconds(completion_window)
        if metadata is not None and (len(metadata) > 16 or any(
                not isinstance(k, str) or not isinstance(v, str) or len(k) > 64 or len(v) > 512
                for k, v in metadata.items())):
            raise ApiError(400, "metadata is at most 16 string pairs (keys up to 64 characters, "
                                "values up to 512)", param="metadata")
        source = self.records.get(File, owner, input_file_id)
        if source is None:
            raise not_found("file", input_file_id)
        if source.kind != "upload" or source.purpose != "batch":
            raise ApiError(400, f"file {input_file_id} was not uploaded with purpose 'batch'",
                           param="input_file_id")
        row = ApiBatch(id=new_id("batch_"), owner_id=owner, input_file_id=input_file_id,
                       endpoint=endpoint, completion_window=completion_window, meta=metadata,
                       status=Status.VALIDATING.value, total=0)
        with self.records.session() as session, session.begin():
            now = db_now(session)
            row.created_at, row.expires_at = now, now + timedelta(seconds=window_s)
            session.add(row)
        self.wake()
        return row

    def cancel(self, owner: str, batch_id: str) -> ApiBatch:
        """Ask batch ``batch_id`` to stop: its queued rows are cancelled, running ones
        aborted, and it ends ``cancelled`` with the output of what finished."""
        row = self.records.get(ApiBatch, owner, batch_id)
        for _ in range(3):  # the batch may move on (validated) between the read and the move
            if row is None:
                raise not_found("batch", batch_id)
            if row.status not in (Status.VALIDATING, Status.IN_PROGRESS):
                break
            # A validator at work keeps its lease: the batch is not finalized until it stops.
            row = self.records.move(batch_id, [row.status], Status.CANCELLING,
                                    keep_lease=True) or self.records.get(ApiBatch, owner,
                                                                         batch_id)
        assert row is not None
        if row.status not in (Status.CANCELLING, Status.CANCELLED):
            # 400, not 409: the openai client retries a 409
            raise ApiError(400, f"batch {batch_id} is {row.status}: it cannot be cancelled")
        if row.status == Status.CANCELLING:
            self.client.cancel_batch(batch_id)
            self.wake()
        return row

    def counts(self, row: ApiBatch) -> dict[JobStatus, int]:
        if row.status in (Status.VALIDATING, Status.FAILED):
            return {}
        return self.client.count_by_status(batch_id=row.id)

    def content(self, row: File) -> Iterator[bytes]:
        """The bytes of file ``row`` (``FileNotFoundError`` if its content is gone)."""
        return read_chunks(self.storage.open(row.id))

    # -- the runner ------------------------------------------------------------------------

    def run(self) -> None:
        """Move every unfinished batch along each ``poll_interval_s`` (or when woken) until
        :meth:`stop`."""
        while not self._stop.is_set():
            try:
                for row in self.records.unfinished(UNFINISHED):
                    self.advance(row)
            except Exception:  # a database outage: try again next round
                log.exception("batch round failed")
            self._wake.wait(self.settings.poll_interval_s)
            self._wake.clear()

    def wake(self) -> None:
        """Look at the batches now rather than at the next round."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def advance(self, row: ApiBatch) -> None:
        """One step for batch ``row``: start validating or finalizing it (in the pool), or
        see whether its jobs are all done."""
        if row.status == Status.VALIDATING:
            self._start(row.id, Status.VALIDATING, self._validate)
        elif row.status == Status.FINALIZING:
            self._start(row.id, Status.FINALIZING, self._finalize)
        elif row.status in (Status.IN_PROGRESS, Status.CANCELLING):
            self._follow(row)

    def _start(self, batch_id: str, status: Status, work: Callable[[str], None]) -> None:
        with self._lock:
            if batch_id in self._busy:
                return
            self._busy.add(batch_id)
        self._pool.submit(self._leased, batch_id, status, work)

    def _leased(self, batch_id: str, status: Status, work: Callable[[str], None]) -> None:
        """``work`` on ``batch_id`` under this runner's lease (nothing if another holds it)."""
        try:
            if self.records.claim(batch_id, status, self.holder, self.settings.lease_s):
                try:
                    work(batch_id)
                finally:
                    self.records.release(batch_id, self.holder)
        except Exception:  # the batch is taken up again next round
            log.exception("batch %s: %s step failed", batch_id, status)
        finally:
            with self._lock:
                self._busy.discard(batch_id)

    def _renew(self, batch_id: str, status: Status) -> bool:
        return self.records.renew(batch_id, status, self.holder, self.settings.lease_s)

    def _follow(self, row: ApiBatch) -> None:
        counts = self.client.count_by_status(batch_id=row.id)
        if row.status == Status.CANCELLING:
            if counts.get(JobStatus.QUEUED):  # stored after the cancel, by its validator
                self.client.cancel_batch(row.id)
                return
            lease = aware(row.lease_until)
            if lease is not None and lease.timestamp() > time.time():
                return  # its validator may still store rows
        elif (expires := aware(row.expires_at)) is not None and expires.timestamp() <= time.time():
            self.maintenance.expire_batches(time.time(), batch_id=row.id)
            counts = self.client.count_by_status(batch_id=row.id)
        if any(not s.terminal for s in counts):
            return
        if self.records.move(row.id, [row.status], Status.FINALIZING):
            self._start(row.id, Status.FINALIZING, self._finalize)

    # -- validating ------------------------------------------------------------------------

    def _validate(self, batch_id: str) -> None:
        row = self.records.get(ApiBatch, None, batch_id)
        if row is None or row.status != Status.VALIDATING:
            return
        known = {cid for _, cid, _ in self.client.batch_jobs(batch_id)}
        if not known:  # else an earlier pass checked the file and began storing its rows
            try:
                errors = self._check(row)
            except FileNotFoundError:
                errors = [_file_gone()]
            if errors is None:
                return  # cancelled while it was checked
            if errors:
                self._fail(batch_id, errors)
                return
        try:
            self._submit(row, known)
        except FileNotFoundError:
            self._fail(batch_id, [_file_gone()])

    def _fail(self, batch_id: str, errors: list[LineError]) -> None:
        if self.records.move(batch_id, [Status.VALIDATING], Status.FAILED,
                             errors={"object": "list", "data": [e.entry() for e in errors]}):
            self.client.cancel_batch(batch_id)  # rows an earlier pass stored, if any
            log.info("batch %s failed validation (%d errors)", batch_id, len(errors))

    def _submit(self, row: ApiBatch, known: set[str | None]) -> None:
        """The second pass: store the rows not in ``known`` as jobs, then ``in_progress``."""
        batch_id = row.id
        chunk: list[JobSpec] = []
        total, model = 0, None
        for _, spec in self._specs(row, None):
            if isinstance(spec, LineError):  # the first pass read the same bytes
                raise RuntimeError(f"line {spec.line} changed since it was checked")
            total, model = total + 1, spec.model
            if spec.custom_id not in known:
                chunk.append(spec)
            if total % CHUNK_ROWS == 0:
                if chunk:
                    self.client.store(chunk, deadline=row.expires_at)
                    chunk = []
                if not self._renew(batch_id, Status.VALIDATING):
                    return  # cancelled: following the batch cancels what was stored
        if chunk:
            self.client.store(chunk, deadline=row.expires_at)
        self.client.bulk_loaded(total)
        if self.records.move(batch_id, [Status.VALIDATING], Status.IN_PROGRESS, total=total,
                             model=model):
            log.info("batch %s: %d requests on %s in progress", batch_id, total, model)

    def _check(self, row: ApiBatch) -> list[LineError] | None:
        """The first pass: every line's errors (up to :data:`MAX_ERRORS`); None if the batch
        left ``validating`` meanwhile (cancelled)."""
        errors: list[LineError] = []
        seen: set[str] = set()
        total, model = 0, None
        for line_no, spec in self._specs(row, set(self.served_models())):
            if isinstance(spec, LineError):
                errors.append(spec)
            elif spec.custom_id in seen:
                errors.append(LineError("duplicate_custom_id", f"custom_id {spec.custom_id!r} "
                                        "appears on an earlier line", "custom_id", line_no))
            elif model is not None and spec.model != model:
                errors.append(LineError("mismatched_model", f"every request of a batch names "
                                        f"the same model: {model!r} before, {spec.model!r} "
                                        "here", "body.model", line_no))
            else:
                seen.add(str(spec.custom_id))
                model = spec.model
            total += 1
            if total % CHUNK_ROWS == 0 and not self._renew(row.id, Status.VALIDATING):
                return None
            if total > self.settings.max_requests_per_batch:
                errors.append(LineError("too_many_requests", "a batch holds at most "
                                        f"{self.settings.max_requests_per_batch} requests",
                                        None, line_no))
            if len(errors) >= MAX_ERRORS:
                break
        if total == 0 and not errors:
            errors.append(LineError("empty_file", "the input file holds no requests"))
        return errors

    def _specs(self, row: ApiBatch,
               models: set[str] | None) -> Iterator[tuple[int, JobSpec | LineError]]:
        """(line number, its job or why it cannot run) for each non-blank line; ``models``:
        those a line may name (None: not checked)."""
        with self.storage.open(row.input_file_id) as f:
            for line_no, raw in enumerate(_bounded_lines(f, MAX_PAYLOAD_BYTES), 1):
                if raw is None:
                    yield line_no, LineError("invalid_request", "the line is over the "
                                             f"{MAX_PAYLOAD_BYTES}-byte limit of a request",
                                             None, line_no)
                elif raw.strip():
                    try:
                        yield line_no, self._spec(raw, row, models)
                    except LineError as exc:
                        exc.line = line_no
                        yield line_no, exc

    def _spec(self, raw: bytes, row: ApiBatch, models: set[str] | None) -> JobSpec:
        try:
            obj = json.loads(raw)
        except (UnicodeDecodeError, ValueError):
            raise LineError("invalid_json_line", "the line is not valid JSON") from None
        if not isinstance(obj, dict):
            raise LineError("invalid_request", "a line is a JSON object")
        if obj.get("url") != row.endpoint:
            raise LineError("invalid_url", f"url must be the batch's endpoint {row.endpoint}",
                            "url")
        body = obj.get("body")
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not model:
            raise LineError("invalid_request", "body.model is required", "body.model")
        if models is not None and model not in models:
            raise LineError("model_not_found", f"model {model!r} is not served here (GET "
                                               "/v1/models lists those that are)", "body.model")
        try:
            spec = row_spec(parse_row(obj, 0), model=model, batch_id=row.id, system_prompt=None,
                            defaults={}, priority=0, deadline=row.expires_at)
            self.client.check(spec)
        except ValidationError as exc:
            raise LineError("invalid_request", validation_message(exc)) from None
        except ValueError as exc:
            raise LineError("invalid_request", str(exc)) from None
        return spec

    # -- finalizing ------------------------------------------------------------------------

    def _finalize(self, batch_id: str) -> None:
        row = self.records.get(ApiBatch, None, batch_id)
        if row is None or row.status != Status.FINALIZING:
            return
        counts = self.client.count_by_status(batch_id=batch_id)
        files = []
        for kind in ("output", "error"):
            file = self._write_output(row, kind)
            if file is None:
                return  # the lease went to another process
            if file.bytes:
                files.append(file)
        status = (Status.CANCELLED if row.cancelling_at is not None
                  else Status.EXPIRED if counts.get(JobStatus.EXPIRED) else Status.COMPLETED)
        if self.records.finalize(batch_id, status, files):
            log.info("batch %s %s", batch_id, status)

    def _write_output(self, batch: ApiBatch, kind: str) -> File | None:
        """Write the output (or error) file of ``batch`` from the jobs table into storage, a
        page of jobs at a time; None if the lease was lost meanwhile."""
        file_id = f"file-{batch.id.removeprefix('batch_')}-{kind}"
        upload = self.storage.begin(file_id)
        try:
            after, size = "", 0
            line_kind = RowKind(batch.endpoint)
            while True:
                page = self.client.batch_page(batch.id, succeeded=kind == "output",
                                              after=after, limit=PAGE_ROWS)
                if page:
                    data = "".join(json.dumps(output_line(line_kind, info), ensure_ascii=False)
                                   + "\n" for info in page).encode()
                    upload.write(data)
                    size += len(data)
                    if not self._renew(batch.id, Status.FINALIZING):
                        upload.discard()
                        return None
                if len(page) < PAGE_ROWS:
                    break
                after = page[-1].id
        except BaseException:
            upload.discard()
            raise
        if not size:
            upload.discard()
        else:
            upload.commit()
        return File(id=file_id, owner_id=batch.owner_id, purpose="batch_output",
                    filename=f"{batch.id}_{kind}.jsonl", bytes=size, batch_id=batch.id,
                    kind=kind)


def _file_gone() -> LineError:
    return LineError("file_not_found", "the input file was deleted before the batch ran")


def _bounded_lines(f: BinaryIO, limit: int) -> Iterator[bytes | None]:
    """The lines of ``f``; a line of more than ``limit`` bytes (its newline aside) is read in
    pieces, never whole, and given as None."""
    while line := f.readline(limit + 1):
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        while line and not line.endswith(b"\n"):  # the rest of the long line
            line = f.readline(limit + 1)
        yield None
