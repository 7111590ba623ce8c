"""Frames between the worker and its child processes (``engine.ipc``) are bounded: a message
declared longer than the bound closes the connection when its length arrives, instead of
being buffered until memory runs out; the messages before it still arrive."""

from __future__ import annotations

import logging
import socket
import struct
import threading

import pytest

from engine.ipc import MAX_FRAME_BYTES, Frames, pack


def declared(size: int) -> bytes:
    """A message's length prefix alone, as a peer lying about its size sends it."""
    return struct.pack("!I", size)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("timeout_s", [None, 1.0])
def test_a_message_over_the_bound_closes_the_connection(timeout_s: float | None,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(pack(b"first") + declared(MAX_FRAME_BYTES + 1) + b"x" * 1000)
        frames = Frames(b)
        with caplog.at_level(logging.ERROR, logger="engine.ipc"):
            assert frames.read(timeout_s) == [b"first"]
            assert frames.read(timeout_s) is None  # not waiting for the 1 GiB to come
        assert frames.refused and frames.read(0.0) is None
        assert f"{MAX_FRAME_BYTES + 1} bytes is declared, over MAX_FRAME_BYTES" in caplog.text
        a.settimeout(5)
        assert a.recv(16) == b""  # the sender sees the connection closed


@pytest.mark.timeout(10)
def test_the_bound_is_inclusive_and_read_on_the_length_alone() -> None:
    a, b = socket.socketpair()
    with a, b:
        frames = Frames(b, max_frame_bytes=10)
        a.sendall(pack(b"0123456789"))
        assert frames.read(None) == [b"0123456789"]
        a.sendall(declared(11))  # no payload yet: the length suffices to refuse it
        assert frames.read(None) is None and frames.refused


@pytest.mark.timeout(10)
def test_a_message_split_across_reads_under_the_bound_still_arrives() -> None:
    a, b = socket.socketpair()
    payload = bytes(range(256)) * 8192  # 2 MiB: over one READ_CHUNK
    with a, b:
        sender = threading.Thread(target=a.sendall, args=(pack(payload),))
        sender.start()
        got = Frames(b, max_frame_bytes=len(payload)).read(None)
        sender.join()
    assert got == [payload]


def test_a_message_over_the_bound_is_not_sent() -> None:
    class Huge(bytes):
        def __len__(self) -> int:
            return MAX_FRAME_BYTES + 1

    with pytest.raises(ValueError, match=f"{MAX_FRAME_BYTES + 1} bytes is over MAX_FRAME_BYTES"):
        pack(Huge())
