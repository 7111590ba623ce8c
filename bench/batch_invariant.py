"""The batch-invariant mode against the default, in one run: whether prompts give the same
tokens alone and inside a batch, and what the mode costs in tok/s.

    python -m bench.batch_invariant                  # SmolLM2 bf16, 64 requests x 64 tokens
    python -m bench.batch_invariant --dtype float32 --num-requests 32

For each mode (default, then ``batch_invariant=True``) on the same weights: the first
``--checked`` prompts each run alone (greedy, EOS ignored), then all ``--num-requests`` of
them as one batch (chat prompts sharing a system prompt, so prefix caching, chunked prefill
and decode steps of every size are in play); a prompt counts as identical when its tokens
alone and in the batch are equal. The timed runs use prompts no engine has seen yet (another
system prompt each repeat), so they prefill. Printed per mode: identical prompts, the batch's useful
output tok/s (and all tokens processed per second), a lone request's tok/s; then the mode's
ratio against the default for both. Each timing is the best of ``--repeats`` runs, the modes
interleaved, so that a noisy neighbour on a shared machine costs both alike.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field

import torch

from bench.throughput import machine
from bench.workloads import Workload, shared_system_workload
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models.loader import resolve_model_dir

MODES = {"default": False, "batch-invariant": True}


@dataclass
class ModeResult:
    mode: str
    identical: int = 0
    checked: int = 0
    batch_s: list[float] = field(default_factory=list)
    lone_s: list[float] = field(default_factory=list)
    useful_tokens: int = 0
    processed_tokens: int = 0
    lone_tokens: int = 0

    @property
    def batch_tok_s(self) -> float:
        return self.useful_tokens / min(self.batch_s)

    @property
    def processed_tok_s(self) -> float:
        return self.processed_tokens / min(self.batch_s)

    @property
    def lone_tok_s(self) -> float:
        return self.lone_tokens / min(self.lone_s)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def check_identical(engine: LLMEngine, w: Workload, checked: int, res: ModeResult) -> None:
    """Each of the first ``checked`` prompts alone, then all of them in one batch."""
    params = _greedy(w.max_tokens[0])
    alone = [engine.generate([p], params)[0].token_ids for p in w.prompts[:checked]]
    batched = engine.generate(w.prompts, params)[:checked]
    res.checked = checked
    res.identical = sum(a == b.token_ids for a, b in zip(alone, batched, strict=True))


def time_batch(engine: LLMEngine, w: Workload, res: ModeResult) -> None:
    before = engine.stats()
    t0 = time.perf_counter()
    outs = engine.generate(w.prompts, _greedy(w.max_tokens[0]))
    res.batch_s.append(time.perf_counter() - t0)
    res.useful_tokens = sum(len(o.token_ids) for o in outs)
    res.processed_tokens = engine.stats().num_batched_tokens - before.num_batched_tokens


def time_lone(engine: LLMEngine, w: Workload, res: ModeResult) -> None:
    # a prompt the engine has not seen: its prefill counts too, as for a new job
    prompt = [*w.prompts[-1][:-1], 0, w.prompts[-1][-1]]
    t0 = time.perf_counter()
    out = engine.generate([prompt], _greedy(w.max_tokens[0]))[0]
    res.lone_s.append(time.perf_counter() - t0)
    res.lone_tokens = len(out.token_ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--checked", type=int, default=8, help="prompts also run alone")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per mode")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    engines = {
        mode: LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, batch_invariant=inv,
                                     max_num_batched_tokens=args.max_num_batched_tokens,
                                     kv_cache_memory_bytes=1 << 30, seed=args.seed))
        for mode, inv in MODES.items()
    }
    tokenizer = engines["default"].tokenizer
    w = shared_system_workload("batch-invariant", tokenizer, args.num_requests, 200, (20, 200),
                               (args.max_tokens, args.max_tokens), args.seed)
    results = {mode: ModeResult(mode) for mode in MODES}
    for mode, engine in engines.items():
        check_identical(engine, w, args.checked, results[mode])  # also warms the engine up
    for repeat in range(args.repeats):
        # prompts no engine has seen (another system prompt), so the timed batch prefills
        fresh = shared_system_workload("batch-invariant", tokenizer, args.num_requests, 200,
                                       (20, 200), (args.max_tokens, args.max_tokens),
                                       args.seed + 1 + repeat)
        for mode, engine in engines.items():
            time_batch(engine, fresh, results[mode])
            time_lone(engine, fresh, results[mode])

    print(f"# {machine()}")
    print(f"# {resolve_model_dir(args.model).name}, {args.dtype}, {args.num_requests} requests "
          f"({w.num_prompt_tokens} prompt tokens, {args.max_tokens} output tokens each), "
          f"best of {args.repeats}")
    print(f"{'mode':<16} {'alone = batch':>13} {'batch tok/s':>12} {'processed/s':>12} "
          f"{'lone tok/s':>11}")
    for r in results.values():
        print(f"{r.mode:<16} {f'{r.identical} of {r.checked}':>13} {r.batch_tok_s:>12.1f} "
              f"{r.processed_tok_s:>12.1f} {r.lone_tok_s:>11.1f}")
    inv, base = results["batch-invariant"], results["default"]
    print(f"batch-invariant / default: batch {inv.batch_tok_s / base.batch_tok_s:.2f}x, "
          f"lone request {inv.lone_tok_s / base.lone_tok_s:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
