"""The messages between the worker loop and its engine, declared once (as vLLM v1 declares
``EngineCoreRequest``/``EngineCoreOutputs``).

Both transports carry these objects: :class:`~worker.engine_thread.EngineThread` passes them
through in-process queues, :class:`~worker.engine_process.EngineProcess` sends the same ones
over its socket, encoded by :data:`CODEC` (msgpack through msgspec: typed on both ends, never
pickle). Each struct's ``tag`` names its kind on the wire; decoding checks every field's type
and runs the engine dataclasses' ``__post_init__`` checks (``SamplingParams``,
``EngineConfig``), so a message is either whole and valid or refused.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from engine.config import EngineConfig
from engine.outputs import EngineStats, RequestOutput
from engine.pooling_params import PoolingParams
from engine.prompts import TextOrChat
from engine.sampling_params import SamplingParams

# -- to the engine -------------------------------------------------------------------------------


class Start(msgspec.Struct, frozen=True, tag="start"):
    """The engine process's first message: what engine to build."""

    config: EngineConfig


class Add(msgspec.Struct, frozen=True, tag="add"):
    job_id: str
    prompt: TextOrChat
    params: SamplingParams
    priority: int = 0
    lora: str | None = None  # the LoRA adapter it runs with (None: the base model)


class Embed(msgspec.Struct, frozen=True, tag="embed"):
    """An embedding job: its texts, each one engine request (``worker.embed_jobs``)."""

    job_id: str
    inputs: list[str]
    params: PoolingParams
    priority: int = 0


class Abort(msgspec.Struct, frozen=True, tag="abort"):
    job_id: str


class Stop(msgspec.Struct, frozen=True, tag="stop"):
    """Stop serving (after the commands before it)."""


class Threads(msgspec.Struct, frozen=True, tag="threads"):
    """Run the engine's CPU work on ``count`` threads from its next step (the worker's share
    of a host's cores, ``worker.cpu_share``)."""

    count: Annotated[int, msgspec.Meta(ge=1)]


Command = Add | Embed | Abort | Stop | Threads

# -- from the engine -----------------------------------------------------------------------------


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    """The engine process built its engine."""

    has_chat_template: bool
    host_cpus: int = 0  # the engine's shared_host_cpus: 0 where its threads are not to be split


class StartFailed(msgspec.Struct, frozen=True, tag="start_failed"):
    error: str


class Stepped(msgspec.Struct, frozen=True, tag="stepped"):
    """One step: how far each unfinished request got, the finished ones whole, and the engine
    stats right after it."""

    time_s: float  # time.monotonic() when the step returned
    progress: dict[str, int]  # unfinished request -> tokens of its longest sample so far
    finished: list[RequestOutput]
    stats: EngineStats
    # The bytes of every token in the finished outputs' logprobs (stored beside them).
    token_bytes: dict[int, bytes] = {}


class Rejected(msgspec.Struct, frozen=True, tag="rejected"):
    """The engine refused a request (bad input): that job fails alone."""

    job_id: str
    error: str


class Crashed(msgspec.Struct, frozen=True, tag="crashed"):
    """The engine is gone; the worker hands its jobs back."""

    error: str


Event = Stepped | Rejected | Crashed


class _Codec:
    """One encoder for every message; a typed decoder for each message a side expects."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._start = msgspec.msgpack.Decoder(Start)
        self._command = msgspec.msgpack.Decoder(Command)
        self._reply = msgspec.msgpack.Decoder(Ready | StartFailed)
        self._event = msgspec.msgpack.Decoder(Event)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    # Each raises msgspec.ValidationError naming the field that is wrong.
    def start(self, payload: bytes) -> Start:
        return self._start.decode(payload)

    def command(self, payload: bytes) -> Command:
        return self._command.decode(payload)

    def reply(self, payload: bytes) -> Ready | StartFailed:
        return self._reply.decode(payload)

    def event(self, payload: bytes) -> Event:
        return self._event.decode(payload)


CODEC = _Codec()


def job_id_of(payload: bytes) -> str:
    """The ``job_id`` of a message that did not decode as a whole ('' if it has none)."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return ""
    job_id = raw.get("job_id") if isinstance(raw, dict) else None
    return job_id if isinstance(job_id, str) else ""
