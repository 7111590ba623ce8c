"""Where a kvbatch engine step spends its time, on one benchmark workload (kvbatch only).

    python bench/profile.py --workload mixed --num-requests 64
    python bench/profile.py --workload shared-prefix --top 30 --trace bench/out/trace.json

Runs the workload through the engine under ``torch.profiler`` and prints the operators by
self CPU time, grouped into the parts the throughput issue asks about (model matmuls,
attention, elementwise, sampling, tensor building) plus the rest of the wall time, which is
Python: scheduling, metadata, the engine loop. The profiler adds a few microseconds per
operator, so totals run a little above an unprofiled ``bench/throughput.py`` run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO_ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == REPO_ROOT / "bench":
    sys.path[0] = str(REPO_ROOT)

from bench.throughput import model_shape, native_dtype, run_kvbatch  # noqa: E402
from bench.workloads import WORKLOADS, make_workload  # noqa: E402
from engine import EngineConfig, LLMEngine  # noqa: E402
from kernels import native  # noqa: E402

# Operator name fragments -> the part of a step they belong to; the first match wins. The C
# kernels appear as kvbatch::<function> (kernels.native.labelled_for_profiler).
PARTS = (
    # a decode step of a few rows: all its layers (matmuls, attention, elementwise) in one call
    ("decode layers, one C call", ("kvbatch::decode_layers",)),
    ("matmul", ("aten::addmm", "aten::mm", "aten::linear", "aten::bmm", "aten::matmul",
                "mkldnn", "kvbatch::linear_small")),
    ("attention", ("paged_decode", "scaled_dot_product", "_flash_attention",
                   "reshape_and_cache", "index_put")),
    ("sampling", ("sample", "argmax", "topk", "sort", "multinomial", "softmax")),
    ("elementwise", ("kvbatch::rms_norm", "kvbatch::rotary", "kvbatch::silu_mul", "aten::mul",
                     "aten::add", "aten::sub", "aten::div", "aten::silu", "aten::rms_norm",
                     "aten::cat", "aten::neg", "aten::exp", "aten::copy_", "aten::to",
                     "aten::_to_copy", "aten::pow", "aten::mean", "aten::rsqrt")),
)


def part_of(name: str) -> str:
    for part, fragments in PARTS:
        if any(f in name for f in fragments):
            return part
    return "other ops"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--workload", default="mixed", choices=WORKLOADS)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=4.0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--top", type=int, default=20, help="operators to list")
    parser.add_argument("--no-profiler", action="store_true", help="time the run only")
    parser.add_argument("--trace", type=Path, help="also write a Chrome trace here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    dtype = native_dtype() if args.dtype == "auto" else args.dtype
    engine = LLMEngine(EngineConfig(
        model=args.model, dtype=dtype, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
    ))
    shape = model_shape(engine)
    w = make_workload(args.workload, engine.tokenizer, args.num_requests, args.max_output, 0)
    print(f"{args.workload}, {dtype}: {len(w.prompts)} requests, {w.num_prompt_tokens} prompt "
          f"tokens, {w.num_output_tokens} output tokens", flush=True)
    if args.no_profiler:
        res = run_kvbatch(engine, w, shape)
        print(f"wall {res.wall_s:.2f} s, {res.useful_tok_s:.1f} useful tok/s, "
              f"{res.model_flops / res.wall_s / 1e9:.1f} GFLOP/s")
        return 0

    with native.labelled_for_profiler(), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        res = run_kvbatch(engine, w, shape)
        wall = time.perf_counter() - start
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    parts: dict[str, float] = defaultdict(float)
    for e in events:
        parts[part_of(e.key)] += e.self_cpu_time_total / 1e6
    print(f"wall {wall:.2f} s under the profiler, {res.useful_tok_s:.1f} useful tok/s\n")
    print(f"{'part':<16}{'s':>8}{'share':>8}")
    for part, secs in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"{part:<16}{secs:8.2f}{secs / wall:8.1%}")
    rest = wall - sum(parts.values())
    print(f"{'python, rest':<16}{rest:8.2f}{rest / wall:8.1%}\n")
    print(f"{'operator':<44}{'calls':>8}{'self s':>9}{'us/call':>9}")
    for e in events[: args.top]:
        secs = e.self_cpu_time_total / 1e6
        print(f"{e.key[:43]:<44}{e.count:8d}{secs:9.2f}{secs / e.count * 1e6:9.1f}")
    if args.trace:
        prof.export_chrome_trace(str(args.trace))
        print(f"\nwrote {args.trace}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
