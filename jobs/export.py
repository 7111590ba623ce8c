"""The one export of a batch: its jobs, a page at a time in id order, as lines into a sink.
The control plane's results file (every job as ``JobInfo`` JSON) and the HTTP API's output and
error files (OpenAI's lines) are both made by :func:`export_batch`; memory holds one page."""

from __future__ import annotations

from collections.abc import Callable

from jobs.schemas import JobInfo
from jobs.store import JobReader

PAGE_ROWS = 500  # jobs per read


def export_batch(reader: JobReader, batch_id: str, write: Callable[[bytes], object],
                 line: Callable[[JobInfo], str], *, succeeded: bool | None = None,
                 page_written: Callable[[], bool] = lambda: True) -> int | None:
    """Write ``line(job)`` + newline, UTF-8, for each job of ``batch_id`` (every job, or with
    ``succeeded`` those that did or did not succeed: ``JobReader.batch_page``) to ``write``.
    ``page_written`` is asked after each page written: False stops the export (a lease that
    was lost). Returns the bytes written, or None when stopped."""
    after, size = "", 0
    while True:
        page = reader.batch_page(batch_id, succeeded=succeeded, after=after, limit=PAGE_ROWS)
        if page:
            data = "".join(line(info) + "\n" for info in page).encode()
            write(data)
            size += len(data)
            if not page_written():
                return None
        if len(page) < PAGE_ROWS:
            return size
        after = page[-1].id
