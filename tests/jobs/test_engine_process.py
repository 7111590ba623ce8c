"""The engine in a child process (``worker.engine_process``): what crosses the socket comes
back equal, the child's outputs are the in-process engine's, and a child that cannot start or
dies is reported, never waited on forever."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from engine.config import EngineConfig
from engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from worker.engine_process import EngineProcess, EngineStartError, Frames, frame
from worker.messages import (
    CODEC,
    Abort,
    Add,
    Crashed,
    Event,
    Rejected,
    Stepped,
    Stop,
    Threads,
)

STATS = EngineStats(num_running=1, num_waiting=2, num_swapped=1, num_kv_blocks_total=64,
                    num_kv_blocks_free=60, kv_usage=0.0625, kv_bytes_per_block=4096,
                    prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=1,
                    num_swaps=1, num_prompt_tokens=10, num_generated_tokens=3, num_steps=2,
                    num_batched_tokens=13, num_grammar_compiles=1, cpu_threads=3)


def _wire(message: msgspec.Struct) -> bytes:
    """``message`` as the other side reads it: framed, sent through a socket pair, split."""
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frame(message))
        (got,) = Frames(b).read(None)
    return got


def test_commands_cross_the_wire_equal() -> None:
    params = SamplingParams(
        n=2, temperature=0.7, top_k=5, seed=3, max_tokens=9, stop=["\n\n"],
        stop_token_ids=[7], logprobs=2, logit_bias={11: -100.0, 12: 5.5},
        response_format={"type": "json_schema", "json_schema": {
            "name": "row", "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                      "required": ["a"]}}})
    for cmd in (Add("job-1", [{"role": "user", "content": "héllo \u2603"}], params, -3),
                Add("job-2", "raw text", SamplingParams(), 0), Abort("job-3"), Stop(), Threads(3)):
        assert CODEC.command(_wire(cmd)) == cmd
    got = CODEC.command(_wire(Add("j", "p", params)))
    assert isinstance(got, Add) and got.params.response_format == params.response_format
    assert got.params.logit_bias == {11: -100.0, 12: 5.5} and got.params.stop == ("\n\n",)


def test_events_cross_the_wire_equal() -> None:
    metrics = RequestMetrics(arrival_time=1.5, first_scheduled_time=1.6, first_token_time=1.7,
                             finish_time=2.0, num_prompt_tokens=4, num_cached_tokens=2,
                             num_generated_tokens=2, peak_kv_blocks=1, peak_kv_bytes=4096)
    # The sampled token first, then the top ones, whatever their ids: the order is kept.
    logprobs = [{9: -0.25, 3: -0.1, 9000: -2.0}, {4: -math.inf, 5: -0.5}]
    out = RequestOutput("job-1", [1, 2, 3, 4], [
        CompletionOutput(0, [9, 4], "ab", "length", logprobs),
        CompletionOutput(1, [9, 5], "ac", "stop", None)], True, metrics)
    vocab = {t: f"<{t}>\xff".encode("latin-1") for t in (9, 3, 9000, 4, 5)}
    event = Stepped(12.5, {"job-2": 7}, [out], STATS, vocab)
    got = CODEC.event(_wire(event))
    assert got == event
    assert isinstance(got, Stepped) and got.token_bytes == vocab
    assert list(got.finished[0].outputs[0].logprobs[0]) == [9, 3, 9000]
    for other in (Rejected("job-3", "ValueError: prompt too long"), Crashed("Traceback ...")):
        assert CODEC.event(_wire(other)) == other


def test_a_message_of_the_wrong_kind_or_shape_is_refused() -> None:
    with pytest.raises(msgspec.ValidationError, match="stepped"):
        CODEC.command(_wire(Stepped(1.0, {}, [], STATS)))
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        CODEC.command(msgspec.msgpack.encode({"type": "add", "job_id": "j", "prompt": "p",
                                              "params": {"temperature": -1.0}}))
    with pytest.raises(msgspec.ValidationError, match="count"):
        CODEC.command(msgspec.msgpack.encode({"type": "threads", "count": 0}))


def test_frames_split_and_join_across_reads() -> None:
    a, b = socket.socketpair()
    with a, b:
        data = b"".join(frame(Rejected(str(i), "x" * i * 1000)) for i in range(50))
        frames = Frames(b)
        got: list[bytes] = []
        for at in range(0, len(data), 777):  # messages cut at arbitrary places
            a.sendall(data[at:at + 777])
            got += frames.read(1.0) or []
        assert [CODEC.event(m) for m in got] == [Rejected(str(i), "x" * i * 1000)
                                                 for i in range(50)]
        a.close()
        assert frames.read(1.0) is None  # the other side closed


def _events_until(proc: EngineProcess, done, timeout_s: float = 60.0) -> list[Event]:  # type: ignore[no-untyped-def]
    events: list[Event] = []
    deadline = time.monotonic() + timeout_s
    while not done(events):
        assert time.monotonic() < deadline, events
        events.append(proc.events.get(timeout=deadline - time.monotonic()))
    return events


def _config(model: str) -> EngineConfig:
    return EngineConfig(model=model, device="cpu", num_kv_blocks=256, max_num_seqs=8)


def test_child_engine_matches_the_engine_in_this_process(tiny_model: str) -> None:
    from engine.llm_engine import LLMEngine

    prompts = [f"prompt number {i} " * (i + 1) for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    engine = LLMEngine(_config(tiny_model))
    expected = engine.generate(prompts, params)

    proc = EngineProcess(_config(tiny_model))
    proc.start()
    try:
        assert proc.has_chat_template is engine.has_chat_template
        for i, prompt in enumerate(prompts):
            proc.commands.put(Add(f"r{i}", prompt, params, 0))
        proc.commands.put(Add("bad", "word " * 5000, params, 0))  # over max_model_len
        events = _events_until(proc, lambda evs: sum(
            len(e.finished) for e in evs if isinstance(e, Stepped)) == len(prompts))
        finished = {o.request_id: o for e in events if isinstance(e, Stepped) for o in e.finished}
        for i, want in enumerate(expected):
            got = finished[f"r{i}"]
            assert (got.token_ids, got.text, got.finish_reason) == (
                want.token_ids, want.text, want.finish_reason)
            got_lp, want_lp = got.outputs[0].logprobs, want.outputs[0].logprobs
            assert [list(step) for step in got_lp] == [list(step) for step in want_lp]
            assert [v for step in got_lp for v in step.values()] == pytest.approx(
                [v for step in want_lp for v in step.values()], abs=1e-5)
        token_bytes = {t: b for e in events if isinstance(e, Stepped)
                       for t, b in e.token_bytes.items()}
        assert token_bytes == {t: engine.token_bytes(t) for o in finished.values()
                               for step in o.outputs[0].logprobs for t in step}
        (rejected,) = [e for e in events if isinstance(e, Rejected)]
        assert rejected.job_id == "bad" and rejected.error.startswith("ValueError: ")
        progress = [e.progress for e in events if isinstance(e, Stepped) and e.progress]
        assert progress and all(0 < n < 12 for p in progress for n in p.values())
    finally:
        proc.stop()
    assert proc.process.returncode == 0


def test_the_child_runs_on_the_threads_it_is_given(tiny_model: str) -> None:
    # It says whether its threads may be split (on the CPU, cpu_threads unset, not pinned);
    # a Threads command applies from its next step, which reports it in its stats.
    unpinned = len(os.sched_getaffinity(0)) == os.cpu_count()
    proc = EngineProcess(_config(tiny_model))
    proc.start()
    try:
        assert proc.host_cpus == (os.cpu_count() if unpinned else 0)
        proc.commands.put(Threads(1))
        proc.commands.put(Add("r", "hello", SamplingParams(max_tokens=3, ignore_eos=True), 0))
        events = _events_until(proc, lambda evs: any(
            isinstance(e, Stepped) and e.finished for e in evs))
        assert events[-1].stats.cpu_threads == 1  # type: ignore[union-attr]
    finally:
        proc.stop()
    pinned = EngineProcess(EngineConfig(model=tiny_model, device="cpu", num_kv_blocks=64,
                                        cpu_threads=1))
    try:
        assert pinned.host_cpus == 0  # set by its operator: not the worker's to split
    finally:
        pinned.stop()


def test_child_that_cannot_load_its_model_fails_the_start(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(EngineStartError, match=r"could not start: .*no-such-model"):
        EngineProcess(_config(str(tmp_path / "no-such-model")))


def test_a_killed_child_is_a_crash(tiny_model: str) -> None:
    proc = EngineProcess(_config(tiny_model))
    proc.start()
    os.kill(proc.process.pid, signal.SIGKILL)
    events = _events_until(proc, lambda evs: any(isinstance(e, Crashed) for e in evs), 10)
    assert events[-1] == Crashed("the engine process exited with code -9")
    proc.stop()


def test_child_ignores_signals_and_leaves_with_its_parent(tiny_model: str) -> None:
    """Ctrl-C reaches the whole process group: the child keeps serving, so the worker can
    drain. When the worker is gone (its socket closed), the child exits."""
    proc = EngineProcess(_config(tiny_model))
    proc.start()
    os.kill(proc.process.pid, signal.SIGINT)
    os.kill(proc.process.pid, signal.SIGTERM)
    proc.commands.put(Add("r", "still here", SamplingParams(max_tokens=3), 0))
    events = _events_until(proc, lambda evs: any(
        isinstance(e, Stepped) and e.finished for e in evs))
    assert not any(isinstance(e, Crashed) for e in events)
    proc._sock.close()  # what the worker's death does to the child's socket
    assert proc.process.wait(10) == 0


def test_a_command_the_child_cannot_read_fails_that_job_alone(tiny_model: str) -> None:
    proc = EngineProcess(_config(tiny_model))
    proc.start()
    try:  # as from a worker of another version: a sampling field of another type
        payload = msgspec.msgpack.encode({"type": "add", "job_id": "odd", "prompt": "p",
                                          "params": {"max_tokens": "two"}})
        proc._sock.sendall(len(payload).to_bytes(4, "big") + payload)
        proc.commands.put(Add("fine", "p", SamplingParams(max_tokens=2), 0))
        events = _events_until(proc, lambda evs: any(
            isinstance(e, Stepped) and e.finished for e in evs))
        (rejected,) = [e for e in events if isinstance(e, Rejected)]
        assert rejected.job_id == "odd" and "$.params.max_tokens" in rejected.error
        assert [o.request_id for e in events if isinstance(e, Stepped) for o in e.finished] == [
            "fine"]
    finally:
        proc.stop()


def test_the_worker_side_does_not_load_torch() -> None:
    """The worker process holds Redis, SQL and the loop; torch (hundreds of MB resident) is
    the engine process's alone."""
    code = ("import sys, worker.cli, worker.loop, worker.main, worker.engine_process; "
            "from worker.settings import worker_settings; worker_settings(); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal")
def test_a_killed_worker_takes_its_engine_process_with_it(tiny_model: str) -> None:
    """A worker killed with SIGKILL closes nothing: the child, which ignores SIGTERM and may be
    busy for minutes between two reads of its socket, is killed by the kernel with it."""
    code = ("import sys, time; from engine.config import EngineConfig; "
            "from worker.engine_process import EngineProcess; "
            f"p = EngineProcess(EngineConfig(model={tiny_model!r}, device='cpu', "
            "num_kv_blocks=64)); print(p.process.pid, flush=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2])
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        assert _alive(child)
        os.kill(child, signal.SIGSTOP)  # as busy as a long compile: it reads nothing
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30  # only a hang reaches it
        while _alive(child):
            assert time.monotonic() < deadline, "the engine process outlived its worker"
            time.sleep(0.05)
    finally:
        parent.kill()
        if _alive(child):
            os.kill(child, signal.SIGKILL)
