"""How many rows a decode step should run in one C call: ms a step by its rows, the one call
(``kernels.native.DecodeLayers``, the C linear up to ``linear_max_rows``) against layer by
layer on torch's GEMM (the weights as the checkpoint has them), in the same process on the same
real-size shape. ``--against unpacked``: against the one call on bf16 weights not packed for the
dot product (``EngineConfig.pack_cpu_weights`` off, where this CPU packs them); ``--against
layers``: against layer by layer on the same (packed) weights.

The row limits in ``kernels/native.py`` (``LINEAR_MAX_ROWS_BF16_*``, ``LINEAR_INT8_MAX_ROWS*``)
come from this comparison: the one call wins up to the row count where the ratio falls under
1. Each setting gets a fresh engine; each row count is timed over ``--tokens`` decode steps
after the prefill, the best of ``--repeats`` alternations.

    python -m bench.decode_rows --rows 1 2 4 8 16 24 32
    python -m bench.decode_rows --quantization int8 --rows 8 16 32 64
    python -m bench.decode_rows --rows 8 16 24 32 --one-call-rows 32  # past today's limits
    python -m bench.decode_rows --model smollm2-135m-instruct --dtype float32 --rows 8 16 32
    python -m bench.decode_rows --rows 1 8 16 24 32 64 96 --against unpacked
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == REPO_ROOT / "bench":
    sys.path[0] = str(REPO_ROOT)

from bench.shapes import SHAPES, write_shape  # noqa: E402
from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from kernels import native  # noqa: E402


def step_ms(engine: LLMEngine, rows: int, tokens: int, tag: str) -> float:
    """ms a decode step of ``rows`` fresh 40-token prompts decoding together."""
    params = SamplingParams(temperature=0.0, max_tokens=1 + tokens, ignore_eos=True)
    rng = random.Random(tag)
    for i in range(rows):
        engine.add_request(f"{tag}-{i}", [rng.randrange(1, 5000) for _ in range(40)], params)
    started: set[str] = set()
    while len(started) < rows:  # the prefill, to every request's first token
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    begin, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return (time.perf_counter() - begin) / steps * 1000


# kernels.native's row limits of the C linears, as they are (LINEAR_MAX_ROWS by dtype: bf16's
# where the kernel widens it, on CPUs without AVX512-BF16)
DEFAULTS: dict[str, int | dict[torch.dtype, int]] = {name: getattr(native, name) for name in (
    "LINEAR_MAX_ROWS", "LINEAR_MAX_ROWS_FLOAT32_AVX2", "LINEAR_MAX_ROWS_BF16_DOT",
    "LINEAR_MAX_ROWS_BF16_TORCH_AMX", "LINEAR_MAX_ROWS_BF16_AMX", "LINEAR_MAX_ROWS_PACKED",
    "LINEAR_MAX_ROWS_PACKED_AVX512", "LINEAR_MAX_ROWS_PACKED_DOT",
    "LINEAR_INT8_MAX_ROWS", "LINEAR_INT8_MAX_ROWS_FIXED_GROUPS", "LINEAR_INT8_MAX_ROWS_AMX",
    "LINEAR_INT8_MAX_ROWS_PACKED", "LINEAR_INT8_MAX_ROWS_COLUMNS")}


# --against: the baseline's name, whether it runs the one call, and whether its bf16 weights are
# packed for the dot product (EngineConfig.pack_cpu_weights)
BASELINES = {"torch": ("layer by layer on torch", False, False),
             "unpacked": ("one C call, unpacked", True, False),
             "layers": ("layer by layer, packed", False, True)}


def set_one_call_rows(limit: int | None) -> None:
    """The C kernels' row limits as they are (None), or ``limit`` rows for every kind (0:
    every step layer by layer)."""
    for name, default in DEFAULTS.items():
        if limit is not None:  # a dict's keys stay: they name the dtypes the C linear takes
            default = dict.fromkeys(default, limit) if isinstance(default, dict) else limit
        setattr(native, name, default)
    native.linear_max_rows.cache_clear()
    native.linear_int8_max_rows.cache_clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-3.2-1b", choices=SHAPES)
    parser.add_argument("--model", help="a model the engine loads (a directory, or "
                        "smollm2-135m-instruct) in place of --shape's")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--models", type=Path, default=native.cache_dir() / "bench-models")
    parser.add_argument("--quantization", choices=["int8"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--one-call-rows", type=int,
                        help="the one call's row limit for every kind (default: the limits "
                        "kernels/native.py sets for this CPU)")
    parser.add_argument("--against", choices=list(BASELINES), default="torch",
                        help="what the one call (on packed weights where this CPU packs them) "
                        "is compared with")
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        model = str(args.models / args.shape)
        write_shape(args.shape, Path(model))
    best: dict[tuple[str, int], float] = {}
    baseline, one_call_limit, packed = BASELINES[args.against]
    settings = {"one call": (args.one_call_rows, True),
                baseline: (args.one_call_rows if one_call_limit else 0, packed)}
    for repeat in range(args.repeats):
        for setting, (limit, pack) in settings.items():
            set_one_call_rows(limit)
            engine = LLMEngine(EngineConfig(
                model=model, dtype=args.dtype, quantization=args.quantization,
                enable_prefix_caching=False, kv_cache_memory_bytes=1 << 29,
                pack_cpu_weights=pack))
            for rows in args.rows:
                ms = step_ms(engine, rows, args.tokens, f"{setting}-{repeat}-{rows}")
                best[setting, rows] = min(best.get((setting, rows), ms), ms)
            del engine
    set_one_call_rows(args.one_call_rows)
    limit = (native.linear_int8_max_rows(0) if args.quantization
             else native.LINEAR_MAX_ROWS_PACKED_DOT  # the one call's on packed weights
             if args.dtype == "bfloat16" and native.packs_bf16()
             else native.linear_max_rows(getattr(torch, args.dtype)))
    set_one_call_rows(None)
    print(f"{args.model or args.shape}, {args.dtype}{', int8' if args.quantization else ''}: "
          f"C rows {'every count' if limit >= native.EVERY_ROW_COUNT else limit}")
    print(f"| rows | one C call (ms a step) | {baseline} | one call's speed |")
    print("|---|---|---|---|")
    for rows in args.rows:
        ours, theirs = best["one call", rows], best[baseline, rows]
        print(f"| {rows} | {ours:.1f} | {theirs:.1f} | {theirs / ours:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
