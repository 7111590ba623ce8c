"""Embedding throughput: kvbatch's prefill-only requests against transformers' batched forward
on the same texts and weights.

kvbatch runs every text as a prompt-only request (``PoolingParams``: chunked prefill under one
token budget, no padding, last-token pooling, L2-normalized; prefix caching off, so that each
repeat computes every token); transformers runs the base model
(``AutoModel``) over right-padded batches of ``--batch-size`` sorted by length (the kindest
order for padding) and pools each text's last real token the same way. The two alternate for
``--repeats`` rounds and each takes its best wall time (the load average is printed: on a
shared machine the figures move with it); the vectors are checked against each other
(cosine). Prints tok/s (prompt tokens per second, padding not counted) both ways and the
ratio; ``--results-md`` appends the table to bench/RESULTS.md.

    python -m bench.embeddings                          # SmolLM2, 256 texts, float32
    python -m bench.embeddings --model tiny --num-texts 64
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModel

from engine import EngineConfig, LLMEngine, PoolingParams
from engine.config import DEFAULT_MODEL
from engine.models import loader
from engine.testing import make_tiny_model

WORDS = ["batch", "cache", "prefix", "token", "model", "vector", "search", "cluster", "query",
         "document", "the", "of", "a", "to", "and", "in", "is", "for", "on", "with", "as", "by",
         "retrieval", "embedding", "dedup"]


def _texts(n: int, min_words: int, max_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
            for _ in range(n)]


def _timed(run):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


def _transformers(model: torch.nn.Module, batches: list[list[list[int]]]) -> torch.Tensor:
    vectors = []
    with torch.inference_mode():
        for batch in batches:
            lengths = torch.tensor([len(ids) for ids in batch])
            ids = torch.zeros(len(batch), int(lengths.max()), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, row in enumerate(batch):
                ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, S, H]
            last = hidden[torch.arange(len(batch)), lengths - 1]
            vectors.append(F.normalize(last.float(), dim=-1))
    return torch.cat(vectors)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="a model directory, the default "
                   "model, or 'tiny' (a random tiny Llama made here)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-texts", type=int, default=256)
    p.add_argument("--min-words", type=int, default=8)
    p.add_argument("--max-words", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=32, help="transformers' batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-md", type=Path, help="append the table to this file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = args.model
    if model == "tiny":
        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", hidden_size=256,
                                    intermediate_size=512, num_layers=4, num_heads=8,
                                    num_kv_heads=2))
    model_dir = loader.resolve_model_dir(model)

    # No prefix caching: a repeat would find the texts of the one before in the cache.
    engine = LLMEngine(EngineConfig(model=model, dtype=args.dtype, seed=args.seed,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    max_num_seqs=256, enable_prefix_caching=False))
    texts = _texts(args.num_texts, args.min_words, args.max_words, args.seed)
    token_ids = [engine.tokenizer.encode(t) for t in texts]
    num_tokens = sum(len(ids) for ids in token_ids)
    hf = AutoModel.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    order = sorted(range(len(texts)), key=lambda i: len(token_ids[i]))
    batches = [[token_ids[i] for i in order[k : k + args.batch_size]]
               for k in range(0, len(order), args.batch_size)]
    engine.generate(texts[:4], PoolingParams())  # warm-ups
    _transformers(hf, batches[:1])
    kv_s = hf_s = float("inf")
    for _ in range(args.repeats):
        wall_s, outs = _timed(lambda: engine.generate(token_ids, PoolingParams()))
        kv_s = min(kv_s, wall_s)
        wall_s, sorted_vectors = _timed(lambda: _transformers(hf, batches))
        hf_s = min(hf_s, wall_s)
    ours = torch.tensor([o.embedding for o in outs])
    theirs = torch.empty_like(sorted_vectors)
    theirs[torch.tensor(order)] = sorted_vectors
    cosine = F.cosine_similarity(ours, theirs, dim=1)

    padded = sum(len(b) * max(len(ids) for ids in b) for b in batches)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    command = "python -m bench.embeddings " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        if v is not None and k != "results_md")
    rows = [("kvbatch", kv_s, num_tokens / kv_s, kv_s and hf_s / kv_s),
            ("transformers", hf_s, num_tokens / hf_s, 1.0)]
    table = ["| system | wall s | tok/s | vs transformers |", "|---|---|---|---|"]
    table += [f"| {name} | {wall:.2f} | {tps:.0f} | {ratio:.2f}x |"
              for name, wall, tps, ratio in rows]
    text = "\n".join([
        f"### {datetime.now(UTC):%Y-%m-%d %H:%M} UTC — embeddings ({args.dtype})", "",
        f"{cpu}, {args.threads} threads, torch {torch.__version__}, load average "
        f"{os.getloadavg()[0]:.1f} at the end. `{command}`", "",
        f"{len(texts)} texts, {num_tokens} prompt tokens ({min(map(len, token_ids))}–"
        f"{max(map(len, token_ids))} a text); transformers ran {padded} tokens with padding "
        f"(batches of {args.batch_size} sorted by length). Cosine kvbatch vs transformers: "
        f"min {cosine.min().item():.6f}.", "", *table, ""])
    print(text)
    if args.results_md is not None:
        with args.results_md.open("a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
