"""Constrained vs unconstrained decoding on the same jobs: the cost of a JSON schema.

Each of ``--num-requests`` chat jobs is run held to a JSON schema (temperature 0.8, seeded),
once as it is and once with its strings bounded by ``maxLength`` (which xgrammar's token-mask
cache cannot precompute, so each mask costs about 100x more to fill);
the same jobs then run unconstrained with ``max_tokens`` set to the length each constrained
output reached and ``ignore_eos``, so both runs generate exactly the same number of tokens
over the same prompts. Each way runs ``--repeats`` times, alternating, and the best wall time
counts (the grammar's one compilation is inside the first constrained run). Prints one table
and the ratio; ``--results-md`` appends it to bench/RESULTS.md.

    python -m bench.structured                 # 256 jobs, SmolLM2, dtype auto
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import date
from pathlib import Path

import torch

from engine import EngineConfig, LLMEngine, SamplingParams

SCHEMA = {  # a nested object, an enum, an array, required fields
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "species": {"enum": ["cat", "dog", "bird", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "owner": {"type": "object",
                  "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
                  "required": ["name", "city"]},
        "toys": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "species", "age", "owner", "toys"],
}


def _bounded(schema: dict) -> dict:
    """``schema`` with every string held to at most 24 characters (``maxLength``)."""
    if schema.get("type") == "string":
        return {**schema, "maxLength": 24}
    return {k: _bounded(v) if isinstance(v, dict) else v for k, v in schema.items()}


SCHEMAS = {"json_schema": SCHEMA, "json_schema, strings maxLength 24": _bounded(SCHEMA)}
SYSTEM = ("You write records for a pet registry. Reply with one JSON object: the pet's name, "
          "species, age, owner (name and city) and a list of its toys.")
CITIES = ["Paris", "Lima", "Oslo", "Kyoto", "Cairo", "Austin", "Perth", "Quito"]


def _prompts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "system", "content": SYSTEM},
             {"role": "user", "content": f"Pet number {i}, who lives in {CITIES[i % 8]}."}]
            for i in range(n)]


def _timed(engine: LLMEngine, prompts: list, params: list[SamplingParams]) -> tuple[float, list]:
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - start, outs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--results-md", action="store_true", help="append to bench/RESULTS.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype))
    prompts = _prompts(args.num_requests)
    engine.generate(prompts[:4], SamplingParams(max_tokens=4))  # warm-up, unconstrained
    table = ["| run | output tokens | output tok/s | wall s | valid JSON | vs unconstrained |",
             "|---|---|---|---|---|---|"]
    ratios = []
    for name, schema in SCHEMAS.items():
        fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}}
        held = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens,
                               response_format=fmt)  # type: ignore[arg-type]
                for i in range(len(prompts))]
        constrained_s, outs = _timed(engine, prompts, held)
        lengths = [len(o.token_ids) for o in outs]
        valid = sum(_parses(o.text) for o in outs)
        free = [SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True)
                for i, n in enumerate(lengths)]
        unconstrained_s, _ = _timed(engine, prompts, free)
        for _ in range(args.repeats - 1):
            constrained_s = min(constrained_s, _timed(engine, prompts, held)[0])
            unconstrained_s = min(unconstrained_s, _timed(engine, prompts, free)[0])
        tokens = sum(lengths)
        ratio = unconstrained_s / constrained_s
        ratios.append(f"{name}: **{ratio:.3f}**")
        table.append(f"| unconstrained, same lengths | {tokens} | {tokens / unconstrained_s:.1f} "
                     f"| {unconstrained_s:.2f} | - | 1 |")
        table.append(f"| {name} | {tokens} | {tokens / constrained_s:.1f} | "
                     f"{constrained_s:.2f} | {valid}/{len(outs)} | {ratio:.3f} |")

    info = engine.info
    header = (f"{args.num_requests} jobs (temperature 0.8, seeded), {args.model} "
              f"{str(info.dtype).removeprefix('torch.')} on {info.device}, "
              f"{args.threads} threads, best of {args.repeats}; grammars compiled: "
              f"{engine.stats().num_grammar_compiles}")
    table.append("\nconstrained / unconstrained throughput: " + "; ".join(ratios))
    print(header)
    print("\n".join(table))
    if args.results_md:
        results = Path(__file__).with_name("RESULTS.md")
        with results.open("a") as f:
            f.write(f"\n## Structured output cost ({date.today()})\n\n"
                    f"`python -m bench.structured` — {header}.\n\n" + "\n".join(table) + "\n")
    return 0


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
