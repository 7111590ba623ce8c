"""Throughput of kvbatch's engine against transformers' static batching, in one run.

    python bench/throughput.py                        # all workloads, 256 requests each
    python bench/throughput.py --num-requests 32 --max-output 64 --workloads mixed   # ~1 min
    kvbatch bench ...                                 # the same

The dtype defaults to ``auto``: bfloat16 where the CPU multiplies it natively (AVX512-BF16 or
AMX), float32 elsewhere (on AVX2-only CPUs torch's bf16 matmul runs at ~1 GFLOP/s, a hundred
times slower than float32, for both systems alike).

Both systems get the same prompts (token ids), the same weights, dtype and thread count, and
produce exactly the requested number of tokens per request (EOS ignored, greedy).
transformers runs left-padded static batches of ``--batch-size`` in arrival order, each until
its longest request is done; only the tokens a request asked for count as useful. The table
gives useful output tok/s, tokens processed per second, the ratio kvbatch/transformers, model
FLOP/s and MFU against a matmul peak measured in the same run, KV memory (allocated vs holding
real tokens, and what static max-length allocation reserves), prefix-cache hit rate, and TTFT /
per-token latency percentiles. Results go to ``bench/out/*.json`` and a dated row per workload
is appended to ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

# Run as a script, bench/ is first on sys.path and bench/kernels.py would shadow the
# `kernels` package: put the repository root there instead.
REPO_ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == REPO_ROOT / "bench":
    sys.path[0] = str(REPO_ROOT)

from bench.workloads import WORKLOADS, Workload, make_workload  # noqa: E402
from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.config import DEVICES  # noqa: E402
from engine.models.loader import resolve_model_dir  # noqa: E402
from engine.runtime import cpu_has_native_bf16  # noqa: E402
from kernels import native  # noqa: E402

OUT_DIR = REPO_ROOT / "bench" / "out"
RESULTS_MD = REPO_ROOT / "bench" / "RESULTS.md"


@dataclass
class SystemResult:
    system: str
    wall_s: float
    useful_tokens: int
    processed_tokens: int  # tokens run through the model (padding and waste included)
    model_flops: float  # FLOPs of the useful work (real prompt tokens + requested outputs)
    kv_allocated_bytes: int  # at the step with the most KV allocated
    kv_real_bytes: int  # bytes of real tokens in that allocation
    kv_static_bytes: int  # what max-length static allocation reserves for the same batch
    prefix_hit_rate: float
    ttft_s: list[float]
    tpot_s: list[float]

    @property
    def useful_tok_s(self) -> float:
        return self.useful_tokens / self.wall_s

    @property
    def processed_tok_s(self) -> float:
        return self.processed_tokens / self.wall_s


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden: int
    q_size: int  # num_heads * head_dim
    vocab: int
    params_per_token: int  # non-embedding weights used per token (matmul FLOPs = 2x this)
    kv_bytes_per_token: int

    def flops(self, context_lens: list[tuple[int, int]], sampled: int) -> float:
        """FLOPs for tokens given as (start, count) runs of context, + ``sampled`` LM heads."""
        matmul = sum(2 * self.params_per_token * n for _, n in context_lens)
        # QK^T and PV: 2 * 2 * q_size FLOPs per (query, key) pair, causal.
        attn = sum(4 * self.q_size * (s * n + n * (n + 1) / 2) for s, n in context_lens)
        return matmul + self.num_layers * attn + 2 * self.hidden * self.vocab * sampled


def model_shape(engine: LLMEngine) -> ModelShape:
    model = engine.runner.model
    # a packed bf16 weight counts as its [N, K], not its N * K / 2 int32 pairs
    params = sum(math.prod(native.logical_shape(p))
                 for n, p in model.named_parameters()
                 if "embed_tokens" not in n and "lm_head" not in n)
    q_size = model.config.num_attention_heads * model.head_dim
    return ModelShape(
        num_layers=model.num_layers,
        hidden=model.config.hidden_size,
        q_size=q_size,
        vocab=model.config.vocab_size,
        params_per_token=params,
        kv_bytes_per_token=engine.info.kv_bytes_per_block // engine.info.block_size,
    )


def useful_flops(shape: ModelShape, w: Workload) -> float:
    runs = [(0, len(p)) for p in w.prompts] + [(len(p), m - 1) for p, m in zip(
        w.prompts, w.max_tokens, strict=True)]
    return shape.flops(runs, sampled=w.num_output_tokens)


# (M, N, K) of the peak probe: squares and a tall-skinny GEMM shaped like a model's MLP.
PEAK_SHAPES = ((1024, 1024, 1024), (2048, 2048, 2048), (1024, 3072, 576))


def matmul_peak_flops(dtype: torch.dtype, seconds: float = 0.5,
                      device: torch.device | None = None) -> float:
    """Best FLOP/s of a few large matmuls in ``dtype`` on ``device`` (the CPU by default), now.

    The best of several shapes, because one shape can sit badly with the BLAS's blocking or
    the caches and a low peak would flatter MFU; ``main`` probes again after every workload
    and keeps the highest figure, because shared machines speed up and slow down.
    """
    device = device or torch.device("cpu")
    shapes = PEAK_SHAPES if device.type == "cpu" else ((8192, 8192, 8192),)
    best = 0.0
    for m, n, k in shapes:
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        a @ b
        iters, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            iters += 1
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        best = max(best, 2 * m * n * k * iters / (time.perf_counter() - start))
    return best


def run_kvbatch(engine: LLMEngine, w: Workload, shape: ModelShape) -> SystemResult:
    kv = engine.kv
    bs = engine.info.block_size
    before = engine.stats()
    t0 = time.monotonic()
    for i, (prompt, max_tokens) in enumerate(zip(w.prompts, w.max_tokens, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(f"{w.name}-{i}", prompt, params)
    finished = []
    peak_alloc, peak_real, peak_running = 0, 0, 0
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
        running = engine.scheduler.running
        alloc = kv.pool.num_blocks - kv.pool.num_free_blocks
        if alloc > peak_alloc:
            filled: dict[int, int] = {}
            for seq in running:
                for i, block in enumerate(seq.block_table):
                    n = min(bs, max(0, seq.num_computed_tokens - i * bs))
                    filled[block] = max(filled.get(block, 0), n)
            peak_alloc, peak_real = alloc, sum(filled.values())
        peak_running = max(peak_running, len(running))
    wall = time.monotonic() - t0
    after = engine.stats()

    longest = max(len(p) + m for p, m in zip(w.prompts, w.max_tokens, strict=True))
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return SystemResult(
        system="kvbatch",
        wall_s=wall,
        useful_tokens=sum(len(o.token_ids) for o in finished),
        processed_tokens=after.num_batched_tokens - before.num_batched_tokens,
        model_flops=useful_flops(shape, w),
        kv_allocated_bytes=peak_alloc * engine.info.kv_bytes_per_block,
        kv_real_bytes=peak_real * shape.kv_bytes_per_token,
        kv_static_bytes=peak_running * longest * shape.kv_bytes_per_token,
        prefix_hit_rate=hits / queries if queries else 0.0,
        ttft_s=[o.metrics.first_token_time - t0 for o in finished],
        tpot_s=[
            (o.metrics.finish_time - o.metrics.first_token_time) / (len(o.token_ids) - 1)
            for o in finished
            if len(o.token_ids) > 1
        ],
    )


def run_transformers(
    model_dir: Path, dtype: torch.dtype, w: Workload, batch_size: int, shape: ModelShape,
    pad_id: int, device: torch.device | None = None,
) -> SystemResult:
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    device = device or torch.device("cpu")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()

    class StepClock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.times.append(time.monotonic())
            return scores

    ttft, tpot = [], []
    processed, kv_peak, kv_real_at_peak = 0, 0, 0
    t0 = time.monotonic()
    for lo in range(0, len(w.prompts), batch_size):
        prompts = w.prompts[lo : lo + batch_size]
        wants = w.max_tokens[lo : lo + batch_size]
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        new = max(wants)
        clock = StepClock()
        with torch.inference_mode():
            model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                min_new_tokens=new, do_sample=False, pad_token_id=pad_id,
                logits_processor=LogitsProcessorList([clock]),
            )
        times = clock.times
        for want in wants:
            ttft.append(times[0] - t0)
            if want > 1:
                tpot.append((times[want - 1] - times[0]) / (want - 1))
        processed += len(prompts) * (width + new - 1)
        kv = len(prompts) * (width + new) * shape.kv_bytes_per_token
        if kv > kv_peak:
            kv_peak = kv
            kv_real_at_peak = sum(len(p) + m for p, m in zip(prompts, wants, strict=True)) * (
                shape.kv_bytes_per_token)
    wall = time.monotonic() - t0
    return SystemResult(
        system="transformers",
        wall_s=wall,
        useful_tokens=w.num_output_tokens,
        processed_tokens=processed,
        model_flops=useful_flops(shape, w),
        kv_allocated_bytes=kv_peak,
        kv_real_bytes=kv_real_at_peak,
        kv_static_bytes=kv_peak,
        prefix_hit_rate=0.0,
        ttft_s=ttft,
        tpot_s=tpot,
    )


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def table(rows: list[dict]) -> str:
    headers = list(rows[0])
    widths = [max(len(h), *(len(str(r[h])) for r in rows)) for h in headers]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(str(r[h]).ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
        for r in rows
    ]
    return "\n".join([line, sep, *body])


def summarize(workload: str, res: SystemResult, base: SystemResult, peak: float) -> dict:
    mib = 2**20
    waste = 1 - res.kv_real_bytes / res.kv_allocated_bytes if res.kv_allocated_bytes else 0.0
    flops = res.model_flops / res.wall_s
    return {
        "workload": workload,
        "system": res.system,
        "useful tok/s": f"{res.useful_tok_s:.1f}",
        "processed tok/s": f"{res.processed_tok_s:.1f}",
        "vs transformers": f"{res.useful_tok_s / base.useful_tok_s:.2f}x",
        "GFLOP/s": f"{flops / 1e9:.1f}",
        "MFU": f"{flops / peak:.1%}",
        "KV alloc MiB": f"{res.kv_allocated_bytes / mib:.1f}",
        "KV real MiB": f"{res.kv_real_bytes / mib:.1f}",
        "KV waste": f"{waste:.1%}",
        "static MiB": f"{res.kv_static_bytes / mib:.1f}",
        "prefix hits": f"{res.prefix_hit_rate:.1%}",
        "TTFT p50/p99 s": f"{percentile(res.ttft_s, 50):.2f}/{percentile(res.ttft_s, 99):.2f}",
        "TPOT p50/p99 ms": (
            f"{percentile(res.tpot_s, 50) * 1e3:.0f}/{percentile(res.tpot_s, 99) * 1e3:.0f}"
        ),
    }


def native_dtype() -> str:
    """The faster dtype for this CPU: bfloat16 with native bf16 dot products, else float32
    (what ``EngineConfig(dtype="auto")`` picks on the CPU)."""
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def machine(device: torch.device | None = None) -> str:
    """The CPU (and its bf16 support, cores, threads), or the GPU for a CUDA ``device``."""
    if device is not None and device.type == "cuda":
        return (f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}, "
                f"torch {torch.__version__}")
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    threads = torch.get_num_threads()
    isa = torch.backends.cpu.get_cpu_capability()
    bf16 = "native bf16" if native_dtype() == "bfloat16" else "no native bf16"
    if torch.cpu._is_amx_tile_supported():
        bf16 += " with AMX"
    return (f"{cpu} ({isa}, {bf16}), {os.cpu_count()} cores, {threads} threads, "
            f"torch {torch.__version__}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="auto: bfloat16 where the CPU has native bf16, else float32")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-output", type=int, default=256, help="cap on output lengths")
    parser.add_argument("--batch-size", type=int, default=32, help="transformers static batch")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=4.0, help="kvbatch KV pool")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", choices=DEVICES,
                        help="where both systems run (auto: CUDA when available)")
    parser.add_argument("--json", type=Path, help="where to write the JSON (default bench/out/)")
    parser.add_argument("--no-results-md", action="store_true", help="don't append RESULTS.md")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    if args.dtype == "auto":
        args.dtype = native_dtype()
    dtype = getattr(torch, args.dtype)
    engine = LLMEngine(EngineConfig(
        model=args.model, dtype=args.dtype, seed=args.seed, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30), device=args.device,
    ))
    # transformers and the peak probe run where the engine does
    device = engine.runner.model.embed_tokens.weight.device
    shape = model_shape(engine)
    model_dir = resolve_model_dir(args.model)
    pad_id = engine.tokenizer.pad_token_id
    pad_id = pad_id if pad_id is not None else min(engine.info.eos_token_ids)
    peak = matmul_peak_flops(dtype, device=device)
    print(f"{machine(device)}; {args.dtype} matmul peak {peak / 1e9:.0f} GFLOP/s", flush=True)

    results, raw = [], []
    for name in args.workloads:
        w = make_workload(name, engine.tokenizer, args.num_requests, args.max_output, args.seed)
        print(f"{name}: {len(w.prompts)} requests, {w.num_prompt_tokens} prompt tokens, "
              f"{w.num_output_tokens} output tokens", flush=True)
        ours = run_kvbatch(engine, w, shape)
        print(f"  kvbatch      {ours.wall_s:7.1f} s", flush=True)
        base = run_transformers(model_dir, dtype, w, args.batch_size, shape, pad_id, device)
        print(f"  transformers {base.wall_s:7.1f} s", flush=True)
        results.append((name, ours, base))
        peak = max(peak, matmul_peak_flops(dtype, device=device))
        raw.append({"workload": name, "kvbatch": asdict(ours), "transformers": asdict(base)})

    print(f"matmul peak, best of every probe: {peak / 1e9:.0f} GFLOP/s")
    rows = [summarize(name, res, base, peak) for name, ours, base in results
            for res in (ours, base)]
    print()
    print(table(rows))
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H%M%SZ")
    out = args.json or OUT_DIR / f"throughput-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": stamp, "machine": machine(device),
        "args": {k: str(v) for k, v in vars(args).items()},
        "matmul_peak_flops": peak, "rows": rows, "raw": raw,
    }, indent=2))
    print(f"\nwrote {out}")
    if not args.no_results_md:
        append_results(rows, args, peak, machine(device))
    return 0


def append_results(rows: list[dict], args: argparse.Namespace, peak: float,
                   where: str) -> None:
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = "python bench/throughput.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}"
        for k, v in vars(args).items() if k not in ("no_results_md", "json")
    )
    with RESULTS_MD.open("a") as f:
        f.write(f"\n### {date} — throughput ({args.dtype})\n\n{where}; matmul peak "
                f"{peak / 1e9:.0f} GFLOP/s. `{command}`\n\n{table(rows)}\n")


if __name__ == "__main__":
    raise SystemExit(main())
