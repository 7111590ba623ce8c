"""Benchmark of the Triton paged-attention kernels against the memory system and torch.

    python bench/kernels.py              # on a CUDA GPU, realistic sizes
    python bench/kernels.py --interpret  # on the CPU under Triton's interpreter, tiny sizes

Each kernel is timed with CUDA events (median of ``--iters`` runs after a warm-up, rotating
over several input sets so small cases are not served from L2). Decode and reshape_and_cache
are memory-bound: they report achieved GB/s against the copy bandwidth measured in the same
run, and decode is compared with torch SDPA over a dense (unpaged) copy of the same cache.
Prefill reports TFLOP/s against a matmul measured in the same run and is compared with dense
causal SDPA. Every case is also checked against the torch reference or SDPA; ``--interpret``
runs the same script on tiny sizes (timings there say nothing about a GPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# Run as a script, this file's folder is first on sys.path and its name would shadow the
# `kernels` package: put the repository root there instead.
REPO_ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == REPO_ROOT / "bench":
    sys.path[0] = str(REPO_ROOT)

BLOCK_SIZE = 16
DECODE_TARGET = 0.70  # of the copy bandwidth, for decode at long contexts
ROTATE_BYTES = 512 * 2**20  # rotate input sets until they span this much (H200 L2: 50 MiB)
MAX_ROTATIONS = 8
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Layout:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


LAYOUTS = (Layout("smollm2-135m", 9, 3, 64), Layout("llama3-8b", 32, 8, 128))


@dataclass(frozen=True)
class Sizes:
    decode: tuple[tuple[int, int], ...]  # (batch, context)
    prefill: tuple[tuple[int, int, int], ...]  # (num_seqs, q_len, cached prefix)
    cache_tokens: tuple[int, ...]  # tokens written by one reshape_and_cache
    copy_bytes: int
    matmul_n: int
    long_context: int  # decode contexts from here on count against the bandwidth target


GPU_SIZES = Sizes(
    decode=tuple((b, c) for b in (64, 256) for c in (512, 2048, 8192)),
    prefill=((16, 512, 0), (4, 2048, 0), (16, 256, 2048)),
    cache_tokens=(256, 8192),
    copy_bytes=2 * 2**30,
    matmul_n=8192,
    long_context=2048,
)
INTERPRET_SIZES = Sizes(
    decode=((3, 17), (2, 100)),
    prefill=((2, 17, 0), (2, 9, 40)),
    cache_tokens=(5, 40),
    copy_bytes=16 * 2**20,
    matmul_n=256,
    long_context=100,
)


def time_ms(fn: Callable[[int], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median wall time of ``fn(i)`` in ms; ``i`` counts up so ``fn`` can rotate its inputs."""
    for i in range(warmup):
        fn(i)
    if device.type != "cuda":
        times = []
        for i in range(iters):
            start = time.perf_counter()
            fn(i)
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda.synchronize()
    for i in range(iters):
        starts[i].record()
        fn(i)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def num_rotations(bytes_per_set: int) -> int:
    return max(1, min(MAX_ROTATIONS, -(-ROTATE_BYTES // max(bytes_per_set, 1))))


def check(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Raise unless every element is within ``tol`` (relative to the largest) of ``ref``."""
    err = (out.float() - ref.float()).abs().max().item()
    bound = tol * max(ref.float().abs().max().item(), 1e-6)
    if not err <= bound:  # also catches NaN
        raise AssertionError(f"{name}: max error {err:.3g} exceeds {bound:.3g}")


@dataclass(frozen=True)
class PagedInputs:
    query: torch.Tensor  # [T, H, D]
    key_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, H_kv, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, blocks_per_seq] int32, shuffled physical blocks
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32


def make_paged(
    layout: Layout, q_lens: list[int], seq_lens: list[int], dtype: torch.dtype, gen: torch.Generator
) -> PagedInputs:
    device = gen.device
    blocks_per_seq = -(-max(seq_lens) // BLOCK_SIZE)
    num_blocks = len(seq_lens) * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, layout.num_kv_heads, layout.head_dim)
    tables = torch.randperm(num_blocks, generator=gen, device=device)
    query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device=device)
    query_start_loc[1:] = torch.tensor(q_lens, device=device).cumsum(0)
    return PagedInputs(
        query=torch.randn(
            sum(q_lens),
            layout.num_heads,
            layout.head_dim,
            dtype=dtype,
            device=device,
            generator=gen,
        ),
        key_cache=torch.randn(shape, dtype=dtype, device=device, generator=gen),
        value_cache=torch.randn(shape, dtype=dtype, device=device, generator=gen),
        block_tables=tables.view(len(seq_lens), blocks_per_seq).int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=query_start_loc,
    )


def dense_kv(cache: torch.Tensor, inp: PagedInputs, context: int) -> torch.Tensor:
    """[B, H_kv, context, D]: the paged cache gathered into one dense tensor per sequence."""
    gathered = cache[inp.block_tables.long()].flatten(1, 2)[:, :context]  # [B, ctx, H_kv, D]
    return gathered.transpose(1, 2).contiguous()


class Bench:
    def __init__(self, args: argparse.Namespace, device: torch.device):
        from kernels import get_ops, reference

        self.ops = get_ops("triton")
        self.reference = reference
        self.args = args
        self.device = device
        self.dtype = DTYPES[args.dtype]
        self.tol = 1e-5 if self.dtype == torch.float32 else 2e-2
        self.interpret = args.interpret
        self.gen = torch.Generator(device=device).manual_seed(args.seed)
        self.copy_gbps = 0.0
        self.matmul_tflops = 0.0
        self.long_decode_fractions: list[float] = []

    def time(self, fn: Callable[[int], object]) -> float:
        return time_ms(fn, self.device, self.args.warmup, self.args.iters)

    def measure_peaks(self, sizes: Sizes) -> None:
        src = torch.empty(sizes.copy_bytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        ms = self.time(lambda i: dst.copy_(src))
        self.copy_gbps = 2 * sizes.copy_bytes / ms / 1e6  # read + write
        n = sizes.matmul_n
        a = torch.randn(n, n, dtype=self.dtype, device=self.device, generator=self.gen)
        ms = self.time(lambda i: a @ a)
        self.matmul_tflops = 2 * n**3 / ms / 1e9
        print(
            f"copy bandwidth {self.copy_gbps:9.1f} GB/s   matmul {self.matmul_tflops:7.1f} TFLOP/s"
        )

    def decode(self, layout: Layout, batch: int, context: int, long_context: int) -> None:
        kv_bytes = 2 * batch * context * layout.num_kv_heads * layout.head_dim * self.dtype.itemsize
        sets = [
            make_paged(layout, [1] * batch, [context] * batch, self.dtype, self.gen)
            for _ in range(num_rotations(kv_bytes))
        ]
        scale = layout.head_dim**-0.5

        def triton_decode(i: int) -> torch.Tensor:
            s = sets[i % len(sets)]
            return self.ops.decode(
                s.query, s.key_cache, s.value_cache, s.block_tables, s.seq_lens, scale
            )

        dense = [
            (dense_kv(s.key_cache, s, context), dense_kv(s.value_cache, s, context)) for s in sets
        ]
        queries = [s.query.unsqueeze(2) for s in sets]  # [B, H, 1, D]

        def sdpa_decode(i: int) -> torch.Tensor:
            k, v = dense[i % len(sets)]
            q = queries[i % len(sets)]
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

        out = triton_decode(0)
        check("decode vs sdpa", out, sdpa_decode(0).squeeze(2), self.tol)
        if self.interpret:
            s = sets[0]
            ref = self.reference.paged_attention_decode(
                s.query, s.key_cache, s.value_cache, s.block_tables, s.seq_lens, scale
            )
            check("decode vs reference", out, ref, self.tol)
        io_bytes = kv_bytes + 2 * out.numel() * out.element_size() + sets[0].block_tables.nbytes
        triton_ms, sdpa_ms = self.time(triton_decode), self.time(sdpa_decode)
        gbps = io_bytes / triton_ms / 1e6
        if context >= long_context:
            self.long_decode_fractions.append(gbps / self.copy_gbps)
        print(
            f"decode   {layout.name:13} batch {batch:4} ctx {context:5}  "
            f"triton {triton_ms * 1e3:9.1f} us {gbps:8.1f} GB/s {gbps / self.copy_gbps:6.1%}  "
            f"sdpa(dense) {sdpa_ms * 1e3:9.1f} us {io_bytes / sdpa_ms / 1e6:8.1f} GB/s  "
            f"x{sdpa_ms / triton_ms:5.2f}"
        )

    def prefill(self, layout: Layout, num_seqs: int, q_len: int, prefix: int) -> None:
        seq_len = prefix + q_len
        inp = make_paged(layout, [q_len] * num_seqs, [seq_len] * num_seqs, self.dtype, self.gen)
        scale = layout.head_dim**-0.5
        args = (inp.key_cache, inp.value_cache, inp.block_tables, inp.query_start_loc, inp.seq_lens)

        def triton_prefill(i: int) -> torch.Tensor:
            return self.ops.prefill(inp.query, *args, scale)

        out = triton_prefill(0)
        if self.interpret or num_seqs * q_len * seq_len <= 2**24:
            ref = self.reference.paged_attention_prefill(inp.query, *args, scale)
            check("prefill vs reference", out, ref, self.tol)
        visible_keys = num_seqs * (q_len * prefix + q_len * (q_len + 1) // 2)
        flops = 4 * layout.num_heads * layout.head_dim * visible_keys
        triton_ms = self.time(triton_prefill)
        line = (
            f"prefill  {layout.name:13} seqs {num_seqs:4} new {q_len:5} cached {prefix:5}  "
            f"triton {triton_ms * 1e3:9.1f} us {flops / triton_ms / 1e9:7.1f} TFLOP/s "
            f"{flops / triton_ms / 1e9 / self.matmul_tflops:6.1%} of matmul"
        )
        if prefix == 0:  # dense causal SDPA computes the same thing
            q = inp.query.view(num_seqs, q_len, layout.num_heads, -1).transpose(1, 2)
            k, v = dense_kv(inp.key_cache, inp, seq_len), dense_kv(inp.value_cache, inp, seq_len)

            def sdpa_prefill(i: int) -> torch.Tensor:
                return F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=scale, enable_gqa=True
                )

            dense_out = sdpa_prefill(0).transpose(1, 2).reshape(out.shape)
            check("prefill vs sdpa", out, dense_out, self.tol)
            sdpa_ms = self.time(sdpa_prefill)
            line += f"  sdpa(dense) {sdpa_ms * 1e3:9.1f} us x{sdpa_ms / triton_ms:5.2f}"
        print(line)

    def reshape_and_cache(self, layout: Layout, num_tokens: int) -> None:
        shape = (num_tokens, layout.num_kv_heads, layout.head_dim)
        num_blocks = 4 * -(-num_tokens // BLOCK_SIZE)
        cache_shape = (num_blocks, BLOCK_SIZE, layout.num_kv_heads, layout.head_dim)
        n_sets = num_rotations(4 * num_tokens * shape[1] * shape[2] * self.dtype.itemsize)
        sets = []
        for _ in range(n_sets):
            kv = [torch.randn(shape, dtype=self.dtype, device=self.device, generator=self.gen)]
            kv.append(torch.randn(shape, dtype=self.dtype, device=self.device, generator=self.gen))
            slots = torch.randperm(num_blocks * BLOCK_SIZE, device=self.device, generator=self.gen)
            sets.append((*kv, slots[:num_tokens].contiguous()))
        caches = [torch.zeros(cache_shape, dtype=self.dtype, device=self.device) for _ in range(4)]

        def run(impl: Callable[..., None], i: int) -> None:
            key, value, slot_mapping = sets[i % n_sets]
            impl(key, value, caches[0], caches[1], slot_mapping)

        run(self.ops.reshape_and_cache, 0)
        key, value, slot_mapping = sets[0]
        self.reference.reshape_and_cache(key, value, caches[2], caches[3], slot_mapping)
        check("reshape_and_cache key", caches[0], caches[2], 0.0)
        check("reshape_and_cache value", caches[1], caches[3], 0.0)
        io_bytes = 4 * key.numel() * key.element_size() + slot_mapping.nbytes
        triton_ms = self.time(lambda i: run(self.ops.reshape_and_cache, i))
        torch_ms = self.time(lambda i: run(self.reference.reshape_and_cache, i))
        gbps = io_bytes / triton_ms / 1e6
        print(
            f"cache    {layout.name:13} tokens {num_tokens:5}  "
            f"triton {triton_ms * 1e3:9.1f} us {gbps:8.1f} GB/s {gbps / self.copy_gbps:6.1%}  "
            f"torch {torch_ms * 1e3:9.1f} us x{torch_ms / triton_ms:5.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--interpret", action="store_true", help="CPU, Triton interpreter")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--warmup", type=int, default=None, help="runs before timing")
    parser.add_argument("--iters", type=int, default=None, help="timed runs (median)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.interpret:
        # Before anything imports the kernel modules: @triton.jit reads it at definition.
        os.environ["TRITON_INTERPRET"] = "1"
        device, sizes = torch.device("cpu"), INTERPRET_SIZES
    elif torch.cuda.is_available():
        device, sizes = torch.device("cuda"), GPU_SIZES
    else:
        parser.error("no CUDA device; run with --interpret for the CPU check")
    args.warmup = args.warmup if args.warmup is not None else (1 if args.interpret else 10)
    args.iters = args.iters if args.iters is not None else (3 if args.interpret else 100)

    name = "CPU (Triton interpreter)" if args.interpret else torch.cuda.get_device_name(device)
    print(f"{name}  dtype {args.dtype}  block_size {BLOCK_SIZE}  seed {args.seed}  ", end="")
    print(f"median of {args.iters} after {args.warmup} warm-up")
    bench = Bench(args, device)
    bench.measure_peaks(sizes)
    for layout in LAYOUTS:
        for batch, context in sizes.decode:
            bench.decode(layout, batch, context, sizes.long_context)
    for layout in LAYOUTS:
        for num_seqs, q_len, prefix in sizes.prefill:
            bench.prefill(layout, num_seqs, q_len, prefix)
    for layout in LAYOUTS:
        for num_tokens in sizes.cache_tokens:
            bench.reshape_and_cache(layout, num_tokens)

    if device.type == "cuda":
        print(f"peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
    if bench.long_decode_fractions:
        worst = min(bench.long_decode_fractions)
        verdict = "meets" if worst >= DECODE_TARGET else "misses"
        print(
            f"decode at contexts >= {sizes.long_context}: worst {worst:.1%} of copy bandwidth, "
            f"{verdict} the {DECODE_TARGET:.0%} target"
            + (" (interpreter: not a GPU measurement)" if args.interpret else "")
        )
    print("all results match the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
