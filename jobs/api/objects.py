"""The JSON the API answers with, shaped as OpenAI's: file and batch objects, lists, errors."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from jobs.models import ApiBatch, File
from jobs.schemas import JobStatus
from jobs.store.transitions import aware

BATCH_STAMPS = ("created", "in_progress", "expires", "finalizing", "completed", "failed",
                "expired", "cancelling", "cancelled")


class ApiError(Exception):
    """An error answered as OpenAI's: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = (
            status, message, code, param, kind)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def not_found(what: str, object_id: str) -> ApiError:
    """The answer for an object that does not exist or belongs to another key (the two are
    not told apart)."""
    return ApiError(404, f"No such {what}: {object_id}", code=None)


def unix(dt: datetime | None) -> int | None:
    value = aware(dt)
    return None if value is None else int(value.timestamp())


def file_object(row: File) -> dict[str, Any]:
    return {"id": row.id, "object": "file", "bytes": row.bytes, "created_at": unix(row.created_at),
            "filename": row.filename, "purpose": row.purpose, "status": "processed",
            "expires_at": None, "status_details": None}


def request_counts(row: ApiBatch, counts: dict[JobStatus, int]) -> dict[str, int]:
    """``total`` rows of the input, ``completed`` (succeeded) and ``failed`` (every other end:
    failed, expired, cancelled)."""
    done = sum(n for s, n in counts.items() if s.terminal)
    completed = counts.get(JobStatus.SUCCEEDED, 0)
    return {"total": row.total, "completed": completed, "failed": done - completed}


def batch_object(row: ApiBatch, counts: dict[JobStatus, int]) -> dict[str, Any]:
    return {
        "id": row.id, "object": "batch", "endpoint": row.endpoint, "model": row.model,
        "errors": row.errors, "input_file_id": row.input_file_id,
        "completion_window": row.completion_window, "status": row.status,
        "output_file_id": row.output_file_id, "error_file_id": row.error_file_id,
        **{f"{s}_at": unix(getattr(row, f"{s}_at")) for s in BATCH_STAMPS},
        "request_counts": request_counts(row, counts), "metadata": row.meta,
    }


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}
