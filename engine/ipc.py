"""Length-prefixed messages over a socket, for the engine's child processes (the worker's
engine process, the grammar compiler's process). What a message holds is the caller's codec:
msgspec, never pickle."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("!I")
READ_CHUNK = 1 << 20
# A message's most bytes. A longer declared length is a broken or hostile peer: its message is
# refused when its length arrives, not buffered until memory runs out.
MAX_FRAME_BYTES = 1 << 30
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def spawn(module: str) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """Start ``python -m <module> <fd> <this pid>`` holding one end of a socket pair (its
    ``fd``); return the process and this side's end. The child calls
    :func:`die_with_parent` with the pid."""
    ours, theirs = socket.socketpair()
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    with theirs:
        process = subprocess.Popen(
            [sys.executable, "-m", module, str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
    return process, ours


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies (Linux), however it dies: a child busy for
    minutes between two reads of its socket (a long grammar compile) would not notice. The
    signal follows the parent's thread that started the child, so that thread must live as
    long as the child should."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent_pid:  # it died before the line above
        os._exit(1)


def pack(payload: bytes) -> bytes:
    """One message as sent: its length (4 bytes, big-endian), then its payload.

    Raises:
        ValueError: ``payload`` is over :data:`MAX_FRAME_BYTES` (the other side would refuse it).
    """
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"a message of {len(payload)} bytes is over MAX_FRAME_BYTES "
                         f"({MAX_FRAME_BYTES})")
    return _LENGTH.pack(len(payload)) + payload


class Frames:
    """Message payloads read from a socket: :meth:`read` returns the complete ones that
    arrived. A message declared longer than ``max_frame_bytes`` closes the connection (logged
    with its length): the messages before it are returned, then the connection reads as closed
    to both sides."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.sock = sock
        self.max_frame_bytes = max_frame_bytes
        self.refused = False  # a message over the bound came: nothing more is read
        self._buffer = bytearray()
        self._ready = selectors.DefaultSelector()  # not select(): fds past 1024 are fine
        self._ready.register(sock, selectors.EVENT_READ)

    def read(self, timeout_s: float | None) -> list[bytes] | None:
        """Wait up to ``timeout_s`` (None: until a message) for messages; None once the other
        side has closed."""
        while not self.refused:
            if self._ready.select(timeout_s):
                try:
                    chunk = self.sock.recv(READ_CHUNK)
                except ConnectionResetError:  # closed with our messages unread
                    return None
                if not chunk:
                    return None
                self._buffer += chunk
            messages = self._split()
            if messages or (timeout_s is not None and not self.refused):
                return messages
        return None

    def _split(self) -> list[bytes]:
        messages, at = [], 0
        buf = self._buffer
        while len(buf) - at >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(buf, at)
            if size > self.max_frame_bytes:
                self._refuse(size)
                break
            if len(buf) - at - _LENGTH.size < size:
                break
            start = at + _LENGTH.size
            messages.append(bytes(buf[start:start + size]))
            at = start + size
        del buf[:at]
        return messages

    def _refuse(self, size: int) -> None:
        log.error("closing the connection: a message of %d bytes is declared, over "
                  "MAX_FRAME_BYTES (%d)", size, self.max_frame_bytes)
        self.refused = True
        self._buffer.clear()
        with contextlib.suppress(OSError):  # already closed
            self.sock.shutdown(socket.SHUT_RDWR)  # the other side reads it closed too
