"""The one export of a batch: its jobs in id order, one at a time, as lines into a sink. The
control plane's results file (every job as ``JobInfo`` JSON) and the HTTP API's output and
error files (OpenAI's lines) are both made by :func:`export_batch`.

Memory holds one fetch of :data:`FETCH_ROWS` rows (``JobReader.batch_rows``: a server-side
cursor on PostgreSQL) and one line, whatever the batch's size: a batch of large results (``n``
samples of thousands of tokens with logprobs) is written without ever being held whole."""

from __future__ import annotations

import time
from collections.abc import Callable

from jobs.schemas import JobInfo
from jobs.store import JobReader

FETCH_ROWS = 16  # jobs per fetch from the database: at most this many results in memory
CHECK_EVERY_S = 1.0  # how often ``going`` is asked while writing


def export_batch(reader: JobReader, batch_id: str, write: Callable[[bytes], object],
                 line: Callable[[JobInfo], str], *, succeeded: bool | None = None,
                 going: Callable[[], bool] = lambda: True) -> int | None:
    """Write ``line(job)`` + newline, UTF-8, for each job of ``batch_id`` (every job, or with
    ``succeeded`` those that did or did not succeed: ``JobReader.batch_rows``) to ``write``,
    one job at a time. ``going`` is asked every :data:`CHECK_EVERY_S` seconds and at the end:
    False stops the export (a lease that was lost). Returns the bytes written, or None when
    stopped."""
    size, checked = 0, time.monotonic()
    for info in reader.batch_rows(batch_id, succeeded=succeeded, fetch_rows=FETCH_ROWS):
        data = (line(info) + "\n").encode()
        write(data)
        size += len(data)
        if time.monotonic() - checked >= CHECK_EVERY_S:
            if not going():
                return None
            checked = time.monotonic()
    return size if going() else None
