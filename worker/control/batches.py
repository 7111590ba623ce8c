"""What finalizing a settled batch produces besides SQL: its completion event and its results
file. The batch rows' lifecycle itself is ``jobs.store.BatchStore``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from jobs.export import export_batch
from jobs.store import BatchState, JobReader


def event(reader: JobReader, batch: BatchState, results_path: str | None) -> dict[str, Any]:
    """The completion event, as published on Redis and POSTed to the webhook."""
    counts = reader.count_by_status(batch_id=batch.id)
    completed_at = batch.completed_at
    return {
        "type": f"batch.{batch.status.value}",
        "batch_id": batch.id,
        "model": batch.model,
        "status": batch.status.value,
        "num_jobs": batch.num_jobs,
        "counts": {status.value: n for status, n in sorted(counts.items())},
        "completed_at": completed_at.isoformat() if completed_at else None,
        "results_path": results_path,
    }


def export_results(reader: JobReader, batch_id: str, export_dir: str) -> str:
    """Write every job of the batch (as ``JobInfo`` JSON, one per line, by job id;
    ``jobs.export``) to ``<export_dir>/<batch_id>.jsonl``; the file appears complete or not at
    all, and only inside ``export_dir`` (``ValueError`` otherwise; a symlink in the way is an
    ``OSError``)."""
    directory = Path(export_dir)
    directory.mkdir(parents=True, exist_ok=True)
    directory = directory.resolve()
    # The id comes from SQL: whatever it holds, the file stays inside the export directory,
    # and no symlink planted there redirects the write.
    path = (directory / f"{batch_id}.jsonl").resolve()
    if path.parent != directory:
        raise ValueError(f"batch id {batch_id!r} would be exported outside {directory}")
    tmp = path.with_name(path.name + ".tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    with os.fdopen(os.open(tmp, flags, 0o640), "wb") as out:
        export_batch(reader, batch_id, out.write, lambda info: info.model_dump_json())
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    return str(path)
