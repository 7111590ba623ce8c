"""The cost of LoRA adapters in a batch: one engine, the same prompts, steps with the base model
alone against steps whose rows are spread over the base and three rank-16 adapters.

Each adapter is random (A and B both nonzero) in PEFT's format (``adapter_config.json`` +
``adapter_model.safetensors``), targeting every projection of every layer (q, k, v, o, gate, up,
down): the heaviest adapter a Llama layer can have. A round runs ``--batch`` prompts of
``--prompt-len`` tokens to ``--max-tokens`` new tokens (greedy, EOS ignored) in one batch,
timing the prefill steps (until every request has its first token) and the decode steps after
them apart. Modes: ``base`` (every row on the base model), ``mixed`` (a quarter of the rows on
the base, the rest on the three adapters in turn), ``one-adapter`` (every row on one adapter).
Modes alternate for ``--repeats`` rounds; each keeps its best. Prefix caching is off, so every
round computes every prompt. Prints ms per step and tok/s per mode and the ratio to ``base``
(the issue's goal: mixed decode <= 1.3x the base's step time at rank 16); ``--clock cpu``
times the steps by the process's CPU time instead of the wall clock (with ``--threads 1``,
a measure of the work that holds on a machine other work shares); ``--results-md`` appends
the table to bench/RESULTS.md.

    python -m bench.lora                       # SmolLM2-135M, 32 rows, float32
    python -m bench.lora --model tiny --batch 8 --max-tokens 8 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import DEFAULT_MODEL
from engine.models import loader
from engine.testing import make_random_adapter, make_tiny_model

ADAPTERS = ("a", "b", "c")


def _round(engine: LLMEngine, prompts: list[list[int]], loras: list[str | None],
           params: SamplingParams, clock: Callable[[], float] = time.perf_counter
           ) -> tuple[float, int, float, int]:
    """Prefill seconds and steps, decode seconds and steps of one batch run to completion,
    by ``clock`` (wall time, or the process's CPU time)."""
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"r{i}", prompt, params, lora=lora)
    prefill_s = decode_s = 0.0
    prefill_steps = decode_steps = 0
    started: set[str] = set()
    while engine.has_unfinished_requests():
        in_prefill = len(started) < len(prompts)
        t0 = clock()
        outputs = engine.step()
        elapsed = clock() - t0
        if in_prefill:
            prefill_s, prefill_steps = prefill_s + elapsed, prefill_steps + 1
        else:
            decode_s, decode_steps = decode_s + elapsed, decode_steps + 1
        started.update(o.request_id for o in outputs)
    return prefill_s, prefill_steps, decode_s, decode_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a model directory, the default "
                        "model, or tiny (a random 4-layer model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time steps by the wall clock, or by the process's CPU time (on a "
                        "machine shared with other work, with --threads 1: the work a step "
                        "takes, whatever else runs)")
    parser.add_argument("--results-md", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tmp = Path(tempfile.mkdtemp())
    model = args.model
    if model == "tiny":
        model = str(make_tiny_model(tmp / "tiny", hidden_size=256, intermediate_size=512,
                                    num_layers=4, num_heads=8, num_kv_heads=2))
    model_dir = loader.resolve_model_dir(model)
    lora = tuple(f"{name}={make_random_adapter(model_dir, tmp / name, args.rank, i)}"
                 for i, name in enumerate(ADAPTERS))
    print(f"adapters written to {tmp}", flush=True)
    engine = LLMEngine(EngineConfig(model=model, dtype=args.dtype, seed=args.seed, lora=lora,
                                    max_num_seqs=max(args.batch, 8),
                                    enable_prefix_caching=False))
    rng = random.Random(args.seed)
    vocab = engine.info.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                            min_tokens=args.max_tokens, ignore_eos=True)
    # A quarter of the rows on the base model, the rest on the adapters in turn.
    mixed: list[str | None] = [None if i % 4 == 0 else ADAPTERS[i % 3] for i in
                               range(args.batch)]
    modes: dict[str, list[str | None]] = {
        "base": [None] * args.batch, "mixed": mixed, "one-adapter": [ADAPTERS[0]] * args.batch}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for loras in modes.values():  # warm-ups
        _round(engine, prompts[:4], loras[:4], short)
    best: dict[str, tuple[float, int, float, int]] = {}
    for _ in range(args.repeats):
        for mode, loras in modes.items():
            result = _round(engine, prompts, loras, params, clock)
            print(f"{mode}: prefill {result[0]:.2f} s in {result[1]} steps, decode "
                  f"{result[2]:.2f} s in {result[3]} steps", flush=True)
            if mode not in best or result[0] + result[2] < best[mode][0] + best[mode][2]:
                best[mode] = result

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    command = "python -m bench.lora " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        if v is not None and k != "results_md")
    base_prefill, _, base_decode, _ = best["base"]
    unit = "CPU ms" if args.clock == "cpu" else "ms"
    table = [f"| rows | prefill {unit}/step | prefill tok/s | vs base | decode {unit}/step "
             "| decode tok/s | vs base |", "|---|---|---|---|---|---|---|"]
    for mode, (p_s, p_n, d_s, d_n) in best.items():
        table.append(
            f"| {mode} | {1e3 * p_s / p_n:.1f} | {args.batch * args.prompt_len / p_s:.0f} | "
            f"{p_s / base_prefill:.2f}x | {1e3 * d_s / d_n:.1f} | {args.batch * d_n / d_s:.0f} | "
            f"{d_s / base_decode:.2f}x |")
    lora_mb = engine.lora.resident_bytes / 2**20 if engine.lora else 0.0
    text = "\n".join([
        f"### {datetime.now(UTC):%Y-%m-%d %H:%M} UTC — LoRA adapters in a batch "
        f"({args.dtype}, rank {args.rank})", "",
        f"{cpu}, {args.threads} threads, torch {torch.__version__}, load average "
        f"{os.getloadavg()[0]:.1f} at the end. `{command}`", "",
        f"{args.batch} prompts of {args.prompt_len} tokens, {args.max_tokens} new tokens each; "
        f"three adapters of rank {args.rank} on every projection ({lora_mb:.1f} MiB resident); "
        f"mixed: {mixed.count(None)} rows on the base, the rest on the three adapters.", "",
        *table, ""])
    print(text)
    if args.results_md is not None:
        with args.results_md.open("a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
