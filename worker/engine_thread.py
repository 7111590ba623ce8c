"""Driving an engine: the loop that owns it and the runner that keeps it on a thread of the
worker process.

The worker loop sends ``Add``/``Embed``/``Abort``/``Stop`` commands through ``commands`` and
receives ``Stepped``, ``Rejected`` and ``Crashed`` events through ``events`` (the types of
``worker.messages``), so neither side ever waits on the other's I/O. :func:`serve` is the
engine's side: it applies commands between steps and steps back to back while there is work.
It runs either on a thread (:class:`EngineThread`, for an engine object given to the worker:
tests, stand-ins) or in a process of its own (``worker.engine_process.EngineProcess``, what
``kvbatch worker`` runs), behind the same :class:`EngineRunner` face. :class:`Engine` is all
the loop needs of an engine: ``engine.LLMEngine`` is one, and tests wrap it to inject faults.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from worker.embed_jobs import EmbedJobs
from worker.messages import Add, Command, Crashed, Embed, Event, Rejected, Stepped, Stop, Threads

if TYPE_CHECKING:
    from engine.outputs import EngineStats, RequestOutput
    from engine.pooling_params import PoolingParams
    from engine.prompts import TextOrChat
    from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
IDLE_STATS_INTERVAL_S = 1.0


class Engine(Protocol):
    """The streaming core of an engine, as the worker drives it (``engine.LLMEngine``)."""

    def add_request(self, request_id: str, prompt: TextOrChat,
                    params: SamplingParams | PoolingParams, *, priority: int = 0,
                    lora: str | None = None) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    @property
    def has_chat_template(self) -> bool: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> EngineStats: ...


class EngineRunner(Protocol):
    """An engine being driven: commands in, events out (a thread or a process)."""

    commands: queue.SimpleQueue[Command]
    events: queue.SimpleQueue[Event]

    @property
    def has_chat_template(self) -> bool: ...

    @property
    def host_cpus(self) -> int:
        """The host's CPUs where the engine's threads may be split with other workers' on the
        host (``Threads`` commands), else 0."""
        ...

    def start(self) -> None: ...

    def stop(self, timeout_s: float = 10.0) -> None: ...


def stepped(engine: Engine, time_s: float, outputs: list[RequestOutput]) -> Stepped:
    """A step's event from its outputs: the finished ones kept whole with the bytes of the
    tokens in their logprobs, the others counted."""
    progress = {o.request_id: max((len(c.token_ids) for c in o.outputs), default=0)
                for o in outputs if not o.finished}
    finished = [o for o in outputs if o.finished]
    tokens = {t for o in finished for c in o.outputs for step in c.logprobs or () for t in step}
    return Stepped(time_s, progress, finished, engine.stats(),
                   {t: engine.token_bytes(t) for t in tokens})


def serve(engine: Engine, commands: Callable[[bool], Iterable[Command]],
          emit: Callable[[Event], None], stopped: Callable[[], bool]) -> None:
    """Own ``engine`` until a :class:`Stop` command or ``stopped()``: apply the commands
    ``commands(block)`` returns (``block``: nothing to step, so wait a little for some), step
    while there is work, and ``emit`` each step (and, when idle, the stats once a second). An
    exception from the engine ends it with :class:`Crashed`; a request the engine refuses is
    :class:`Rejected` alone. An embedding job's texts are requests of their own, gathered
    into one output (:class:`~worker.embed_jobs.EmbedJobs`)."""
    last_stats = 0.0
    embeds = EmbedJobs()
    try:
        while not stopped():
            for cmd in commands(not engine.has_unfinished_requests()):
                if isinstance(cmd, Stop):
                    return
                if isinstance(cmd, Threads):  # here, on the engine's thread: OpenMP's
                    import torch  # thread count is a setting of the thread that calls it

                    torch.set_num_threads(cmd.count)
                    continue
                if isinstance(cmd, Add | Embed):
                    try:
                        if isinstance(cmd, Embed):
                            embeds.add(engine, cmd)
                        else:
                            engine.add_request(cmd.job_id, cmd.prompt, cmd.params,
                                               priority=cmd.priority, lora=cmd.lora)
                    except Exception as exc:  # bad input fails this job alone
                        emit(Rejected(cmd.job_id, f"{type(exc).__name__}: {exc}"))
                elif not embeds.abort(engine, cmd.job_id):
                    engine.abort_request(cmd.job_id)
            if engine.has_unfinished_requests():
                outputs = embeds.gather(engine, engine.step())
                last_stats = time.monotonic()
                emit(stepped(engine, last_stats, outputs))
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
        self._thread = threading.Thread(
            target=serve, args=(engine, self._take, self.events.put, lambda: False),
            name="engine", daemon=True)

    @property
    def has_chat_template(self) -> bool:
        return self._engine.has_chat_template

    @property
    def host_cpus(self) -> int:
        return int(getattr(self._engine, "shared_host_cpus", 0))  # 0 for stand-in engines

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self.commands.put(Stop())
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
