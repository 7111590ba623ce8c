"""Driving an engine: the loop that owns it, the messages to and from it, and the runner that
keeps it on a thread of the worker process.

The worker loop sends :class:`Add`/:class:`Abort` commands through ``commands`` and receives
:class:`Stepped`, :class:`Rejected` and :class:`Crashed` events through ``events``, so neither
side ever waits on the other's I/O. :func:`serve` is the engine's side: it applies commands
between steps and steps back to back while there is work. It runs either on a thread
(:class:`EngineThread`, for an engine object given to the worker: tests, stand-ins) or in a
process of its own (``worker.engine_process.EngineProcess``, what ``kvbatch worker`` runs), behind
the same :class:`EngineRunner` face. :class:`Engine` is all the loop needs of an engine:
``engine.LLMEngine`` is one, and tests wrap it to inject faults.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterable
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


Command = Add | Abort


@dataclass(frozen=True)
class Stepped:
    """One step: how far each unfinished request got, the finished ones whole, and the engine
    stats right after it."""

    time_s: float  # time.monotonic() when the step returned
    progress: dict[str, int]  # unfinished request -> tokens of its longest sample so far
    finished: list[RequestOutput]
    stats: EngineStats


@dataclass(frozen=True)
class Rejected:
    job_id: str
    error: str


@dataclass(frozen=True)
class Crashed:
    error: str


Event = Stepped | Rejected | Crashed


class EngineRunner(Protocol):
    """An engine being driven: commands in, events out (a thread or a process)."""

    commands: queue.SimpleQueue[Command]
    events: queue.SimpleQueue[Event]

    @property
    def has_chat_template(self) -> bool: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def start(self) -> None: ...

    def stop(self, timeout_s: float = 10.0) -> None: ...


def stepped(time_s: float, outputs: list[RequestOutput], stats: EngineStats) -> Stepped:
    """A step's event from its outputs: the finished ones kept whole, the others counted."""
    progress = {o.request_id: max((len(c.token_ids) for c in o.outputs), default=0)
                for o in outputs if not o.finished}
    return Stepped(time_s, progress, [o for o in outputs if o.finished], stats)


def serve(engine: Engine, commands: Callable[[bool], Iterable[Command]],
          emit: Callable[[Event], None], stopped: Callable[[], bool]) -> None:
    """Own ``engine`` until ``stopped()``: apply the commands ``commands(block)`` returns
    (``block``: nothing to step, so wait a little for some), step while there is work, and
    ``emit`` each step (and, when idle, the stats once a second). An exception from the engine
    ends it with :class:`Crashed`; a request the engine refuses is :class:`Rejected` alone."""
    last_stats = 0.0
    try:
        while not stopped():
            for cmd in commands(not engine.has_unfinished_requests()):
                if isinstance(cmd, Add):
                    try:
                        engine.add_request(cmd.job_id, cmd.prompt, cmd.params,
                                           priority=cmd.priority)
                    except Exception as exc:  # bad input fails this job alone
                        emit(Rejected(cmd.job_id, f"{type(exc).__name__}: {exc}"))
                else:
                    engine.abort_request(cmd.job_id)
            if engine.has_unfinished_requests():
                outputs = engine.step()
                last_stats = time.monotonic()
                emit(stepped(last_stats, outputs, engine.stats()))
            elif time.monotonic() - last_stats > IDLE_STATS_INTERVAL_S:
                last_stats = time.monotonic()
                emit(Stepped(last_stats, {}, [], engine.stats()))
    except Exception:  # a bug in the engine: the worker gives its jobs back and exits
        log.exception("engine crashed")
        emit(Crashed(traceback.format_exc()))


class EngineThread:
    """Runs :func:`serve` on a thread of this process (an :class:`EngineRunner`)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=serve, args=(engine, self._take, self.events.put, self._stop.is_set),
            name="engine", daemon=True)

    @property
    def has_chat_template(self) -> bool:
        return self._engine.has_chat_template

    def token_bytes(self, token_id: int) -> bytes:
        return self._engine.token_bytes(token_id)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _take(self, block: bool) -> list[Command]:
        try:
            taken = [self.commands.get(timeout=IDLE_WAIT_S) if block
                     else self.commands.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                taken.append(self.commands.get_nowait())
            except queue.Empty:
                return taken
