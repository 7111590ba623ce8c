"""A C linear kernel of the working tree against the same kernel at another git revision, built
alike and called alternately in one process: GB/s of weights (GFLOP/s from 8 rows) by rows,
the ratio, and whether the outputs are the same bits.

The weights are ``--layers`` layers of a shape's four matrices (qkv, o, gate_up, down; past the
caches at the real sizes), random; each row count is timed best of ``--repeats`` passes over
all of them, the two builds taking turns.

``--kind attention`` compares ``cpu_decode.c``'s paged decode attention instead: ``--rows``
sequences of ``--context`` tokens each, over ``--layers`` (16) layers' bf16 KV caches of the
shape's heads in blocks of ``--block-size`` (the CPU's default, 8) scattered over the pool as an
engine's are after some churn; GB/s of K and V read.

    python -m bench.kernel_ab --base HEAD~1 --kind bf16 --rows 1 2 4 8 16 32
    python -m bench.kernel_ab --base HEAD~1 --kind bf16-packed --rows 16 512 1600
    python -m bench.kernel_ab --base HEAD~1 --kind int8 --rows 1 4 8
    python -m bench.kernel_ab --base HEAD~1 --kind attention --rows 1 8 32 --context 256
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == REPO_ROOT / "bench":
    sys.path[0] = str(REPO_ROOT)

from bench.shapes import SHAPES  # noqa: E402
from kernels import int8, native  # noqa: E402

# kind -> (library, weight dtype, x dtype, int8 group or None)
KINDS = {
    "bf16": ("cpu_linear", torch.bfloat16, torch.bfloat16, None),  # the dot product where built
    "bf16-packed": ("cpu_linear", torch.bfloat16, torch.bfloat16, None),  # native.pack_bf16'd
    "bf16-widened": ("cpu_linear", torch.bfloat16, torch.float32, None),
    "float32": ("cpu_linear", torch.float32, torch.float32, None),
    "int8": ("cpu_int8", torch.int8, torch.bfloat16, 0),  # per output channel
    "int8-g32": ("cpu_int8", torch.int8, torch.bfloat16, 32),
    "attention": ("cpu_decode", torch.bfloat16, torch.bfloat16, None),  # bf16 KV, float32 q
}


def sources_at(rev: str, into: Path) -> Path:
    """``kernels/``'s C sources and headers as they were at ``rev``, written into ``into``."""
    names = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-tree", "--name-only", rev,
                            "kernels/"], check=True, capture_output=True, text=True).stdout
    for name in names.split():
        if name.endswith((".c", ".h")):
            (into / Path(name).name).write_bytes(subprocess.run(
                ["git", "-C", str(REPO_ROOT), "show", f"{rev}:{name}"], check=True,
                capture_output=True).stdout)
    return into


def matrices(shape: str, layers: int) -> list[tuple[int, int]]:
    c = SHAPES[shape]
    h, i = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * c.get("head_dim", h // c["num_attention_heads"])
    return [(h + 2 * kv, h), (h, h), (2 * i, h), (h, i)] * layers


def caller(lib, kind: str) -> Callable[[torch.Tensor, tuple, torch.Tensor], None]:  # type: ignore[no-untyped-def]
    """A call of ``lib``'s linear, as ``kernels.native`` makes it, into ``y``."""
    threads = torch.get_num_threads()
    if kind.startswith("int8"):
        def call(x: torch.Tensor, w: tuple, y: torch.Tensor) -> None:
            q, scale = w
            lib.linear_int8(x.data_ptr(), int(x.dtype == torch.bfloat16), q.data_ptr(),
                            scale.data_ptr(), None, y.data_ptr(), int(y.dtype == torch.bfloat16),
                            x.shape[0], q.shape[0], q.shape[1], int8.group_size(q, scale), 0,
                            threads)
        return call

    def call_linear(x: torch.Tensor, w: tuple, y: torch.Tensor) -> None:
        (weight,) = w
        w_kind = 2 if native.is_packed(weight) else int(weight.dtype == torch.bfloat16)
        lib.linear_small(x.data_ptr(), int(x.dtype == torch.bfloat16), weight.data_ptr(), w_kind,
                         None, y.data_ptr(), int(y.dtype == torch.bfloat16), x.shape[0],
                         *native.logical_shape(weight), threads)
    return call_linear


def builds(name: str, base: str) -> dict[str, ctypes.CDLL]:
    """``kernels/<name>.c`` as it was at ``base`` and as it is in the tree, built alike."""
    with tempfile.TemporaryDirectory() as tmp:
        return {"base": native.library(name, sources_at(base, Path(tmp))),
                "tree": native.library(name)}


def best_of(runs: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Each build's best seconds over ``repeats`` rounds, the builds taking turns."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for build, run in runs.items():
            started = time.perf_counter()
            run()
            best[build] = min(best[build], time.perf_counter() - started)
    return best


def print_row(m: int, rates: list[str], best: dict[str, float],
              outs: dict[str, list[torch.Tensor]]) -> None:
    """A table row: the two builds' rates, the tree's speed over the base's, and whether every
    output is the same bits."""
    same = all(torch.equal(a, b) for a, b in zip(outs["base"], outs["tree"], strict=True))
    print(f"| {m} | {rates[0]} | {rates[1]} | {best['base'] / best['tree']:.2f}x | "
          f"{'same' if same else 'differ'} |")


def linears(call: Callable[[torch.Tensor, tuple, torch.Tensor], None], weights: list[tuple],
            xs: dict[int, torch.Tensor], outs: list[torch.Tensor]) -> None:
    """One build's pass over every matrix, into its outputs."""
    for w, y in zip(weights, outs, strict=True):
        call(xs[native.logical_shape(w[0])[1]], w, y)


def decode_layers(lib: ctypes.CDLL, query: torch.Tensor, caches: list[tuple[torch.Tensor, ...]],
                  head: tuple, outs: list[torch.Tensor], threads: int) -> None:
    """One build's decode attention over every layer's caches, into its output and lse."""
    out, lse = outs
    for keys, values in caches:
        lib.paged_decode(query.data_ptr(), keys.data_ptr(), values.data_ptr(), *head,
                         out.data_ptr(), lse.data_ptr(), None, 0, None, None, threads)


def attention_ab(libs: dict[str, ctypes.CDLL], args: argparse.Namespace) -> None:
    """The table of ``--kind attention``: each build's paged_decode over the same caches."""
    c = SHAPES[args.shape]
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    dim = c.get("head_dim", c["hidden_size"] // heads)
    bs, threads = args.block_size, torch.get_num_threads()
    for m in args.rows:
        blocks = -(-args.context // bs)
        caches = [(torch.randn(m * blocks, bs, kv_heads, dim).to(torch.bfloat16),
                   torch.randn(m * blocks, bs, kv_heads, dim).to(torch.bfloat16))
                  for _ in range(args.layers)]
        tables = torch.randperm(m * blocks).to(torch.int32).reshape(m, blocks)
        lens = torch.full((m,), args.context, dtype=torch.int32)
        query = torch.randn(m, heads, dim).to(torch.bfloat16).float()  # as a bf16 model's
        outs = {b: [torch.empty(m, heads, dim), torch.empty(m, heads)] for b in libs}
        # paged_decode's arguments between the caches' pointers and the outputs'
        head = (native.DTYPE_CODES[torch.bfloat16], tables.data_ptr(), blocks, lens.data_ptr(),
                m, heads, kv_heads, dim, bs, ctypes.c_float(dim ** -0.5))
        runs = {b: partial(decode_layers, libs[b], query, caches, head, outs[b], threads)
                for b in libs}
        best = best_of(runs, args.repeats)
        nbytes = 2 * m * args.context * kv_heads * dim * 2 * args.layers
        print_row(m, [f"{nbytes / best[b] / 1e9:.3g} GB/s" for b in ("base", "tree")], best,
                  outs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the git revision to compare against")
    parser.add_argument("--kind", choices=KINDS, default="bf16")
    parser.add_argument("--shape", choices=SHAPES, default="llama-3.2-1b")
    parser.add_argument("--layers", type=int,
                        help="layers of weights or KV caches (4, attention 16: past the caches)")
    parser.add_argument("--context", type=int, default=256, help="attention: tokens a row")
    parser.add_argument("--block-size", type=int, default=8, help="attention: tokens a block")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args(argv)
    name, w_dtype, x_dtype, group = KINDS[args.kind]
    args.layers = args.layers or (16 if args.kind == "attention" else 4)
    torch.manual_seed(0)
    libs = builds(name, args.base)
    threads = torch.get_num_threads()
    if args.kind == "attention":
        print(f"attention ({name}.c), {args.shape} heads, {args.layers} layers, {args.context} "
              f"tokens a row in blocks of {args.block_size}: the tree against {args.base}, "
              f"{threads} threads")
    else:
        print(f"{args.kind} ({name}.c), {args.shape} x {args.layers} layers: the tree against "
              f"{args.base}, {threads} threads")
    print("| rows | base | tree | tree/base | bits |\n|---|---|---|---|---|")
    if args.kind == "attention":
        attention_ab(libs, args)
        return 0
    weights: list[tuple] = []
    for n, k in matrices(args.shape, args.layers):
        w = torch.randn(n, k)
        weights.append(int8.quantize(w, group or None) if group is not None
                       else (native.pack_bf16(w.to(w_dtype)),) if args.kind == "bf16-packed"
                       else (w.to(w_dtype),))
    nbytes = sum(t.numel() * t.element_size() for w in weights for t in w[:1])
    shapes = [native.logical_shape(w[0]) for w in weights]  # (outputs, inputs), packed or not
    macs = sum(n * k for n, k in shapes)
    calls = {b: caller(lib, args.kind) for b, lib in libs.items()}
    for m in args.rows:
        xs = {k: torch.randn(m, k).to(x_dtype) for k in {k for _, k in shapes}}
        outs = {b: [torch.empty(m, n, dtype=x_dtype) for n, _ in shapes] for b in calls}

        best = best_of({b: partial(linears, calls[b], weights, xs, outs[b]) for b in calls},
                       args.repeats)
        print_row(m, [f"{2 * m * macs / best[b] / 1e9:.0f} GFLOP/s" if m >= 8 else
                      f"{nbytes / best[b] / 1e9:.1f} GB/s" for b in ("base", "tree")], best, outs)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
