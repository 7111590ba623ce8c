"""Benchmark of the Triton paged-attention kernels against the memory system and torch.

    python bench/kernels.py              # on a CUDA GPU, realistic sizes; appends to RESULTS.md
    python bench/kernels.py --interpret  # on the CPU under Triton's interpreter, tiny sizes

Each case is timed with CUDA events around ``--calls`` back-to-back calls that rotate over
several input sets (so small cases are not served from L2), median of ``--iters`` repetitions
after a warm-up. The calls are timed twice: replayed from a CUDA graph, which is the GPU's own
time and what the bandwidth figures use, and launched eagerly from Python (``eager``), which
adds the launch cost a small case cannot hide. Decode and reshape_and_cache are memory-bound:
they report achieved GB/s against the copy bandwidth measured in the same run, and decode is
compared with torch SDPA over a dense (unpaged) copy of the same cache. Cascade decode (rows
sharing a prefix's blocks, read once) is compared with plain paged decode of the same tables,
in GB/s of the distinct KV bytes. Prefill reports
TFLOP/s against a matmul measured in the same run and is compared with dense causal SDPA.

Results are checked, not only timed: every dtype (bf16, fp16, fp32) against the torch
reference on a mixed batch (split-K decode included), every timed case against the reference
or SDPA, and on CUDA a block pool of more than 2**31 elements, written and read past that
boundary (the kernels' int64 offsets). On CUDA the table is appended to ``bench/RESULTS.md``
with the date, the machine and the command. ``--interpret`` runs the same script on tiny sizes
(timings there say nothing about a GPU).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F

# Run as a script, this file's folder is first on sys.path and its name would shadow the
# `kernels` package: put the repository root there instead.
REPO_ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == REPO_ROOT / "bench":
    sys.path[0] = str(REPO_ROOT)

RESULTS_MD = REPO_ROOT / "bench" / "RESULTS.md"
BLOCK_SIZE = 16
DECODE_TARGET = 0.70  # of the copy bandwidth, for decode at long contexts
ROTATE_BYTES = 512 * 2**20  # rotate input sets until they span this much (H200 L2: 50 MiB)
MAX_ROTATIONS = 8  # at most --calls, so that one timed repetition visits every set
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Relative to the largest reference element; fp16/bf16 also round p to the cache dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


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
    cascade: tuple[tuple[int, int, int], ...]  # (batch, shared prefix, own tokens per row)
    cache_tokens: tuple[int, ...]  # tokens written by one reshape_and_cache
    copy_bytes: int
    matmul_n: int
    long_context: int  # decode contexts from here on count against the bandwidth target
    verify_layouts: tuple[Layout, ...]  # the all-dtype check's head layouts
    verify_decode: tuple[int, ...]  # context lengths of its decode batch
    verify_prefill: tuple[tuple[int, int], ...]  # (seq_len, q_len) of its prefill batch
    large_pool_elements: int  # the int64 check's pool holds more elements than this


GPU_SIZES = Sizes(
    decode=tuple((b, c) for b in (64, 256) for c in (512, 2048, 8192)),
    prefill=((16, 512, 0), (4, 2048, 0), (16, 256, 2048)),
    cascade=((64, 2048, 128), (256, 1024, 64)),
    cache_tokens=(256, 8192),
    copy_bytes=2 * 2**30,
    matmul_n=8192,
    long_context=2048,
    verify_layouts=LAYOUTS,
    verify_decode=(1, 15, 16, 17, 333, 4100),  # a short batch: the long one is split
    verify_prefill=((1, 1), (17, 17), (333, 77), (2100, 300)),
    large_pool_elements=2**31,
)
INTERPRET_SIZES = Sizes(
    decode=((3, 17), (2, 100)),
    prefill=((2, 17, 0), (2, 9, 40)),
    cascade=((4, 80, 17),),
    cache_tokens=(5, 40),
    copy_bytes=16 * 2**20,
    matmul_n=256,
    long_context=100,
    verify_layouts=LAYOUTS[:1],  # the interpreter is slow; the timed cases cover llama3 in bf16
    verify_decode=(1, 17, 70),
    verify_prefill=((1, 1), (17, 17), (40, 9)),
    large_pool_elements=2**15,  # the same code path; the boundary itself needs a GPU's memory
)


@dataclass(frozen=True)
class Timing:
    graph_ms: float  # per call, replayed from a CUDA graph: the GPU's own time
    eager_ms: float  # per call, launched back to back from Python: launch cost included


def _median_event_ms(run: Callable[[], object], iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_calls(
    fn: Callable[[int], object], device: torch.device, warmup: int, iters: int, calls: int
) -> Timing:
    """Per-call time of ``fn(0) .. fn(calls - 1)`` run back to back, median of ``iters``.

    ``i`` counts up so that ``fn`` can rotate its inputs. On the CPU both figures are the
    same wall time; on CUDA see ``Timing``.
    """

    def run_all() -> None:
        for i in range(calls):
            fn(i)

    if device.type != "cuda":
        for _ in range(warmup):
            run_all()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            run_all()
            times.append((time.perf_counter() - start) * 1e3)
        ms = statistics.median(times) / calls
        return Timing(graph_ms=ms, eager_ms=ms)
    for _ in range(max(warmup, 1)):  # compiles, autotunes and fills caches before the capture
        run_all()
    torch.cuda.synchronize()
    eager_ms = _median_event_ms(run_all, iters) / calls
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_all()
    graph.replay()  # the first replay uploads the graph
    torch.cuda.synchronize()
    graph_ms = _median_event_ms(graph.replay, iters) / calls
    del graph
    return Timing(graph_ms=graph_ms, eager_ms=eager_ms)


def num_rotations(bytes_per_set: int) -> int:
    return max(1, min(MAX_ROTATIONS, -(-ROTATE_BYTES // max(bytes_per_set, 1))))


def check(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Raise unless every element is within ``tol`` (relative to the largest) of ``ref``."""
    assert out.shape == ref.shape, (name, out.shape, ref.shape)
    err = (out.float() - ref.float()).abs().max().item()
    bound = tol * max(ref.float().abs().max().item(), 1e-6)
    if not err <= bound:  # also catches NaN
        raise AssertionError(f"{name}: max error {err:.3g} exceeds {bound:.3g}")


def machine(device: torch.device) -> str:
    import triton

    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    if device.type != "cuda":
        return f"{platform.processor() or platform.machine()} CPU, Triton interpreter, {versions}"
    props = torch.cuda.get_device_properties(device)
    return (
        f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB, "
        f"CUDA {torch.version.cuda}, {versions}"
    )


def append_results(path: Path, title: str, machine_line: str, command: str, lines: list[str]):
    """Append a dated section (machine, command, the printed table) to a results file."""
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    table = "\n".join(lines)
    with path.open("a") as f:
        f.write(f"\n### {date} — {title}\n\n{machine_line}. `{command}`\n\n```\n{table}\n```\n")


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
        self.tol = TOLERANCE[self.dtype]
        self.interpret = args.interpret
        self.gen = torch.Generator(device=device).manual_seed(args.seed)
        self.copy_gbps = 0.0
        self.matmul_tflops = 0.0
        self.long_decode_fractions: list[float] = []
        self.lines: list[str] = []  # what was printed, for RESULTS.md
        self.num_checks = 0

    def emit(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)

    def check(self, name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
        check(name, out, ref, tol)
        self.num_checks += 1

    def time(self, fn: Callable[[int], object]) -> Timing:
        return time_calls(fn, self.device, self.args.warmup, self.args.iters, self.args.calls)

    def measure_peaks(self, sizes: Sizes) -> None:
        src = torch.empty(sizes.copy_bytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        ms = self.time(lambda i: dst.copy_(src)).graph_ms
        self.copy_gbps = 2 * sizes.copy_bytes / ms / 1e6  # read + write
        n = sizes.matmul_n
        a = torch.randn(n, n, dtype=self.dtype, device=self.device, generator=self.gen)
        ms = self.time(lambda i: a @ a).graph_ms
        self.matmul_tflops = 2 * n**3 / ms / 1e9
        self.emit(
            f"copy bandwidth {self.copy_gbps:9.1f} GB/s   matmul {self.matmul_tflops:7.1f} TFLOP/s"
        )

    def verify_dtypes(self, sizes: Sizes) -> None:
        """Every dtype against the reference on a mixed batch, whatever ``--dtype`` times."""
        from kernels.paged_decode import _launch_paged_decode

        for name, dtype in DTYPES.items():
            for layout in sizes.verify_layouts:
                scale = layout.head_dim**-0.5
                lens = list(sizes.verify_decode)
                inp = make_paged(layout, [1] * len(lens), lens, dtype, self.gen)
                args = (inp.key_cache, inp.value_cache, inp.block_tables, inp.seq_lens, scale)
                ref = self.reference.paged_attention_decode(inp.query, *args)
                for num_splits in (None, 3):  # the launcher's choice, and split-K for sure
                    self.check(
                        f"{name} {layout.name} decode ({num_splits or 'default'} splits)",
                        _launch_paged_decode(inp.query, *args, num_splits=num_splits),
                        ref,
                        TOLERANCE[dtype],
                    )
                seq_lens = [seq_len for seq_len, _ in sizes.verify_prefill]
                q_lens = [q_len for _, q_len in sizes.verify_prefill]
                inp = make_paged(layout, q_lens, seq_lens, dtype, self.gen)
                args = (
                    inp.key_cache,
                    inp.value_cache,
                    inp.block_tables,
                    inp.query_start_loc,
                    inp.seq_lens,
                    scale,
                )
                self.check(
                    f"{name} {layout.name} prefill vs reference",
                    self.ops.prefill(inp.query, *args),
                    self.reference.paged_attention_prefill(inp.query, *args),
                    TOLERANCE[dtype],
                )
        self.emit(
            f"checked {', '.join(DTYPES)} decode (split-K included) and prefill against the "
            f"reference, contexts up to {max(sizes.verify_decode)}"
        )

    def large_pool(self, min_elements: int) -> None:
        """A block pool of more than ``min_elements`` elements per cache, written and read
        through its last blocks: past 2**31 elements on CUDA, where int32 offsets would wrap."""
        from kernels.paged_decode import _launch_paged_decode

        layout = Layout("large-pool", 4, 1, 128)
        block_elements = BLOCK_SIZE * layout.num_kv_heads * layout.head_dim
        num_blocks = min_elements // block_elements + 5
        shape = (num_blocks, BLOCK_SIZE, layout.num_kv_heads, layout.head_dim)
        key_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        value_cache = torch.empty_like(key_cache)
        last = num_blocks - 1
        # Two sequences over blocks on both sides of the boundary, shuffled.
        block_tables = torch.tensor(
            [[last, 0, last - 2, last - 4], [1, last - 1, 2, last - 3]],
            dtype=torch.int32,
            device=self.device,
        )
        blocks = block_tables.flatten().long()
        for cache in (key_cache, value_cache):  # only the blocks used; the rest stays unset
            cache[blocks] = torch.randn(
                (len(blocks), *shape[1:]), dtype=self.dtype, device=self.device, generator=self.gen
            )
        seq_lens = [4 * BLOCK_SIZE - 3, 3 * BLOCK_SIZE + 5]
        slots = [
            int(block_tables[i, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE
            for i, n in enumerate(seq_lens)
            for pos in range(n)
        ]
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=self.device)
        kv_shape = (len(slots), layout.num_kv_heads, layout.head_dim)
        key, value = (
            torch.randn(kv_shape, dtype=self.dtype, device=self.device, generator=self.gen)
            for _ in range(2)
        )
        self.ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        flat_shape = (-1, layout.num_kv_heads, layout.head_dim)
        self.check("large pool keys", key_cache.view(flat_shape)[slot_mapping], key, 0.0)
        self.check("large pool values", value_cache.view(flat_shape)[slot_mapping], value, 0.0)

        scale = layout.head_dim**-0.5
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=self.device)
        query_start_loc = torch.tensor([0, seq_lens[0], len(slots)], dtype=torch.int32)
        query = torch.randn(
            len(slots),
            layout.num_heads,
            layout.head_dim,
            dtype=self.dtype,
            device=self.device,
            generator=self.gen,
        )
        args = (key_cache, value_cache, block_tables, query_start_loc.to(self.device), lens)
        self.check(
            "large pool prefill",
            self.ops.prefill(query, *args, scale),
            self.reference.paged_attention_prefill(query, *args, scale),
            self.tol,
        )
        args = (key_cache, value_cache, block_tables, lens, scale)
        for num_splits in (1, 2):
            self.check(
                f"large pool decode, {num_splits} split(s)",
                _launch_paged_decode(query[:2], *args, num_splits=num_splits),
                self.reference.paged_attention_decode(query[:2], *args),
                self.tol,
            )
        self.emit(
            f"checked a pool of {key_cache.numel():,} elements per cache "
            f"({key_cache.nbytes / 2**30:.2f} GiB): reshape_and_cache, prefill and decode "
            f"through its last blocks"
        )
        del key_cache, value_cache

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
        self.check("decode vs sdpa", out, sdpa_decode(0).squeeze(2), self.tol)
        if kv_bytes // self.dtype.itemsize <= 2**28:  # the reference upcasts a gathered copy
            s = sets[0]
            ref = self.reference.paged_attention_decode(
                s.query, s.key_cache, s.value_cache, s.block_tables, s.seq_lens, scale
            )
            self.check("decode vs reference", out, ref, self.tol)
        io_bytes = kv_bytes + 2 * out.numel() * out.element_size() + sets[0].block_tables.nbytes
        triton, sdpa = self.time(triton_decode), self.time(sdpa_decode)
        gbps = io_bytes / triton.graph_ms / 1e6
        if context >= long_context:
            self.long_decode_fractions.append(gbps / self.copy_gbps)
        self.emit(
            f"decode   {layout.name:13} batch {batch:4} ctx {context:5}  "
            f"triton {triton.graph_ms * 1e3:8.1f} us {gbps:7.1f} GB/s {gbps / self.copy_gbps:6.1%}"
            f" (eager {triton.eager_ms * 1e3:8.1f} us)  "
            f"sdpa(dense) {sdpa.graph_ms * 1e3:8.1f} us {io_bytes / sdpa.graph_ms / 1e6:7.1f} GB/s"
            f"  x{sdpa.graph_ms / triton.graph_ms:5.2f}"
        )

    def cascade(self, layout: Layout, batch: int, prefix: int, own: int) -> None:
        inp = make_paged(layout, [1] * batch, [prefix + own] * batch, self.dtype, self.gen)
        shared = prefix // BLOCK_SIZE
        tables = inp.block_tables.clone()
        tables[:, :shared] = tables[0, :shared]  # one prompt's blocks, prefix-cached
        rows = torch.arange(batch, device=self.device)
        args = (inp.query, inp.key_cache, inp.value_cache, tables, inp.seq_lens,
                layout.head_dim**-0.5)

        def plain(i: int) -> torch.Tensor:
            return self.ops.decode(*args)

        def cascaded(i: int) -> torch.Tensor:
            return self.ops.decode(*args, prefix=(rows, shared))

        out = cascaded(0)
        self.check("cascade vs plain decode", out, plain(0), self.tol)
        gathered = 2 * batch * (prefix + own) * layout.num_kv_heads * layout.head_dim
        if gathered <= 2**28:  # the reference upcasts a gathered copy
            self.check("cascade vs reference", out,
                       self.reference.paged_attention_decode(*args), self.tol)
        distinct = 2 * (prefix + batch * own) * layout.num_kv_heads * layout.head_dim
        distinct_bytes = distinct * self.dtype.itemsize
        fast, slow = self.time(cascaded), self.time(plain)
        self.emit(
            f"cascade  {layout.name:13} batch {batch:4} prefix {prefix:5} own {own:4}  "
            f"triton {fast.graph_ms * 1e3:8.1f} us {distinct_bytes / fast.graph_ms / 1e6:7.1f} "
            f"GB/s (eager {fast.eager_ms * 1e3:8.1f} us)  plain decode "
            f"{slow.graph_ms * 1e3:8.1f} us {distinct_bytes / slow.graph_ms / 1e6:7.1f} GB/s"
            f"  x{slow.graph_ms / fast.graph_ms:5.2f}"
        )

    def prefill(self, layout: Layout, num_seqs: int, q_len: int, prefix: int) -> None:
        seq_len = prefix + q_len
        inp = make_paged(layout, [q_len] * num_seqs, [seq_len] * num_seqs, self.dtype, self.gen)
        scale = layout.head_dim**-0.5
        args = (inp.key_cache, inp.value_cache, inp.block_tables, inp.query_start_loc, inp.seq_lens)

        def triton_prefill(i: int) -> torch.Tensor:
            return self.ops.prefill(inp.query, *args, scale)

        out = triton_prefill(0)
        if num_seqs * q_len * seq_len <= 2**24:  # the reference holds all scores at once
            ref = self.reference.paged_attention_prefill(inp.query, *args, scale)
            self.check("prefill vs reference", out, ref, self.tol)
        visible_keys = num_seqs * (q_len * prefix + q_len * (q_len + 1) // 2)
        flops = 4 * layout.num_heads * layout.head_dim * visible_keys
        triton = self.time(triton_prefill)
        tflops = flops / triton.graph_ms / 1e9
        line = (
            f"prefill  {layout.name:13} seqs {num_seqs:4} new {q_len:5} cached {prefix:5}  "
            f"triton {triton.graph_ms * 1e3:8.1f} us {tflops:7.1f} TFLOP/s "
            f"{tflops / self.matmul_tflops:6.1%} of matmul (eager {triton.eager_ms * 1e3:8.1f} us)"
        )
        if prefix == 0:  # dense causal SDPA computes the same thing
            q = inp.query.view(num_seqs, q_len, layout.num_heads, -1).transpose(1, 2)
            k, v = dense_kv(inp.key_cache, inp, seq_len), dense_kv(inp.value_cache, inp, seq_len)

            def sdpa_prefill(i: int) -> torch.Tensor:
                return F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=scale, enable_gqa=True
                )

            dense_out = sdpa_prefill(0).transpose(1, 2).reshape(out.shape)
            self.check("prefill vs sdpa", out, dense_out, self.tol)
            sdpa = self.time(sdpa_prefill)
            speedup = sdpa.graph_ms / triton.graph_ms
            line += f"  sdpa(dense) {sdpa.graph_ms * 1e3:8.1f} us x{speedup:5.2f}"
        self.emit(line)

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

        def torch_index_copy(key, value, key_cache, value_cache, slot_mapping) -> None:
            # What torch does when no slot is padding: no mask (the reference's boolean mask
            # would sync the device and cannot be captured in a CUDA graph).
            key_cache.view(-1, *shape[1:]).index_copy_(0, slot_mapping, key)
            value_cache.view(-1, *shape[1:]).index_copy_(0, slot_mapping, value)

        def run(impl: Callable[..., None], i: int) -> None:
            key, value, slot_mapping = sets[i % n_sets]
            impl(key, value, caches[0], caches[1], slot_mapping)

        run(self.ops.reshape_and_cache, 0)
        key, value, slot_mapping = sets[0]
        self.reference.reshape_and_cache(key, value, caches[2], caches[3], slot_mapping)
        self.check("reshape_and_cache key", caches[0], caches[2], 0.0)
        self.check("reshape_and_cache value", caches[1], caches[3], 0.0)
        io_bytes = 4 * key.numel() * key.element_size() + slot_mapping.nbytes
        triton = self.time(lambda i: run(self.ops.reshape_and_cache, i))
        torch_ms = self.time(lambda i: run(torch_index_copy, i)).graph_ms
        gbps = io_bytes / triton.graph_ms / 1e6
        self.emit(
            f"cache    {layout.name:13} tokens {num_tokens:5}  "
            f"triton {triton.graph_ms * 1e3:8.1f} us {gbps:7.1f} GB/s {gbps / self.copy_gbps:6.1%}"
            f" (eager {triton.eager_ms * 1e3:8.1f} us)  "
            f"torch index_copy {torch_ms * 1e3:8.1f} us x{torch_ms / triton.graph_ms:5.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--interpret", action="store_true", help="CPU, Triton interpreter")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="timed dtype")
    parser.add_argument("--warmup", type=int, default=None, help="repetitions before timing")
    parser.add_argument("--iters", type=int, default=None, help="timed repetitions (median)")
    parser.add_argument("--calls", type=int, default=None, help="calls per repetition")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help=f"append the table here (default on CUDA: {RESULTS_MD.relative_to(REPO_ROOT)})",
    )
    parser.add_argument("--no-results", action="store_true", help="append no table")
    args = parser.parse_args(argv)
    if args.interpret:
        # Before anything imports the kernel modules: @triton.jit reads it at definition.
        os.environ["TRITON_INTERPRET"] = "1"
        device, sizes = torch.device("cpu"), INTERPRET_SIZES
    elif torch.cuda.is_available():
        device, sizes = torch.device("cuda"), GPU_SIZES
        if args.results is None:
            args.results = RESULTS_MD
    else:
        parser.error("no CUDA device; run with --interpret for the CPU check")
    if args.no_results:
        args.results = None
    args.warmup = args.warmup if args.warmup is not None else (0 if args.interpret else 3)
    args.iters = args.iters if args.iters is not None else (1 if args.interpret else 20)
    args.calls = args.calls if args.calls is not None else (1 if args.interpret else 10)
    # The reference and SDPA are what the kernels are checked against: no TF32 in them.
    torch.backends.cuda.matmul.allow_tf32 = False

    bench = Bench(args, device)
    name = "CPU (Triton interpreter)" if args.interpret else torch.cuda.get_device_name(device)
    bench.emit(
        f"{name}  dtype {args.dtype}  block_size {BLOCK_SIZE}  seed {args.seed}  "
        f"{args.calls} calls per repetition, median of {args.iters} after {args.warmup} warm-up"
    )
    bench.verify_dtypes(sizes)
    bench.large_pool(sizes.large_pool_elements)
    bench.measure_peaks(sizes)
    for layout in LAYOUTS:
        for batch, context in sizes.decode:
            bench.decode(layout, batch, context, sizes.long_context)
    for layout in LAYOUTS:
        for batch, prefix, own in sizes.cascade:
            bench.cascade(layout, batch, prefix, own)
    for layout in LAYOUTS:
        for num_seqs, q_len, prefix in sizes.prefill:
            bench.prefill(layout, num_seqs, q_len, prefix)
    for layout in LAYOUTS:
        for num_tokens in sizes.cache_tokens:
            bench.reshape_and_cache(layout, num_tokens)

    if device.type == "cuda":
        bench.emit(f"peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
    worst = min(bench.long_decode_fractions)
    verdict = "meets" if worst >= DECODE_TARGET else "misses"
    bench.emit(
        f"decode at contexts >= {sizes.long_context}: worst {worst:.1%} of copy bandwidth, "
        f"{verdict} the {DECODE_TARGET:.0%} target"
        + (" (interpreter: not a GPU measurement)" if args.interpret else "")
    )
    bench.emit(f"all {bench.num_checks} checks match the reference")
    if args.results is not None:
        command = " ".join(["python bench/kernels.py", *(sys.argv[1:] if argv is None else argv)])
        title = f"kernels ({args.dtype}{', interpreter' if args.interpret else ''})"
        append_results(args.results, title, machine(device), command, bench.lines)
        print(f"appended to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
