"""Prefix-affinity routing: prompt tokens two workers compute for jobs that share a few long
system prompts, with and without affinity, against the ideal of each prefix computed once.

``--prompts`` distinct system prompts of ``--prefix-tokens`` tokens (a tiny random Llama with
a byte tokenizer: one token a byte), ``--per-prompt`` jobs each with a short question of its
own, submitted interleaved (prompt 1, 2, ..., 8, 1, 2, ...) to two ``kvbatch worker``
processes whose KV pools (``--kv-blocks``) hold fewer than all the prefixes. Computed prompt
tokens are ``prompt_tokens - cached_prompt_tokens`` summed over the jobs' stats rows; the
ideal computes each prompt's shared prefix (whole KV blocks of it) once and every job's own
tail. Each mode runs on fresh workers and a fresh schema and key prefix (real Redis and
PostgreSQL).

    python -m bench.routing
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.queue_path import MODEL_NAME, scratch_services, worker_process
from jobs.constants import DEFAULT_REDIS_URL

BLOCK_SIZE = 8
WORKERS = ("routing-a", "routing-b")
WORDS = ("table", "report", "figure", "row", "column", "answer", "source", "metric", "unit",
         "date", "team", "owner", "budget", "region", "quarter", "review", "label", "score")


def system_prompt(k: int, n_chars: int) -> str:
    rng = random.Random(k)
    text = f"You are assistant number {k} of the data team. "
    while len(text) < n_chars:
        text += " ".join(rng.choice(WORDS) for _ in range(8)) + ". "
    return text[:n_chars]


def shared_blocks(model: str, systems: list[str]) -> list[int]:
    """Per system prompt, the tokens of whole KV blocks that all its jobs share."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    shared = []
    for system in systems:
        a, b = (tok.apply_chat_template([{"role": "system", "content": system},
                                         {"role": "user", "content": q}], tokenize=True,
                                        add_generation_prompt=True, return_dict=False)
                for q in ("0?", "1!"))
        common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        shared.append(common // BLOCK_SIZE * BLOCK_SIZE)
    return shared


def run_mode(args: argparse.Namespace, affinity: bool, systems: list[str],
             shared: list[int]) -> dict[str, Any]:
    from contextlib import ExitStack

    import redis

    from jobs.client import JobClient
    from jobs.constants import Keys
    from jobs.db import make_engine
    from jobs.queue import JobQueue
    from jobs.schemas import JobSpec, JobStatus
    from worker.intake import ROUTE_REFRESH_S

    with scratch_services(args.redis_url, args.database_url) as services, ExitStack() as stack:
        for name in WORKERS:
            stack.enter_context(worker_process(services, args, null=False, name=name, env={
                "KVBATCH_WORKER_ID": name, "KVBATCH_AFFINITY": str(affinity).lower(),
                "KVBATCH_BLOCK_SIZE": str(BLOCK_SIZE),
                "KVBATCH_NUM_KV_BLOCKS": str(args.kv_blocks)}))
        r = redis.Redis.from_url(services.redis_url, decode_responses=True)
        queue = JobQueue(r, MODEL_NAME, Keys(services.key_prefix))
        while set(queue.serving()) != set(WORKERS):
            time.sleep(0.1)
        time.sleep(ROUTE_REFRESH_S + 0.5)  # each has seen the other
        database = make_engine(services.database_url)
        client = JobClient(r, database, key_prefix=services.key_prefix)
        specs = [JobSpec(model=MODEL_NAME, messages=[
                     {"role": "system", "content": system},
                     {"role": "user", "content": f"Question {j} about prompt {k}: which "
                                                 f"{WORDS[j % len(WORDS)]} is it?"}],
                     sampling={"max_tokens": args.max_tokens, "ignore_eos": True},
                     metadata={"prompt": k})
                 for j in range(args.per_prompt) for k, system in enumerate(systems)]
        started = time.perf_counter()
        infos = client.wait(client.submit(specs), timeout_s=3600)
        took = time.perf_counter() - started
        database.dispose()
    assert all(i.status is JobStatus.SUCCEEDED and i.stats is not None for i in infos), \
        Counter(i.status for i in infos)
    prompt_of = {s.id: s.metadata["prompt"] for s in specs}
    total = sum(i.stats.prompt_tokens for i in infos if i.stats)
    computed = total - sum(i.stats.cached_prompt_tokens for i in infos if i.stats)
    ideal = total - sum((args.per_prompt - 1) * n for n in shared)
    placement = Counter((prompt_of[i.id], i.worker_id) for i in infos)
    spread = sum(1 for k in range(len(systems))
                 if len({w for (p, w) in placement if p == k}) > 1)
    return {"affinity": affinity, "total": total, "computed": computed, "ideal": ideal,
            "seconds": took, "spread": spread,
            "per_worker": Counter(i.worker_id for i in infos)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--per-prompt", type=int, default=50)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--kv-blocks", type=int, default=768,
                        help=f"each worker's KV pool, in blocks of {BLOCK_SIZE} tokens")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    parser.add_argument("--database-url", default="postgresql+psycopg://postgres@127.0.0.1/test")
    parser.add_argument("--out", default="/tmp/kvbatch-bench-routing")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    from engine.testing import make_tiny_model

    args.model = str(make_tiny_model(Path(args.out) / "tiny"))
    args.dtype = "float32"
    systems = [system_prompt(k, args.prefix_tokens) for k in range(args.prompts)]
    shared = shared_blocks(args.model, systems)
    fits = args.kv_blocks * BLOCK_SIZE / (sum(shared) / len(shared))
    print(f"{args.prompts} system prompts of ~{sum(shared) // len(shared)} shared tokens, "
          f"{args.per_prompt} jobs each, 2 workers; each KV pool holds {fits:.1f} of the "
          f"prefixes")
    print("| routing | prompt tokens | computed | ideal | computed / ideal | prompts run on "
          "both workers | jobs per worker | wall |")
    print("|---|---|---|---|---|---|---|---|")
    for affinity in (False, True):
        res = run_mode(args, affinity, systems, shared)
        print(f"| {'affinity' if affinity else 'no affinity'} | {res['total']:,} | "
              f"{res['computed']:,} | {res['ideal']:,} | {res['computed'] / res['ideal']:.2f}x"
              f" | {res['spread']} of {args.prompts} | "
              f"{', '.join(str(n) for _, n in sorted(res['per_worker'].items()))} | "
              f"{res['seconds']:.1f}s |", flush=True)


if __name__ == "__main__":
    main()
