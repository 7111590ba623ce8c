"""A C linear kernel of the working tree against the same kernel at another git revision, built
alike and called alternately in one process: GB/s of weights (GFLOP/s from 8 rows) by rows,
the ratio, and whether the outputs are the same bits.

The weights are ``--layers`` layers of a shape's four matrices (qkv, o, gate_up, down; past the
caches at the real sizes), random; each row count is timed best of ``--repeats`` passes over
all of them, the two builds taking turns.

    python -m bench.kernel_ab --base HEAD~1 --kind bf16 --rows 1 2 4 8 16 32
    python -m bench.kernel_ab --base HEAD~1 --kind int8 --rows 1 4 8
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
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
    "bf16-widened": ("cpu_linear", torch.bfloat16, torch.float32, None),
    "float32": ("cpu_linear", torch.float32, torch.float32, None),
    "int8": ("cpu_int8", torch.int8, torch.bfloat16, 0),  # per output channel
    "int8-g32": ("cpu_int8", torch.int8, torch.bfloat16, 32),
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
        lib.linear_small(x.data_ptr(), int(x.dtype == torch.bfloat16), weight.data_ptr(),
                         int(weight.dtype == torch.bfloat16), None, y.data_ptr(),
                         int(y.dtype == torch.bfloat16), x.shape[0], weight.shape[0],
                         weight.shape[1], threads)
    return call_linear


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the git revision to compare against")
    parser.add_argument("--kind", choices=KINDS, default="bf16")
    parser.add_argument("--shape", choices=SHAPES, default="llama-3.2-1b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args(argv)
    name, w_dtype, x_dtype, group = KINDS[args.kind]
    torch.manual_seed(0)
    weights: list[tuple] = []
    for n, k in matrices(args.shape, args.layers):
        w = torch.randn(n, k)
        weights.append(int8.quantize(w, group or None) if group is not None
                       else (w.to(w_dtype),))
    nbytes = sum(t.numel() * t.element_size() for w in weights for t in w[:1])
    macs = sum(w[0].numel() for w in weights)
    with tempfile.TemporaryDirectory() as tmp:
        calls = {"base": caller(native.library(name, sources_at(args.base, Path(tmp))), args.kind),
                 "tree": caller(native.library(name), args.kind)}
    print(f"{args.kind} ({name}.c), {args.shape} x {args.layers} layers: the tree against "
          f"{args.base}, {torch.get_num_threads()} threads")
    print("| rows | base | tree | tree/base | bits |\n|---|---|---|---|---|")
    for m in args.rows:
        xs = {k: torch.randn(m, k).to(x_dtype) for k in {w[0].shape[1] for w in weights}}
        outs = {b: [torch.empty(m, w[0].shape[0], dtype=x_dtype) for w in weights] for b in calls}
        best = dict.fromkeys(calls, float("inf"))
        for _ in range(args.repeats):
            for build, call in calls.items():
                started = time.perf_counter()
                for w, y in zip(weights, outs[build], strict=True):
                    call(xs[w[0].shape[1]], w, y)
                best[build] = min(best[build], time.perf_counter() - started)
        same = all(torch.equal(a, b) for a, b in zip(outs["base"], outs["tree"], strict=True))
        rates = [f"{2 * m * macs / s / 1e9:.0f} GFLOP/s" if m >= 8 else
                 f"{nbytes / s / 1e9:.1f} GB/s" for s in (best["base"], best["tree"])]
        print(f"| {m} | {rates[0]} | {rates[1]} | "
              f"{best['base'] / best['tree']:.2f}x | {'same' if same else 'differ'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
