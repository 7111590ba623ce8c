"""Response formats compiled beside the step loop, in a process of their own, on a budget.

A response format is a tenant's input, and some compile for minutes and gigabytes (a string
pattern of nested repeats, ``((a{31}){31}){31}``, takes ~0.6 s and 8 MB per property; a 1 MiB
schema holds thousands). Compiled on the engine's loop, one would stop every sequence of the
worker. Here a child process compiles formats one at a time while the engine steps (a
constrained request waits in the scheduler until its grammar is ready, as vLLM's do); a
compile past ``timeout_s``, or that grows the process past ``memory_bytes``, is killed with
its process (started again for the next format) and fails its request alone.

The two sides exchange length-prefixed msgspec JSON over a socket pair (``engine.ipc``); a
compiled grammar travels as xgrammar's own serialization.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import socket
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from engine.ipc import Frames, die_with_parent, pack, spawn
from engine.sampling_params import ResponseFormat

if TYPE_CHECKING:
    import xgrammar as xgr

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often the budget is checked while a compile runs
IDLE_EXIT_S = 60.0  # the process (~300 MB with xgrammar's imports) ends when idle this long
START_TIMEOUT_S = 120.0  # importing xgrammar (and torch) in a fresh process
# xgrammar prefixes its errors with a time and a source location: "[12:00:00] path.cc:81: ".
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """A response format that cannot be compiled: refused by the grammar library (an
    unsupported schema, a bad regex) or over the compile budget."""


@dataclass(frozen=True)
class CompileBudget:
    """What compiling one response format may take: wall time, and memory that the compile
    process grows by over what it held when idle."""

    timeout_s: float
    memory_bytes: int


class _Compiled(msgspec.Struct, frozen=True):
    grammar: str | None = None  # xgrammar's serialize_json
    error: str | None = None


_ENCODER = msgspec.json.Encoder()


class GrammarCompiler:
    """Compiles response formats in a child process, one at a time, each within ``budget``.

    Args:
        tokenizer_info: the model's ``xgr.TokenizerInfo`` (built by the caller, once).
        budget: the time and memory one compile may take.
    """

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, budget: CompileBudget) -> None:
        self._info = tokenizer_info
        self._budget = budget
        self._jobs: queue.SimpleQueue[tuple[ResponseFormat, Future[xgr.CompiledGrammar]] | None]
        self._jobs = queue.SimpleQueue()
        self._child: _Child | None = None
        self._thread = threading.Thread(target=self._run, name="grammar-compiler", daemon=True)
        self._thread.start()

    def submit(self, fmt: ResponseFormat) -> Future[xgr.CompiledGrammar]:
        """Queue ``fmt``; the future fails with :class:`GrammarError` if it cannot compile."""
        future: Future[xgr.CompiledGrammar] = Future()
        self._jobs.put((fmt, future))
        return future

    def close(self) -> None:
        """Stop the compile thread and its process (queued compiles are dropped)."""
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                self._stop_child()
                continue
            if job is None:
                break
            fmt, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self._compile(fmt))
                except Exception as exc:
                    future.set_exception(exc if isinstance(exc, GrammarError) else GrammarError(
                        f"response_format ({fmt.type}): {type(exc).__name__}: {exc}"))
        self._stop_child()

    def _stop_child(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child = None

    def _compile(self, fmt: ResponseFormat) -> xgr.CompiledGrammar:
        import xgrammar as xgr

        if self._child is None:
            self._child = _Child(self._info.serialize_json())
        child = self._child
        try:
            child.send(_ENCODER.encode(fmt))
            started = time.monotonic()
            while (payload := child.poll()) is None:
                over = child.over_budget(self._budget, time.monotonic() - started)
                if over is not None:
                    raise GrammarError(f"response_format ({fmt.type}): {over}")
        except Exception:  # over budget, or the process died: the next compile starts anew
            self._stop_child()
            raise
        reply = msgspec.json.decode(payload, type=_Compiled)
        if reply.error is not None:
            raise GrammarError(f"response_format ({fmt.type}): {reply.error}")
        assert reply.grammar is not None
        return xgr.CompiledGrammar.deserialize_json(reply.grammar, self._info)


class _Child:
    """The compile process, seen from the engine."""

    def __init__(self, tokenizer_info_json: str) -> None:
        self.process, self._sock = spawn("engine.grammar_process")
        self._frames = Frames(self._sock)
        self.send(tokenizer_info_json.encode())
        if not self._frames.read(START_TIMEOUT_S):
            self.kill()
            raise GrammarError("the grammar compiler's process did not start")
        self._idle_rss = self._rss()

    def send(self, payload: bytes) -> None:
        self._sock.sendall(pack(payload))

    def poll(self) -> bytes | None:
        """The reply, if it came within ``POLL_S``."""
        messages = self._frames.read(POLL_S)
        if messages is None:
            raise GrammarError(f"the grammar compiler's process exited "
                               f"({self.process.wait()})")
        return messages[0] if messages else None

    def over_budget(self, budget: CompileBudget, elapsed_s: float) -> str | None:
        if elapsed_s > budget.timeout_s:
            return f"compiling took longer than {budget.timeout_s:g} s"
        grown = self._rss() - self._idle_rss
        if grown > budget.memory_bytes:
            return f"compiling needed more than {budget.memory_bytes / 2**20:.0f} MiB"
        return None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self._sock.close()

    def _rss(self) -> int:
        try:  # Linux; elsewhere only the time budget holds
            with open(f"/proc/{self.process.pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return 0


# -- the child's side ----------------------------------------------------------------------------

def compile_format(compiler: xgr.GrammarCompiler, fmt: ResponseFormat) -> xgr.CompiledGrammar:
    """``fmt``'s grammar; raises :class:`GrammarError` with the library's message."""
    try:
        if fmt.type == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if fmt.type == "json_schema":
            assert fmt.json_schema is not None  # checked by ResponseFormat
            return compiler.compile_json_schema(
                msgspec.json.encode(fmt.json_schema.schema).decode(), any_whitespace=False)
        if fmt.type == "regex":
            assert fmt.regex is not None
            return compiler.compile_regex(fmt.regex)
        if fmt.type == "choice":
            assert fmt.choice is not None
            # EBNF string literals take JSON's escapes.
            alternatives = " | ".join(msgspec.json.encode(c).decode() for c in fmt.choice)
            return compiler.compile_grammar(f"root ::= {alternatives}")
        if fmt.type == "grammar":
            assert fmt.grammar is not None
            return compiler.compile_grammar(fmt.grammar)
    except RuntimeError as exc:
        raise GrammarError(_LOCATION.sub("", str(exc)).strip()) from None
    raise GrammarError(f"type {fmt.type!r} has no grammar")


def child_main(fd: int, parent_pid: int) -> int:
    """Compile each format the engine sends, reply with the grammar or the error; exit when
    the engine's side closes."""
    die_with_parent(parent_pid)
    import xgrammar as xgr

    sock = socket.socket(fileno=fd)
    frames = Frames(sock)
    first = frames.read(None)
    if not first:
        return 2
    info = xgr.TokenizerInfo.deserialize_json(first[0].decode())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    sock.sendall(pack(b"ready"))
    decoder = msgspec.json.Decoder(ResponseFormat)
    while (messages := frames.read(None)) is not None:
        for payload in messages:
            try:
                reply = _Compiled(grammar=compile_format(compiler, decoder.decode(payload))
                                  .serialize_json())
            except (GrammarError, msgspec.ValidationError) as exc:
                reply = _Compiled(error=str(exc))
            sock.sendall(pack(_ENCODER.encode(reply)))
    return 0


if __name__ == "__main__":
    raise SystemExit(child_main(int(sys.argv[1]), int(sys.argv[2])))
