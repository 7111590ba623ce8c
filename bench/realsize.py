"""Real-size shapes on this machine, in one command: Llama-3.2-1B and 3B (``bench/shapes.py``,
random bf16 weights in hub-style shards) through kvbatch, transformers and llama.cpp.

For each shape, printed and appended to ``bench/RESULTS.md``:

- **load**: seconds to a ready ``LLMEngine`` and its peak RSS over the weights' bytes, in a
  fresh process (``bench/load_memory.py``'s measure; goal <= 1.2x);
- **a lone request**: ms a token (64 tokens after the first, best of 3), the weight bytes a
  decode step reads and the GB/s that makes, against this machine's memory read (a sum over
  1 GiB) and copy measured in the same run; llama.cpp's ms a token on a server of one slot;
- **kvbatch against llama.cpp** at each ``--concurrency`` (``bench/peer.py``: chat requests
  sharing a 170-token system prompt, cold and warm; goals >= 2x at 32, >= 3x at 128, and a
  lone request at least llama.cpp's speed);
- **kvbatch against transformers** at ``--transformers-requests`` (the same kind of requests,
  transformers' static batches of that size, greedy; goal >= 5x at 32), and the ceiling of
  that ratio on this machine: the longest request's decode steps at a lone step's time each,
  or the work's FLOPs at torch's best GEMM rate here (bf16 where the CPU has bf16 arithmetic,
  else float32, which kvbatch's bf16 GEMMs widen to), whichever takes longer.

llama.cpp comes from a checkout built as ``bench/peer.py`` says (``--llama-cpp DIR`` with
``DIR/build/bin/llama-server``); its ``convert_hf_to_gguf.py`` writes each shape's GGUF once
(BF16, or Q8_0 with ``--quantization int8``), with the checkout's own ``gguf-py``; the converter
also imports ``sentencepiece`` (``pip install sentencepiece``; without it llama.cpp is left out
and the line says why).

    python -m bench.realsize --llama-cpp ~/llama.cpp                  # both shapes, bf16
    python -m bench.realsize --shapes llama-3.2-1b --concurrency 32 --quantization int8

On 2 cores a 3B shape's 128 requests take the better part of an hour per system: pick with
``--shapes`` and ``--concurrency``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from argparse import Namespace
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from bench import peer
from bench.int8 import decode_ms, weight_read_bytes
from bench.load_memory import measure
from bench.shapes import SHAPES, write_shape
from bench.throughput import (
    RESULTS_MD,
    ModelShape,
    machine,
    matmul_peak_flops,
    model_shape,
    native_dtype,
    run_transformers,
)
from bench.workloads import Workload, shared_system_workload
from engine import EngineConfig, LLMEngine
from engine.models.loader import cache_dir

LONE_TOKENS = 64
LONE_TRIES = 3


def memory_bandwidth(gib: float = 1.0, tries: int = 5) -> tuple[float, float]:
    """(read, copy) GB/s of this machine now: a sum over ``gib`` GiB of float32, and a copy
    of it (bytes read plus written), the best of ``tries`` each."""
    src = torch.ones(int(gib * 2**30) // 4)
    dst = torch.empty_like(src)
    read = copy = float("inf")
    for _ in range(tries):
        started = time.perf_counter()
        src.sum()
        read = min(read, time.perf_counter() - started)
        started = time.perf_counter()
        dst.copy_(src)
        copy = min(copy, time.perf_counter() - started)
    return src.nbytes / read / 1e9, 2 * src.nbytes / copy / 1e9


def gguf_of(model_dir: Path, llama_cpp: Path, quantization: str | None) -> Path:
    """The shape's GGUF for llama.cpp (written once): BF16, or Q8_0 for int8."""
    outtype = "q8_0" if quantization == "int8" else "bf16"
    out = model_dir / f"model-{outtype}.gguf"
    if not out.is_file():
        env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
        done = subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"),
                               str(model_dir), "--outtype", outtype, "--outfile", str(out)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
        if done.returncode != 0:  # e.g. an architecture newer than this llama.cpp
            errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
            raise RuntimeError(f"{llama_cpp}'s convert_hf_to_gguf.py failed: "
                               + (errors or done.stderr.splitlines() or ["no output"])[-1])
    return out


def lone_request(engine: LLMEngine) -> float:
    """ms a decode step of one request alone, best of :data:`LONE_TRIES` fresh prompts."""
    prompts = shared_system_workload("realsize-lone", engine.tokenizer, LONE_TRIES, 40,
                                     (20, 40), (1, 1), seed=3).prompts
    return min(decode_ms(engine, prompt, LONE_TOKENS)[0] for prompt in prompts)


def versus_transformers(model_dir: Path, n: int, args: Namespace
                        ) -> tuple[float, float, Workload, ModelShape]:
    """Useful tokens a second of kvbatch and of transformers on ``n`` requests, the requests
    and the model's shape."""
    engine = peer.kvbatch_engine(args)
    w = shared_system_workload("realsize-hf", engine.tokenizer, n, peer.SYSTEM_TOKENS,
                               peer.USER_TOKENS, peer.OUTPUT_TOKENS, args.seed)
    seconds, tokens = peer.kvbatch_run(engine, w)
    shape, pad = model_shape(engine), min(engine.info.eos_token_ids)
    del engine
    # transformers at its best on this CPU: bf16 where it has bf16 arithmetic, else float32
    base = run_transformers(model_dir, getattr(torch, native_dtype()), w, n, shape, pad)
    return tokens / seconds, base.useful_tokens / base.wall_s, w, shape


def shared_prefix(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with (an engine with a prefix cache computes them once)."""
    first = prompts[0]
    return next((i for i in range(len(first)) if any(
        len(p) <= i or p[i] != first[i] for p in prompts)), len(first))


@dataclass(frozen=True)
class Ceiling:
    """The least seconds any engine needs for a workload on this machine, two ways."""

    memory_s: float  # the longest request's decode steps, each at least a lone step
    flops: float  # the work: the shared prefix once, every other prompt and output token
    compute_s: float  # ``flops`` at the best GEMM rate measured here
    useful_tok_s: float  # the workload's useful tokens over the larger of the two


def ceiling(w: Workload, lone_ms: float, shape: ModelShape, flop_s: float) -> Ceiling:
    """The most useful tokens a second any engine could reach on ``w``, from two floors:

    - memory: its longest request's tokens after the first, one decode step each, each at least
      a lone request's step (a step of more rows reads the same weights);
    - compute: the work's FLOPs (:meth:`ModelShape.flops`; the prompts' shared prefix once,
      as a prefix cache computes it, but each prompt's last token for each request: its first
      output token comes from it) at ``flop_s``, torch's best GEMM rate measured here (a
      kernel at the cores' own peak could beat it by the margin between the two)."""
    memory_s = (max(w.max_tokens) - 1) * lone_ms / 1000
    common = min(shared_prefix(w.prompts), min(map(len, w.prompts)) - 1)
    runs = [(0, common)] + [(common, len(p) - common) for p in w.prompts] + [
        (len(p), m - 1) for p, m in zip(w.prompts, w.max_tokens, strict=True)]
    flops = shape.flops(runs, sampled=w.num_output_tokens)
    compute_s = flops / flop_s
    return Ceiling(memory_s, flops, compute_s, w.num_output_tokens / max(memory_s, compute_s))


def run_shape(name: str, args: Namespace, bandwidth: tuple[float, float]) -> list[str]:
    model_dir = args.models / name
    weights = write_shape(name, model_dir)
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    say(f"**{name}** ({weights / 2**30:.2f} GiB of bf16 weights"
        f"{', int8' if args.quantization else ''}):")
    base, loaded, _, seconds = measure("kvbatch", model_dir, args.quantization)
    say(f"- load: {seconds:.1f} s, peak RSS {loaded / 2**30:.2f} GiB = "
        f"{loaded / weights:.2f}x the weights ({(loaded - base) / weights:.2f}x past "
        "the process's start; goal <= 1.2x)")

    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="bfloat16",
                                    quantization=args.quantization,
                                    enable_prefix_caching=False, kv_cache_memory_bytes=1 << 29))
    ms = lone_request(engine)
    read = weight_read_bytes(engine)
    del engine
    say(f"- lone request: kvbatch {ms:.1f} ms a token, {read / 1e9:.2f} GB of weights "
        f"a step = {read / ms / 1e6:.1f} GB/s (memory: read {bandwidth[0]:.1f} GB/s, "
        f"copy {bandwidth[1]:.1f} GB/s)")

    sub = Namespace(model=str(model_dir), dtype="bfloat16", quantization=args.quantization,
                    kv_cache_gib=args.kv_cache_gib, concurrency=args.concurrency,
                    llama_server=None, gguf=None, slots=128, slot_ctx=512,
                    threads=args.threads, seed=args.seed, out=str(args.out))
    if args.llama_cpp:
        try:
            sub.gguf = str(gguf_of(model_dir, args.llama_cpp, args.quantization))
            sub.llama_server = str(args.llama_cpp / "build" / "bin" / "llama-server")
        except RuntimeError as exc:  # kvbatch's figures still come
            say(f"- llama.cpp: not run ({exc})")
    if args.concurrency:
        runs, per_token = peer.compare(sub)
        for n in args.concurrency:
            best = {system: max((r.tok_s for r in runs if r.system == system
                                 and r.concurrency == n), default=0.0)
                    for system in ("kvbatch", "llama.cpp")}
            ratio = (f" = {best['kvbatch'] / best['llama.cpp']:.2f}x"
                     if best["llama.cpp"] else "")
            say(f"- {n} requests: kvbatch {best['kvbatch']:.1f} useful tok/s, "
                f"llama.cpp {best['llama.cpp']:.1f}{ratio} (best of cold and warm)")
        if "llama.cpp" in per_token:  # both on peer.py's one prompt, the same way
            ours, theirs = per_token["kvbatch"] * 1000, per_token["llama.cpp"] * 1000
            say(f"- lone request, the same prompt: kvbatch {ours:.1f}, llama.cpp {theirs:.1f} "
                f"ms a token = {theirs / ours:.2f}x its speed")
    if args.transformers_requests:
        ours, theirs, w, shape = versus_transformers(model_dir, args.transformers_requests, sub)
        say(f"- {args.transformers_requests} requests: kvbatch {ours:.1f} useful "
            f"tok/s, transformers {theirs:.1f} = {ours / theirs:.2f}x")
        # the rate kvbatch's GEMMs run at: bf16, widened to float32 without bf16 arithmetic
        flop_s = matmul_peak_flops(getattr(torch, native_dtype()))
        most = ceiling(w, ms, shape, flop_s)
        say(f"  - the most any engine could reach: {max(w.max_tokens) - 1} decode steps after "
            f"the longest request's first token, each at least a lone step's {ms:.1f} ms = "
            f"{most.memory_s:.1f} s; the work, {most.flops / 1e12:.2f} TFLOP (the shared "
            f"prompt once), at torch's best {native_dtype()} GEMM here "
            f"({flop_s / 1e9:.0f} GFLOP/s) = {most.compute_s:.1f} s; so "
            f"{most.useful_tok_s:.1f} useful tok/s = {most.useful_tok_s / theirs:.2f}x "
            "transformers, and kvbatch at "
            f"{ours / most.useful_tok_s:.0%} of it")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["llama-3.2-1b", "llama-3.2-3b"],
                        choices=SHAPES)
    parser.add_argument("--quantization", choices=["int8"], default=None)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[32, 128],
                        help="request counts against llama.cpp (none: skip)")
    parser.add_argument("--transformers-requests", type=int, default=32,
                        help="requests against transformers (0: skip)")
    parser.add_argument("--llama-cpp", type=Path, help="a built llama.cpp checkout")
    parser.add_argument("--kv-cache-gib", type=float, default=4.0)
    parser.add_argument("--models", type=Path, default=cache_dir() / "bench-models",
                        help="where the shapes are written (once)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/kvbatch-bench-realsize"))
    parser.add_argument("--no-results-md", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    where = machine()
    bandwidth = memory_bandwidth()
    print(f"# {where}\n# memory: read {bandwidth[0]:.1f} GB/s, copy {bandwidth[1]:.1f} GB/s",
          flush=True)
    sections = [run_shape(name, args, bandwidth) for name in args.shapes]
    if not args.no_results_md:
        stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = "python -m bench.realsize " + " ".join(argv if argv is not None
                                                          else sys.argv[1:])
        with RESULTS_MD.open("a") as f:
            f.write(f"\n### {stamp} — real-size shapes\n\n{where}. `{command}`\n\n"
                    + "\n\n".join("\n".join(s) for s in sections) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
