"""Weight-only int8 (``--quantization int8``) against bf16, in one run: a lone request's decode
speed, greedy agreement and perplexity.

    python -m bench.int8                    # SmolLM2 (the default model), bf16 vs bf16 + int8
    python -m bench.int8 --shape 1b         # also a Llama-3.2-1B-shaped random model (speed)

Printed, with the machine:

- **decode ms/token** of one request alone (what a step of one row costs: memory-bound, so
  int8 reads half the projections' bytes), the N steps after its first token, on prompts no
  engine has seen, the best of ``--repeats`` runs, the two engines interleaved so
  that a noisy neighbour costs both alike; and the weight bytes a decode step reads, with the
  GB/s that makes. Also the process's CPU time per step: with ``--threads 1`` the figure a
  shared machine disturbs least (waiting for a core does not count).
- **greedy agreement** on ``--prompts`` chat prompts x ``--max-tokens`` tokens (EOS ignored):
  each bf16 continuation run teacher-forced through the int8 model, the share of positions
  where the int8 model's argmax is bf16's token (a free-running comparison would count every
  token after a first disagreement as lost; it is printed too, as the share of positions
  equal and the tokens before the first difference).
- **perplexity** of ``bench/data/int8_ppl.txt`` (original prose written for this bench,
  ~3k tokens) under each model, one forward over the whole text, and int8's over bf16's.

The int8 model keeps embeddings and norms in bf16; its lm_head is int8 (SmolLM2's is tied to
the embeddings: an int8 copy of the table multiplies, the lookup reads the bf16 one).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch

from bench.throughput import machine
from bench.workloads import shared_system_workload
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.attention import AttentionMetadata
from engine.config import DEFAULT_MODEL
from engine.models.loader import resolve_model_dir

TEXT = Path(__file__).with_name("data") / "int8_ppl.txt"
ONE_B_DIR = "llama-3.2-1b-shape"  # under bench/load_memory's model cache, made once


def _engine(model: str, quantization: str | None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype="bfloat16", quantization=quantization,
                                  enable_prefix_caching=False, kv_cache_memory_bytes=1 << 29))


def weight_read_bytes(engine: LLMEngine) -> int:
    """Bytes of weights one decode step reads: every parameter and scale but the embedding
    table (one row of it) where an lm_head of its own multiplies (untied, or int8)."""
    model = engine.runner.model
    total = sum(t.numel() * t.element_size() for t in model.parameters())
    total += sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                 if n.endswith("weight_scale"))
    if model.lm_head is not None:
        emb = model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total


def decode_ms(engine: LLMEngine, prompt: list[int], tokens: int) -> tuple[float, float]:
    """ms per decode step of ``prompt`` alone, over the ``tokens`` steps after its first token
    (the prefill's step is not timed): wall time, and the process's CPU time (with one thread,
    what the step costs whatever else the machine runs)."""
    params = SamplingParams(temperature=0.0, max_tokens=1 + tokens, ignore_eos=True)
    engine.add_request("decode-timed", prompt, params)
    while not any(o.outputs[0].token_ids for o in engine.step()):
        pass  # the prefill, to the first token
    wall, cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        engine.step()
    return ((time.perf_counter() - wall) / tokens * 1000,
            (time.process_time() - cpu) / tokens * 1000)


def sequence_logprobs(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """log p(ids[i + 1] | ids[: i + 1]) for every i, and the argmax there: ``[T - 1, 2]``
    (log-prob, argmax), one prefill of the whole sequence over a KV pool of its own (the
    engine's holds prefix-cached blocks)."""
    model = engine.runner.model
    block = engine.info.block_size
    n = len(ids)
    blocks = -(-n // block)
    kv = torch.zeros(model.num_layers, 2, blocks, block, model.num_kv_heads, model.head_dim,
                     dtype=engine.info.dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), num_decode_tokens=0,
        prefill_query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        decode_prefix=(torch.zeros(0, dtype=torch.int64), 0),
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(n), kv, meta)
        out = []
        for lo in range(0, n - 1, 256):
            hi = min(n - 1, lo + 256)
            logp = torch.log_softmax(model.compute_logits(hidden[lo:hi]).float(), dim=-1)
            target = torch.tensor(ids[lo + 1 : hi + 1])
            out.append(torch.stack([logp[torch.arange(hi - lo), target],
                                    logp.argmax(-1).float()], dim=1))
    return torch.cat(out)


def perplexity(engine: LLMEngine, ids: list[int]) -> float:
    return math.exp(-float(sequence_logprobs(engine, ids)[:, 0].mean()))


def speed(label: str, engines: dict[str, LLMEngine], tokens: int, repeats: int) -> None:
    prompts = shared_system_workload("int8", engines["bf16"].tokenizer, repeats, 40, (20, 40),
                                     (1, 1), seed=1).prompts
    wall = {name: math.inf for name in engines}
    cpu = dict(wall)
    for prompt in prompts:  # a prompt each repeat, both engines on it
        for name, engine in engines.items():
            w, c = decode_ms(engine, prompt, tokens)
            wall[name], cpu[name] = min(wall[name], w), min(cpu[name], c)
    print(f"{label}: lone request, {tokens} tokens, best of {repeats}, "
          f"{torch.get_num_threads()} threads")
    for name, engine in engines.items():
        read = weight_read_bytes(engine)
        print(f"  {name:<6} {wall[name]:7.2f} ms/token wall ({read / wall[name] / 1e6:5.1f} GB/s)"
              f"  {cpu[name]:7.2f} ms/token CPU time  {read / 1e6:8.1f} MB read a step")
    print(f"  int8 / bf16 speed: {wall['bf16'] / wall['int8']:.2f}x wall, "
          f"{cpu['bf16'] / cpu['int8']:.2f}x CPU time (goal >= 1.6x)")


def quality(engines: dict[str, LLMEngine], num_prompts: int, tokens: int) -> None:
    bf16, q8 = engines["bf16"], engines["int8"]
    w = shared_system_workload("int8-quality", bf16.tokenizer, num_prompts, 60, (10, 60),
                               (tokens, tokens), seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    ref = [o.token_ids for o in bf16.generate(w.prompts, params)]
    free = [o.token_ids for o in q8.generate(w.prompts, params)]
    forced = equal = before_first = 0
    for prompt, r, f in zip(w.prompts, ref, free, strict=True):
        argmax = sequence_logprobs(q8, [*prompt, *r])[len(prompt) - 1 :, 1].long().tolist()
        forced += sum(a == b for a, b in zip(argmax, r, strict=True))
        equal += sum(a == b for a, b in zip(f, r, strict=True))
        before_first += next((i for i, (a, b) in enumerate(zip(f, r, strict=True)) if a != b),
                             len(r))
    total = num_prompts * tokens
    print(f"greedy agreement, {num_prompts} prompts x {tokens} tokens: teacher-forced "
          f"{forced / total:.1%} (goal >= 95%); free-running {equal / total:.1%} of positions "
          f"equal, {before_first / total:.1%} before the first difference")
    ids = bf16.tokenizer(TEXT.read_text())["input_ids"][: bf16.info.max_model_len]
    ppl = {name: perplexity(engine, ids) for name, engine in engines.items()}
    print(f"perplexity of {TEXT.name} ({len(ids)} tokens): bf16 {ppl['bf16']:.3f}, "
          f"int8 {ppl['int8']:.3f} ({ppl['int8'] / ppl['bf16'] - 1:+.2%}, goal <= +2%)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--shape", choices=["none", "1b"], default="none",
                        help="also time a random model of this real shape")
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens timed")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"# {machine()}")
    engines = {"bf16": _engine(args.model, None), "int8": _engine(args.model, "int8")}
    speed(resolve_model_dir(args.model).name, engines, args.tokens, args.repeats)
    quality(engines, args.prompts, args.max_tokens)
    del engines
    if args.shape == "1b":
        from bench.load_memory import write_model
        from engine.models.loader import cache_dir

        path = cache_dir() / "bench-models" / ONE_B_DIR
        write_model(path, 1 << 30)
        big = {"bf16": _engine(str(path), None), "int8": _engine(str(path), "int8")}
        speed("Llama-3.2-1B shape (random bf16 weights)", big, args.tokens // 2,
              max(2, args.repeats // 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
