"""An HTTP batch: an input file checked and stored as the jobs of a batch (``BatchStatus``, the
one lifecycle every batch has), then its output and error files. OpenAI's states are a view of
the batch's (``jobs.api.objects.openai_status``).

* **validating**: the input file is read twice, streaming. The first pass checks every line
  (JSON, endpoint, model, the row's fields by the same rules as ``kvbatch submit``, limits,
  unique ``custom_id``); any bad line fails the batch, with up to :data:`MAX_ERRORS` line
  errors, and nothing runs. The second pass stores the rows as the batch's jobs, in chunks;
  ``custom_id`` is the key, so a pass cut off by a crash is finished by the next one without
  running a row twice. A batch cancelled meanwhile starts with what was stored, cancelled.
* **in_progress**: the jobs run on the workers; ``request_counts`` are read from SQL. The
  batch ends by the one expiry and completion check (``BatchStore.expire_batches``,
  ``complete_batches``), which the control plane runs too.
* **ended** (OpenAI's ``finalizing`` until its files are recorded): the output file (succeeded
  rows) and the error file (the others) are written by the one export (``jobs.export``, one
  job at a time), then recorded. Their content is read back from storage, never held whole.

Every line that cannot run is that line's error, whatever it makes raise. Tries at validating a
batch and at writing its files are counted before the work and bounded
(``ApiSettings.max_attempts``): then the batch fails, or is recorded without its files, with the
last try's error. A batch still validating past its window expires.

A process validates a batch or writes its files under the batch's lease (``jobs.lease``),
renewed as it goes: a second API replica leaves it alone, and if the process dies the lease
runs out and another (or the same, restarted) takes it up. Its writes carry the lease's fencing
token, so a holder that lost the lease while stalled changes nothing.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, BinaryIO

from pydantic import ValidationError

from jobs.api.objects import ApiError, cancel_took, not_found, openai_status
from jobs.api.quotas import Quotas
from jobs.api.records import ApiRecords, new_id
from jobs.api.settings import ApiSettings
from jobs.api.storage import FileStorage, read_chunks
from jobs.client import JobClient
from jobs.constants import MAX_PAYLOAD_BYTES
from jobs.echo import clip, quote
from jobs.export import export_batch
from jobs.lease import Lease, LeaseLost
from jobs.models import ApiBatch, File
from jobs.queue import announce_ended
from jobs.rows import (
    CHAT_URL,
    COMPLETIONS_URL,
    EMBEDDINGS_URL,
    RowKind,
    output_line,
    parse_row,
)
from jobs.schemas import BatchStatus, JobSpec, JobStatus
from jobs.sdk import row_spec, validation_message

log = logging.getLogger(__name__)

ENDPOINTS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL)
FILE_KINDS = ("output", "error")  # the files of an ended batch
MAX_ERRORS = 100  # line errors kept on a failed batch
CHUNK_ROWS = 1000  # rows per transaction and Redis pipeline when submitting
_WINDOW = re.compile(r"^([1-9][0-9]{0,3})([hd])$")
_WINDOW_S = {"h": 3600, "d": 86400}


def window_seconds(window: str) -> int:
    """Seconds of a completion window: ``24h`` (OpenAI's one value), or any ``<n>h`` / ``<n>d``
    up to 9999."""
    match = _WINDOW.match(window)
    if not match:
        raise ApiError(400, f"completion_window {quote(window)} is not supported: give hours or "
                            "days, as '24h' or '7d'", param="completion_window")
    return int(match[1]) * _WINDOW_S[match[2]]


class Phase(StrEnum):
    """What the runner does to a batch under its lease; tries of each are counted
    (``api_batches.<phase>_attempts``)."""

    VALIDATE = "validate"
    FINALIZE = "finalize"


@dataclass
class LineError(Exception):
    """Why one line of an input file cannot run (OpenAI's ``errors.data`` entries)."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None

    def entry(self) -> dict[str, Any]:
        """The ``errors.data`` entry, its message cut to
        :data:`jobs.echo.MAX_MESSAGE_CHARS`."""
        return {"code": self.code, "message": clip(self.message), "param": self.param,
                "line": self.line}


class BatchRunner:
    """Creates and cancels batches, and moves them along (:meth:`run`, in a thread)."""

    def __init__(self, client: JobClient, records: ApiRecords, storage: FileStorage,
                 settings: ApiSettings, models: Sequence[str]) -> None:
        self.client, self.records, self.storage, self.settings = (
            client, records, storage, settings)
        self.models = frozenset(models)  # the deployment's (KVBATCH_MODELS)
        self.batches = client.batches
        self.quotas = Quotas(settings)
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="batch")
        self._busy: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()

    # -- requests --------------------------------------------------------------------------

    def served_models(self) -> list[str]:
        """The models batches may name: the deployment's, whether or not a worker is up, and
        those of live workers."""
        return sorted(self.models | self.client.served_models())

    def create(self, owner: str, input_file_id: str, endpoint: str, completion_window: str,
               metadata: dict[str, str] | None) -> ApiBatch:
        """A new batch, ``validating``; the runner takes it from there."""
        if endpoint not in ENDPOINTS:
            raise ApiError(400, f"endpoint {quote(endpoint)} is not supported: "
                                f"{', '.join(ENDPOINTS)}", param="endpoint")
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
        batch_id = new_id("batch_")
        self.batches.create(batch_id, window_s, [ApiBatch(
            id=batch_id, owner_id=owner, input_file_id=input_file_id, endpoint=endpoint,
            completion_window=completion_window, meta=metadata)], owner=owner,
            before=lambda session: self.quotas.check_batch(session, owner))
        self.wake()
        return self._own(owner, batch_id)

    def cancel(self, owner: str, batch_id: str) -> ApiBatch:
        """Ask batch ``batch_id`` to stop: its queued rows are cancelled, running ones
        aborted, and it ends ``cancelled`` with the output of what finished."""
        self._own(owner, batch_id)
        self.client.cancel_batch(batch_id)
        row = self._own(owner, batch_id)
        if not cancel_took(row):
            # 400, not 409: the openai client retries a 409
            raise ApiError(400, f"batch {batch_id} is {openai_status(row)}: it cannot be "
                                "cancelled")
        self.wake()
        return row

    def _own(self, owner: str, batch_id: str) -> ApiBatch:
        row = self.records.get(ApiBatch, owner, batch_id)
        if row is None:
            raise not_found("batch", batch_id)
        return row

    def counts(self, row: ApiBatch) -> dict[JobStatus, int]:
        if row.batch.status in (BatchStatus.VALIDATING, BatchStatus.FAILED):
            return {}
        return self.client.count_by_status(batch_id=row.id)

    def content(self, row: File) -> Iterator[bytes]:
        """The bytes of file ``row`` (``FileNotFoundError`` if its content is gone)."""
        return read_chunks(self.storage.open(row.id))

    # -- the runner ------------------------------------------------------------------------

    def run(self) -> None:
        """Move every unfinished batch along, and purge expired files, each
        ``poll_interval_s`` (or when woken) until :meth:`stop`."""
        while not self._stop.is_set():
            try:
                for row in self.records.unfinished():
                    self.advance(row)
                self.purge_expired()
            except Exception:  # a database outage: try again next round
                log.exception("batch round failed")
            self._wake.wait(self.settings.poll_interval_s)
            self._wake.clear()

    def purge_expired(self) -> int:
        """Delete the files past their ``expires_at`` (rows, then content; one index seek when
        there are none, so every replica runs it every round); how many."""
        purged = 0
        for row in self.records.expired_files():
            if self.records.delete_file(None, row.id):
                self.storage.delete(row.id)
                purged += 1
        if purged:
            log.info("retention: purged %d expired files", purged)
        return purged

    def wake(self) -> None:
        """Look at the batches now rather than at the next round."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def advance(self, row: ApiBatch) -> None:
        """One step for batch ``row``: start validating it or writing its files (in the
        pool), or see whether it ended (a validating one too: past its window it expires)."""
        status = BatchStatus(row.batch.status)
        if status is BatchStatus.VALIDATING:
            if not self._expired(row.id):
                self._start(row.id, Phase.VALIDATE)
        elif ((status is BatchStatus.IN_PROGRESS and self._ended(row.id))
              or (status.ended and status is not BatchStatus.FAILED and row.files_at is None)):
            self._start(row.id, Phase.FINALIZE)

    def _expired(self, batch_id: str) -> bool:
        """The batch's expiry (the control plane's too); True if it expired now."""
        expired = self.batches.expire_batches(time.time(), batch_ids=[batch_id])
        for jobs in expired.values():
            announce_ended(self.client.redis, self.client.keys, JobStatus.EXPIRED, jobs)
        return bool(expired)

    def _ended(self, batch_id: str) -> bool:
        """The batch's expiry and completion check (the control plane's too); True once it
        ended."""
        # settle time 0: an HTTP batch's rows were all stored before it started
        return self._expired(batch_id) or bool(
            self.batches.complete_batches(time.time(), 0.0, batch_ids=[batch_id]))

    def _start(self, batch_id: str, phase: Phase) -> None:
        with self._lock:
            if batch_id in self._busy:
                return
            self._busy.add(batch_id)
        self._pool.submit(self._leased, batch_id, phase)

    def lease(self, batch_id: str) -> Lease:
        """The lease of batch ``batch_id`` (not taken yet)."""
        return Lease(self.client.redis, self.client.keys.batch_lease(batch_id),
                     self.settings.lease_s)

    def _leased(self, batch_id: str, phase: Phase) -> None:
        """``phase`` of ``batch_id`` under its lease (nothing if another holds it): one more
        try, counted before the work; past :attr:`ApiSettings.max_attempts` tries the batch
        ends without it (:meth:`_give_up`)."""
        lease = self.lease(batch_id)
        try:
            if lease.acquire():
                try:
                    row = self.records.get(ApiBatch, None, batch_id)
                    if row is not None and lease.token is not None and self.batches.fence(
                            batch_id, lease.token):
                        self._attempt(row, phase, lease)
                finally:
                    lease.release()
        except LeaseLost:
            log.warning("batch %s: the lease went to another process", batch_id)
        except Exception:  # the batch is taken up again next round
            log.exception("batch %s: %s failed", batch_id, phase)
        finally:
            with self._lock:
                self._busy.discard(batch_id)

    def _attempt(self, row: ApiBatch, phase: Phase, lease: Lease) -> None:
        tries = self.records.begin_attempt(row.id, phase)
        if tries > self.settings.max_attempts:
            self._give_up(row, phase, tries - 1, lease)
            return
        work = self._validate if phase is Phase.VALIDATE else self._finalize
        try:
            work(row, lease)
        except LeaseLost:
            raise
        except Exception as exc:
            self.records.note_error(row.id, f"{type(exc).__name__}: {exc}")
            raise

    def _give_up(self, row: ApiBatch, phase: Phase, tries: int, lease: Lease) -> None:
        """End batch ``row`` after ``tries`` failed tries at ``phase``: a validating batch
        fails, an ended one is recorded without its files; the reason is in its errors."""
        why = row.last_error or "the process doing it stopped"
        assert lease.token is not None
        if phase is Phase.VALIDATE:
            self._fail(row.id, [LineError("validation_failed", f"the input file could not be "
                                          f"validated in {tries} tries: {why}")], lease)
            return
        for kind in FILE_KINDS:  # a file a try wrote but could not record
            self.storage.delete(_file_id(row, kind))
        self.records.set_errors(row.id, {"object": "list", "data": [LineError(
            "output_failed", f"the output files could not be written in {tries} tries: "
                             f"{why}").entry()]})
        if self.records.record_files(row.id, [], lease.token, self.settings.file_retention_s):
            log.warning("batch %s %s without its files: %s", row.id, row.batch.status, why)

    def _going(self, batch_id: str, lease: Lease) -> bool:
        """Whether a validating batch goes on being stored: the lease is still this
        process's, and nobody cancelled the batch."""
        row = self.records.get(ApiBatch, None, batch_id)
        return (lease.renew() and row is not None and row.batch.cancel_requested_at is None
                and row.batch.status == BatchStatus.VALIDATING)

    # -- validating ------------------------------------------------------------------------

    def _validate(self, row: ApiBatch, lease: Lease) -> None:
        if row.batch.status != BatchStatus.VALIDATING:
            return
        known = {cid for _, cid, _ in self.client.batch_jobs(row.id)}
        model: str | None = None
        try:
            # known rows: an earlier pass checked the file and began storing them
            errors = [] if known or row.batch.cancel_requested_at else self._check(row, lease)
            if errors == [] and row.batch.cancel_requested_at is None:
                model = self._submit(row, known, lease)
        except FileNotFoundError:
            errors = [_file_gone()]
        if errors:
            self._fail(row.id, errors, lease)
            return
        if model is None:  # cancelled, or the lease was lost
            if not lease.renew():
                return
            self.client.cancel_batch(row.id)  # the rows stored before the cancel
        assert lease.token is not None
        if self.batches.start(row.id, model or "", lease.token):
            log.info("batch %s on %s in progress", row.id, model)

    def _fail(self, batch_id: str, errors: list[LineError], lease: Lease) -> None:
        self.records.set_errors(batch_id, {"object": "list", "data": [e.entry() for e in errors]})
        assert lease.token is not None
        if self.batches.fail(batch_id, lease.token):
            self.client.cancel_batch(batch_id)  # rows an earlier pass stored, if any
            log.info("batch %s failed validation (%d errors)", batch_id, len(errors))

    def _submit(self, row: ApiBatch, known: set[str | None], lease: Lease) -> str | None:
        """The second pass: store the rows not in ``known`` as jobs; their model, or None
        when it stopped (cancelled, or the lease lost)."""
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
                    self.client.store(chunk, deadline=row.batch.deadline_at, fence=lease.token)
                    chunk = []
                if not self._going(row.id, lease):
                    return None
        if chunk:
            self.client.store(chunk, deadline=row.batch.deadline_at, fence=lease.token)
        self.client.bulk_loaded(total)
        return model if self._going(row.id, lease) else None

    def _check(self, row: ApiBatch, lease: Lease) -> list[LineError] | None:
        """The first pass: every line's errors (up to :data:`MAX_ERRORS`); None if it stopped
        (cancelled, or the lease lost)."""
        errors: list[LineError] = []
        seen: set[str] = set()
        total, model = 0, None
        for line_no, spec in self._specs(row, set(self.served_models())):
            if isinstance(spec, LineError):
                errors.append(spec)
            elif spec.custom_id in seen:
                errors.append(LineError("duplicate_custom_id", f"custom_id {quote(spec.custom_id)} "
                                        "appears on an earlier line", "custom_id", line_no))
            elif model is not None and spec.model != model:
                errors.append(LineError("mismatched_model", "every request of a batch names "
                                        f"the same model: {quote(model)} before, "
                                        f"{quote(spec.model)} here", "body.model", line_no))
            else:
                seen.add(str(spec.custom_id))
                model = spec.model
            total += 1
            if total % CHUNK_ROWS == 0 and not self._going(row.id, lease):
                return None
            if total > self.settings.max_requests_per_batch:
                errors.append(LineError("too_many_requests", "a batch holds at most "
                                        f"{self.settings.max_requests_per_batch} requests",
                                        None, line_no))
            if len(errors) >= MAX_ERRORS:
                break
        if total == 0 and not errors:
            errors.append(LineError("empty_file", "the input file holds no requests"))
        if not errors:
            try:
                with self.records.session() as session:
                    self.quotas.check_rows(session, row.owner_id, total)
            except ApiError as exc:
                errors.append(LineError("quota_exceeded", exc.message))
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
                    except Exception as exc:  # whatever a line makes raise is its own error
                        yield line_no, LineError("invalid_request", "the request cannot be "
                                                 f"read ({type(exc).__name__})", None, line_no)

    def _spec(self, raw: bytes, row: ApiBatch, models: set[str] | None) -> JobSpec:
        try:
            obj = json.loads(raw)
        except RecursionError:
            raise LineError("invalid_json_line", "the line is nested too deeply") from None
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
            raise LineError("model_not_found", f"model {quote(model)} is not served here (GET "
                                               "/v1/models lists those that are)", "body.model")
        try:
            spec = row_spec(parse_row(obj, 0), model=model, batch_id=row.id, system_prompt=None,
                            defaults={}, priority=0, deadline=row.batch.deadline_at)
            self.client.check(spec)
        except ValidationError as exc:
            raise LineError("invalid_request", validation_message(exc.errors(), "row")) from None
        except ValueError as exc:
            raise LineError("invalid_request", str(exc)) from None
        return spec

    # -- its files ------------------------------------------------------------------------

    def _finalize(self, row: ApiBatch, lease: Lease) -> None:
        if not BatchStatus(row.batch.status).ended or row.files_at is not None:
            return
        files = []
        for kind in FILE_KINDS:
            file = self._write_output(row, kind, lease)
            if file is None:
                return  # the lease went to another process
            if file.bytes:
                files.append(file)
        assert lease.token is not None
        if self.records.record_files(row.id, files, lease.token,
                                     self.settings.file_retention_s):
            log.info("batch %s %s", row.id, row.batch.status)

    def _write_output(self, batch: ApiBatch, kind: str, lease: Lease) -> File | None:
        """Write the output (or error) file of ``batch`` from the jobs table into storage
        (``jobs.export``); None if the lease was lost meanwhile."""
        file_id = _file_id(batch, kind)
        upload = self.storage.begin(file_id)
        line_kind = RowKind(batch.endpoint)
        try:
            size = export_batch(
                self.client.reader, batch.id, upload.write,
                lambda info: json.dumps(output_line(line_kind, info), ensure_ascii=False),
                succeeded=kind == "output", going=lease.renew)
        except BaseException:
            upload.discard()
            raise
        if not size:
            upload.discard()
            if size is None:
                return None
        else:
            upload.commit()
        return File(id=file_id, owner_id=batch.owner_id, purpose="batch_output",
                    filename=f"{batch.id}_{kind}.jsonl", bytes=size, batch_id=batch.id,
                    kind=kind)


def _file_id(batch: ApiBatch, kind: str) -> str:
    return f"file-{batch.id.removeprefix('batch_')}-{kind}"


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
