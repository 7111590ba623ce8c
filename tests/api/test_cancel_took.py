"""Whether a cancel took (``jobs.api.objects.cancel_took``), read right after it was asked: a
batch that ended cancelled took it, files recorded or not (random-order run 9404: the runner
ended a batch of queued rows between the cancel and the read, and the API answered 400); one
that ended any other way had ended before it."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from jobs.api.objects import cancel_took, openai_status
from jobs.models import ApiBatch, Batch
from jobs.schemas import BatchStatus

NOW = datetime(2026, 12, 4, tzinfo=UTC)


def _row(status: BatchStatus, *, cancel_asked: bool, files: bool) -> ApiBatch:
    row = ApiBatch(id="b", owner_id="k", input_file_id="f", endpoint="/v1/chat/completions",
                   completion_window="24h", files_at=NOW if files else None)
    row.batch = Batch(id="b", model="tiny", created_at=NOW, status=status.value,
                      cancel_requested_at=NOW if cancel_asked else None)
    return row


@pytest.mark.parametrize(("status", "files", "openai", "took"), [
    (BatchStatus.CANCELLED, False, "finalizing", True),  # ended by the cancel, files to write
    (BatchStatus.CANCELLED, True, "cancelled", True),
    (BatchStatus.COMPLETED, False, "finalizing", False),  # ended before the cancel
    (BatchStatus.COMPLETED, True, "completed", False),
    (BatchStatus.EXPIRED, True, "expired", False),
    (BatchStatus.FAILED, False, "failed", False),
    (BatchStatus.IN_PROGRESS, False, "cancelling", True),
    (BatchStatus.VALIDATING, False, "cancelling", True),
])
def test_a_cancel_took_when_the_batch_is_cancelling_or_ended_cancelled(
        status: BatchStatus, files: bool, openai: str, took: bool) -> None:
    row = _row(status, cancel_asked=True, files=files)
    assert (openai_status(row), cancel_took(row)) == (openai, took)


def test_an_unended_batch_without_a_cancel_asked_did_not_take_one() -> None:
    row = _row(BatchStatus.IN_PROGRESS, cancel_asked=False, files=False)
    assert (openai_status(row), cancel_took(row)) == ("in_progress", False)
