"""The JSON the API answers with, shaped as OpenAI's: file and batch objects, lists, errors."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from jobs.echo import MAX_ECHO_CHARS, clip
from jobs.models import ApiBatch, File
from jobs.schemas import BatchStatus, JobStatus
from jobs.store.transitions import aware


class ApiError(Exception):
    """An error answered as OpenAI's: ``{"error": {message, type, param, code}}``; the message
    is cut to :data:`jobs.echo.MAX_MESSAGE_CHARS`, whatever it quotes."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, kind: str = "invalid_request_error") -> None:
        message = clip(message)
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = (
            status, message, code, param, kind)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def not_found(what: str, object_id: str) -> ApiError:
    """The answer for an object that does not exist or belongs to another key (the two are
    not told apart)."""
    return ApiError(404, f"No such {what}: {clip(object_id, MAX_ECHO_CHARS)}", code=None)


def unix(dt: datetime | None) -> int | None:
    value = aware(dt)
    return None if value is None else int(value.timestamp())


def file_object(row: File) -> dict[str, Any]:
    return {"id": row.id, "object": "file", "bytes": row.bytes, "created_at": unix(row.created_at),
            "filename": row.filename, "purpose": row.purpose, "status": "processed",
            "expires_at": unix(row.expires_at), "status_details": None}


def openai_status(row: ApiBatch) -> str:
    """OpenAI's status of a batch: its own (``BatchStatus``), but ``cancelling`` while a
    cancelled batch has not ended, and ``finalizing`` while an ended one's files are being
    written."""
    status = BatchStatus(row.batch.status)
    if not status.ended:
        return "cancelling" if row.batch.cancel_requested_at is not None else status.value
    if status is not BatchStatus.FAILED and row.files_at is None:
        return "finalizing"
    return status.value


def cancel_took(row: ApiBatch) -> bool:
    """Whether a cancel took, read from ``row`` right after it was asked: the batch is
    cancelling, or it ended cancelled, its files recorded or not (``finalizing``: with no row
    left running, the runner can end it between the cancel and this read). A batch that ended
    any other way had ended before the cancel."""
    status = BatchStatus(row.batch.status)
    return status is BatchStatus.CANCELLED or (
        not status.ended and row.batch.cancel_requested_at is not None)


def _stamps(row: ApiBatch) -> dict[str, datetime | None]:
    """OpenAI's ``<status>_at`` times, from the batch's own and its files'."""
    batch, status = row.batch, BatchStatus(row.batch.status)
    ended = batch.completed_at if status.ended else None
    return {"created": batch.created_at, "in_progress": batch.started_at,
            "expires": batch.deadline_at, "cancelling": batch.cancel_requested_at,
            "failed": ended if status is BatchStatus.FAILED else None,
            "finalizing": None if status is BatchStatus.FAILED else ended,
            **{s.value: row.files_at if status is s else None
               for s in (BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)}}


def request_counts(row: ApiBatch, counts: dict[JobStatus, int]) -> dict[str, int]:
    """``total`` rows of the input (once validated), ``completed`` (succeeded) and ``failed``
    (every other end: failed, expired, cancelled)."""
    done = sum(n for s, n in counts.items() if s.terminal)
    completed = counts.get(JobStatus.SUCCEEDED, 0)
    validated = row.batch.status not in (BatchStatus.VALIDATING, BatchStatus.FAILED)
    return {"total": row.batch.num_jobs if validated else 0, "completed": completed,
            "failed": done - completed}


def batch_object(row: ApiBatch, counts: dict[JobStatus, int]) -> dict[str, Any]:
    return {
        "id": row.id, "object": "batch", "endpoint": row.endpoint,
        "model": row.batch.model or None, "errors": row.errors,
        "input_file_id": row.input_file_id, "completion_window": row.completion_window,
        "status": openai_status(row), "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id,
        **{f"{s}_at": unix(stamp) for s, stamp in _stamps(row).items()},
        "request_counts": request_counts(row, counts), "metadata": row.meta,
    }


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}
