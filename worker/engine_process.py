"""The engine in a process of its own, as vLLM v1 runs its engine core.

``kvbatch worker`` runs the engine here by default: the worker process keeps the loop (Redis,
SQL, metrics) and this child process only steps the model. In one process the loop's Python
takes the interpreter lock from the engine thread between its kernels, and on a CPU worker
that stalls the kernels' whole thread team: measured on 2 cores, the engine's steps ran
10-20% slower beside the loop than alone (``bench/queue_path.py``; ``docs/queue.md``). A child
process also fails alone: a segfault or an out-of-memory kill becomes a
:class:`~worker.engine_thread.Crashed` event, and the worker hands its jobs back and exits as
for any engine crash.

The two sides talk over a socket pair in length-prefixed JSON messages (never pickle): the
child reads commands between steps, and the parent has one thread writing commands and one
reading events, so the loop never blocks on the child.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from typing import TYPE_CHECKING

import msgspec

from engine.config import EngineConfig
from engine.ipc import Frames, die_with_parent, pack, spawn
from worker.engine_thread import IDLE_WAIT_S, serve
from worker.messages import (
    CODEC,
    Command,
    Crashed,
    Event,
    Ready,
    Rejected,
    Start,
    StartFailed,
    Stop,
    job_id_of,
)
from worker.settings import LOG_FORMAT

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

EXIT_WAIT_S = 10.0


# -- the wire ------------------------------------------------------------------------------------

def frame(message: msgspec.Struct) -> bytes:
    """One message as sent: its length, then its msgpack (:func:`engine.ipc.pack`)."""
    return pack(CODEC.encode(message))


class EngineStartError(RuntimeError):
    """The engine process could not build its engine (the message says why)."""


class EngineProcess:
    """An :class:`~worker.engine_thread.EngineRunner` whose engine runs in a child process.

    Building one starts the child and waits until its engine is loaded (raising
    :class:`EngineStartError` if it cannot be); :meth:`start` then connects the queues.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self.process, self._sock = spawn("worker.engine_process")
        self._sock.sendall(frame(Start(config)))
        self._frames = Frames(self._sock)
        hello = self._frames.read(None)
        reply = CODEC.reply(hello[0]) if hello else None
        if not isinstance(reply, Ready):
            error = (reply.error if isinstance(reply, StartFailed)
                     else f"exited with code {self.process.wait()}")
            self._sock.close()
            try:
                self.process.wait(EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            raise EngineStartError(f"the engine process could not start: {error}")
        self._has_chat_template = reply.has_chat_template
        self._host_cpus = reply.host_cpus
        self._reader = threading.Thread(target=self._read, name="engine-events", daemon=True)
        self._writer = threading.Thread(target=self._write, name="engine-commands",
                                        daemon=True)
        log.info("engine process %d ready", self.process.pid)

    @property
    def has_chat_template(self) -> bool:
        return self._has_chat_template

    @property
    def host_cpus(self) -> int:
        return self._host_cpus

    def start(self) -> None:
        self._reader.start()
        self._writer.start()

    def stop(self, timeout_s: float = EXIT_WAIT_S) -> None:
        """Ask the child to exit (killed if it has not after ``timeout_s``)."""
        self._stopping.set()
        if self._writer.is_alive():
            self.commands.put(Stop())  # sent after the commands before it
        else:
            self._send(Stop())
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("engine process %d did not exit; killing it", self.process.pid)
            self.process.kill()
            self.process.wait()
        if self._reader.is_alive():
            self._reader.join(EXIT_WAIT_S)  # it ends at the socket's end of file
        self._sock.close()

    def _send(self, message: msgspec.Struct) -> bool:
        try:
            self._sock.sendall(frame(message))
            return True
        except OSError:
            return False

    def _write(self) -> None:
        while self._send(cmd := self.commands.get()) and not isinstance(cmd, Stop):
            pass

    def _read(self) -> None:
        try:
            while (messages := self._frames.read(None)) is not None:
                for payload in messages:
                    event = CODEC.event(payload)
                    self.events.put(event)
                    if isinstance(event, Crashed):
                        return
        except OSError:
            pass  # the socket closed under us: the process is gone or being stopped
        except Exception:  # a message this side cannot read: a bug, handled as a crash
            log.exception("unreadable message from the engine process")
            self.events.put(Crashed("unreadable message from the engine process"))
            return
        if not self._stopping.is_set():
            code = self.process.wait()
            self.events.put(Crashed(f"the engine process exited with code {code}"))


# -- the child's side ----------------------------------------------------------------------------

def child_main(fd: int, parent_pid: int) -> int:
    """The engine process: build the engine from the parent's config, then :func:`serve` it
    until the parent says stop or goes away."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    die_with_parent(parent_pid)
    # Signals are the parent's business: it drains, then tells this process to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.set_inheritable(fd, False)  # a process the engine starts must not keep it open
    sock = socket.socket(fileno=fd)
    frames = Frames(sock)
    first = frames.read(None)
    if not first:
        return 2
    start = CODEC.start(first[0])
    try:
        engine = _build(start.config)
    except Exception as exc:
        log.exception("the engine could not be built")
        sock.sendall(frame(StartFailed(f"{type(exc).__name__}: {exc}")))
        return 1
    sock.sendall(frame(Ready(engine.has_chat_template, engine.shared_host_cpus)))
    stop, crashed = threading.Event(), threading.Event()

    def emit(event: Event) -> None:
        if isinstance(event, Crashed):
            crashed.set()
        try:
            sock.sendall(frame(event))
        except OSError:  # the parent is gone
            stop.set()

    def take(block: bool) -> list[Command]:
        messages = frames.read(IDLE_WAIT_S if block else 0.0)
        if messages is None:  # the parent is gone
            stop.set()
            return []
        commands: list[Command] = []
        for payload in messages:
            try:
                commands.append(CODEC.command(payload))
            except msgspec.ValidationError as exc:  # checked at submission: a version mismatch
                emit(Rejected(job_id_of(payload), f"ValidationError: {exc}"))
        return commands

    serve(engine, take, emit, stop.is_set)
    return 1 if crashed.is_set() else 0


def _build(config: EngineConfig) -> LLMEngine:
    from engine.llm_engine import LLMEngine

    return LLMEngine(config)


if __name__ == "__main__":
    raise SystemExit(child_main(int(sys.argv[1]), int(sys.argv[2])))
