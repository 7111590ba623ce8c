"""Where uploaded files live, behind one small interface.

:class:`DirectoryStorage` keeps each upload as one file in a directory: a PostgreSQL-less
embedded setup (SQLite) works as is, the bytes stream to disk as they arrive (no upload is ever
held in memory, and the database holds no blobs to bloat its backups and vacuum), and several
API replicas share it as a mounted volume. An S3-compatible store fits the same four methods.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

CHUNK_BYTES = 1 << 16
_SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
STALE_PARTIAL_S = 86400  # an upload unfinished this long was cut off by a crash


class Upload(Protocol):
    """A file being written: ``write`` chunks, then ``commit`` (or ``discard``)."""

    def write(self, data: bytes) -> None: ...

    def commit(self) -> int: ...

    def discard(self) -> None: ...


class FileStorage(Protocol):
    """Content of uploaded files by file id."""

    def begin(self, file_id: str) -> Upload: ...

    def open(self, file_id: str) -> BinaryIO: ...

    def delete(self, file_id: str) -> None: ...


class _DirectoryUpload:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.partial = path.with_name(f".{path.name}.partial")
        self._f = self.partial.open("wb")
        self.bytes = 0

    def write(self, data: bytes) -> None:
        self._f.write(data)
        self.bytes += len(data)

    def commit(self) -> int:
        """Make the file visible under its id (atomically: a crash leaves no half file)."""
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self.partial.replace(self.path)
        return self.bytes

    def discard(self) -> None:
        self._f.close()
        self.partial.unlink(missing_ok=True)


class DirectoryStorage:
    """Each file is ``<root>/<file id>``; partial uploads are hidden ``.<id>.partial`` files
    (those left a day old by a crash are removed when a server starts)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        stale = time.time() - STALE_PARTIAL_S
        for partial in root.glob(".*.partial"):
            with contextlib.suppress(OSError):  # another replica may remove it first
                if partial.stat().st_mtime < stale:
                    partial.unlink()

    def _path(self, file_id: str) -> Path:
        if not _SAFE_ID.fullmatch(file_id):
            raise ValueError(f"not a file id: {file_id!r}")
        return self.root / file_id

    def begin(self, file_id: str) -> _DirectoryUpload:
        return _DirectoryUpload(self._path(file_id))

    def open(self, file_id: str) -> BinaryIO:
        """The content (``FileNotFoundError`` if gone)."""
        return self._path(file_id).open("rb")

    def delete(self, file_id: str) -> None:
        self._path(file_id).unlink(missing_ok=True)


def read_chunks(f: BinaryIO) -> Iterator[bytes]:
    """``f`` in chunks, closed at the end."""
    with f:
        while chunk := f.read(CHUNK_BYTES):
            yield chunk
