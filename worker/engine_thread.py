"""The engine's own thread: the only code that touches the engine after start.

The worker loop sends :class:`Add`/:class:`Abort` commands through one queue and receives
:class:`Stepped`, :class:`Rejected` and :class:`Crashed` events through another, so neither
side ever waits on the other's I/O. :class:`Engine` is all the worker needs of an engine:
``engine.LLMEngine`` is one, and tests wrap it to inject faults.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.outputs import EngineStats, RequestOutput
    from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
IDLE_STATS_INTERVAL_S = 1.0


Prompt = str | list[dict[str, str]]  # plain text, or chat messages for the chat template


class Engine(Protocol):
    """The streaming core of an engine, as the worker drives it (``engine.LLMEngine``)."""

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, *,
                    priority: int = 0) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    @property
    def has_chat_template(self) -> bool: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> EngineStats: ...


@dataclass(frozen=True)
class Add:
    job_id: str
    prompt: Prompt
    params: SamplingParams
    priority: int


@dataclass(frozen=True)
class Abort:
    job_id: str


@dataclass(frozen=True)
class Stepped:
    """One step's outputs, with the engine stats right after it."""

    time_s: float  # time.monotonic() when the step returned
    outputs: list[RequestOutput]
    stats: EngineStats


@dataclass(frozen=True)
class Rejected:
    job_id: str
    error: str


@dataclass(frozen=True)
class Crashed:
    error: str


Event = Stepped | Rejected | Crashed


class EngineThread:
    """Runs ``engine.step()`` back to back while it has work; idles on the command queue."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.commands: queue.SimpleQueue[Add | Abort] = queue.SimpleQueue()
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        engine = self._engine
        last_stats = 0.0
        try:
            while not self._stop.is_set():
                busy = engine.has_unfinished_requests()
                self._apply_commands(block=not busy)
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    now = time.monotonic()
                    self.events.put(Stepped(now, outputs, engine.stats()))
                    last_stats = now
                elif time.monotonic() - last_stats > IDLE_STATS_INTERVAL_S:
                    last_stats = time.monotonic()
                    self.events.put(Stepped(last_stats, [], engine.stats()))
        except Exception:  # a bug in the engine: the worker gives its jobs back and exits
            log.exception("engine thread crashed")
            self.events.put(Crashed(traceback.format_exc()))

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd = self.commands.get(timeout=IDLE_WAIT_S) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(cmd, Add):
                try:
                    self._engine.add_request(cmd.job_id, cmd.prompt, cmd.params,
                                             priority=cmd.priority)
                except Exception as exc:  # bad input fails this job alone
                    self.events.put(Rejected(cmd.job_id, f"{type(exc).__name__}: {exc}"))
            else:
                self._engine.abort_request(cmd.job_id)
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return
