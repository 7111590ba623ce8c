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

import json
import logging
import os
import queue
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from worker.engine_thread import (
    IDLE_WAIT_S,
    Abort,
    Add,
    Command,
    Crashed,
    Event,
    Rejected,
    Stepped,
    serve,
)
from worker.settings import LOG_FORMAT

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("!I")
READ_CHUNK = 1 << 20
EXIT_WAIT_S = 10.0


# -- the wire ------------------------------------------------------------------------------------

def frame(message: dict[str, Any]) -> bytes:
    """One message as sent: its length (4 bytes, big-endian), then its JSON."""
    payload = json.dumps(message, separators=(",", ":")).encode()
    return _LENGTH.pack(len(payload)) + payload


class Frames:
    """Messages read from a socket: :meth:`read` returns the complete ones that arrived."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = bytearray()
        self._ready = selectors.DefaultSelector()  # not select(): fds past 1024 are fine
        self._ready.register(sock, selectors.EVENT_READ)

    def read(self, timeout_s: float | None) -> list[dict[str, Any]] | None:
        """Wait up to ``timeout_s`` (None: until a message) for messages; None once the other
        side has closed."""
        while True:
            if self._ready.select(timeout_s):
                try:
                    chunk = self.sock.recv(READ_CHUNK)
                except ConnectionResetError:  # closed with our messages unread
                    return None
                if not chunk:
                    return None
                self._buffer += chunk
            messages = self._split()
            if messages or timeout_s is not None:
                return messages

    def _split(self) -> list[dict[str, Any]]:
        messages, at = [], 0
        buf = self._buffer
        while len(buf) - at >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(buf, at)
            if len(buf) - at - _LENGTH.size < size:
                break
            start = at + _LENGTH.size
            messages.append(json.loads(bytes(buf[start:start + size])))
            at = start + size
        del buf[:at]
        return messages


def encode_command(cmd: Command) -> dict[str, Any]:
    if isinstance(cmd, Add):
        return {"t": "add", "id": cmd.job_id, "prompt": cmd.prompt,
                "params": asdict(cmd.params), "priority": cmd.priority}
    return {"t": "abort", "id": cmd.job_id}


def decode_command(msg: dict[str, Any]) -> Command:
    if msg["t"] == "add":
        return Add(msg["id"], msg["prompt"], SamplingParams(**msg["params"]), msg["priority"])
    return Abort(msg["id"])


def encode_event(event: Event, token_bytes: Any) -> dict[str, Any]:
    """``event`` as a message; ``token_bytes`` (the engine's) gives the bytes of every token
    in the finished outputs' logprobs, which the worker stores beside them."""
    if isinstance(event, Rejected):
        return {"t": "rejected", "id": event.job_id, "error": event.error}
    if isinstance(event, Crashed):
        return {"t": "crashed", "error": event.error}
    finished, tokens = [], set()
    for out in event.finished:
        d = asdict(out)
        for c in d["outputs"]:
            if c["logprobs"] is not None:  # {id: logprob} keeps its order as pairs
                c["logprobs"] = [list(step.items()) for step in c["logprobs"]]
                tokens.update(t for step in c["logprobs"] for t, _ in step)
        finished.append(d)
    return {"t": "step", "time": event.time_s, "progress": event.progress,
            "finished": finished, "stats": asdict(event.stats),
            "bytes": {str(t): token_bytes(t).hex() for t in tokens}}


def decode_event(msg: dict[str, Any], token_bytes: dict[int, bytes]) -> Event:
    """The event of a message; the token bytes it carries go into ``token_bytes``."""
    if msg["t"] == "rejected":
        return Rejected(msg["id"], msg["error"])
    if msg["t"] == "crashed":
        return Crashed(msg["error"])
    token_bytes.update((int(t), bytes.fromhex(b)) for t, b in msg["bytes"].items())
    finished = []
    for d in msg["finished"]:
        outputs = [CompletionOutput(**{**c, "logprobs": None if c["logprobs"] is None else
                                       [dict(step) for step in c["logprobs"]]})
                   for c in d["outputs"]]
        finished.append(RequestOutput(**{**d, "outputs": outputs,
                                         "metrics": RequestMetrics(**d["metrics"])}))
    return Stepped(msg["time"], msg["progress"], finished, EngineStats(**msg["stats"]))


# -- the parent's side ---------------------------------------------------------------------------

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
        self._token_bytes: dict[int, bytes] = {}
        self._stopping = threading.Event()
        self._sock, child = socket.socketpair()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        with child:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "worker.engine_process", str(child.fileno())],
                pass_fds=(child.fileno(),), env=env)
        self._sock.sendall(frame({"t": "config", "config": asdict(config)}))
        self._frames = Frames(self._sock)
        hello = self._frames.read(None)
        if not hello or hello[0]["t"] != "ready":
            error = hello[0]["error"] if hello else f"exited with code {self.process.wait()}"
            self._sock.close()
            try:
                self.process.wait(EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            raise EngineStartError(f"the engine process could not start: {error}")
        self._has_chat_template: bool = hello[0]["has_chat_template"]
        self._reader = threading.Thread(target=self._read, name="engine-events", daemon=True)
        self._writer = threading.Thread(target=self._write, name="engine-commands",
                                        daemon=True)
        log.info("engine process %d ready", self.process.pid)

    @property
    def has_chat_template(self) -> bool:
        return self._has_chat_template

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of a token that came in a finished output's logprobs."""
        return self._token_bytes[token_id]

    def start(self) -> None:
        self._reader.start()
        self._writer.start()

    def stop(self, timeout_s: float = EXIT_WAIT_S) -> None:
        """Ask the child to exit (killed if it has not after ``timeout_s``)."""
        self._stopping.set()
        self.commands.put(None)  # type: ignore[arg-type]  # wakes the writer, which says stop
        if not self._writer.is_alive():
            self._send({"t": "stop"})
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("engine process %d did not exit; killing it", self.process.pid)
            self.process.kill()
            self.process.wait()
        if self._reader.is_alive():
            self._reader.join(EXIT_WAIT_S)  # it ends at the socket's end of file
        self._sock.close()

    def _send(self, message: dict[str, Any]) -> bool:
        try:
            self._sock.sendall(frame(message))
            return True
        except OSError:
            return False

    def _write(self) -> None:
        while (cmd := self.commands.get()) is not None and self._send(encode_command(cmd)):
            pass
        self._send({"t": "stop"})

    def _read(self) -> None:
        try:
            while (messages := self._frames.read(None)) is not None:
                for msg in messages:
                    event = decode_event(msg, self._token_bytes)
                    self.events.put(event)
                    if isinstance(event, Crashed):
                        return
        except (OSError, ValueError):
            pass  # the socket closed under us: the process is gone or being stopped
        except Exception:  # a message this side cannot read: a bug, handled as a crash
            log.exception("unreadable message from the engine process")
            self.events.put(Crashed("unreadable message from the engine process"))
            return
        if not self._stopping.is_set():
            code = self.process.wait()
            self.events.put(Crashed(f"the engine process exited with code {code}"))


# -- the child's side ----------------------------------------------------------------------------

def child_main(fd: int) -> int:
    """The engine process: build the engine from the parent's config, then :func:`serve` it
    until the parent says stop or goes away."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    # Signals are the parent's business: it drains, then tells this process to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.set_inheritable(fd, False)  # a process the engine starts must not keep it open
    sock = socket.socket(fileno=fd)
    frames = Frames(sock)
    first = frames.read(None)
    if not first or first[0]["t"] != "config":
        return 2
    try:
        engine = _build(EngineConfig(**first[0]["config"]))
    except Exception as exc:
        log.exception("the engine could not be built")
        sock.sendall(frame({"t": "failed", "error": f"{type(exc).__name__}: {exc}"}))
        return 1
    sock.sendall(frame({"t": "ready", "has_chat_template": engine.has_chat_template}))
    stop, crashed = threading.Event(), threading.Event()

    def emit(event: Event) -> None:
        if isinstance(event, Crashed):
            crashed.set()
        try:
            sock.sendall(frame(encode_event(event, engine.token_bytes)))
        except OSError:  # the parent is gone
            stop.set()

    def take(block: bool) -> list[Command]:
        messages = frames.read(IDLE_WAIT_S if block else 0.0)
        if messages is None:  # the parent is gone
            stop.set()
            return []
        commands = []
        for m in messages:
            if m["t"] == "stop":
                stop.set()
                continue
            try:
                commands.append(decode_command(m))
            except Exception as exc:  # checked at submission; a mismatch fails that job alone
                emit(Rejected(m.get("id", ""), f"{type(exc).__name__}: {exc}"))
        return commands

    serve(engine, take, emit, stop.is_set)
    return 1 if crashed.is_set() else 0


def _build(config: EngineConfig) -> LLMEngine:
    from engine.llm_engine import LLMEngine

    return LLMEngine(config)


if __name__ == "__main__":
    raise SystemExit(child_main(int(sys.argv[1])))
