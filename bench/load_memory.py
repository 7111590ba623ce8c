"""Host memory to load a model: kvbatch's loader against transformers' ``from_pretrained``, on
the same random Llama of ~1.1B parameters saved in bf16 shards with an index, as a Hugging Face
directory is.

Each load runs in a fresh process: its RSS once torch and the library are imported (the
baseline), its peak RSS (``VmHWM``) once the model is loaded in bf16, and again after a forward
pass over 3 tokens (transformers maps the files and reads a weight's pages when first used, so
only then is its model resident). Goal: peak at most 1.3 x the weights' bytes.

    python -m bench.load_memory
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# Llama-3.2-1B's shape but a 32,000-token vocabulary and untied embeddings.
CONFIG = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
              num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
              max_position_embeddings=2048, tie_word_embeddings=False)

_MEASURE = """
import sys, time
def rss(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])
import torch
which, model_dir, quantization = sys.argv[1], sys.argv[2], sys.argv[3]
if which == "kvbatch":
    from engine import EngineConfig, LLMEngine
    base = rss("VmRSS:")
    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", device="cpu",
                                    num_kv_blocks=16, max_model_len=256,
                                    quantization=None if quantization == "none" else quantization))
    seconds = time.perf_counter() - started
    loaded = rss("VmHWM:")
    engine.generate([[1, 2, 3]])
else:
    from transformers import AutoModelForCausalLM
    base = rss("VmRSS:")
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    seconds = time.perf_counter() - started
    loaded = rss("VmHWM:")
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
print(base * 1024, loaded * 1024, rss("VmHWM:") * 1024, seconds)
"""


def write_model(path: Path, shard_bytes: int) -> int:
    """A random bf16 Llama of :data:`CONFIG` in shards of about ``shard_bytes`` with
    ``model.safetensors.index.json``; returns the weights' bytes."""
    from bench.shapes import write_random_model

    return write_random_model(path, {"model_type": "llama", **CONFIG}, shard_bytes)


def measure(which: str, model_dir: Path,
            quantization: str | None = None) -> tuple[int, int, int, float]:
    """(RSS before loading, peak once loaded, peak after a forward pass) in bytes, and the
    load's seconds (``which``: kvbatch, in bf16 or with ``quantization``, or transformers)."""
    out = subprocess.run([sys.executable, "-c", _MEASURE, which, str(model_dir),
                          quantization or "none"], cwd=REPO_ROOT, check=True,
                         capture_output=True, text=True).stdout.split()
    base, loaded, served = (int(x) for x in out[-4:-1])
    return base, loaded, served, float(out[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="/tmp/kvbatch-bench-load")
    parser.add_argument("--shard-mb", type=int, default=500)
    args = parser.parse_args()
    model_dir = Path(args.out) / "llama-1b-bf16"
    weights = write_model(model_dir, args.shard_mb << 20)
    n_shards = len(list(model_dir.glob("*.safetensors")))
    gib = 2**30
    print(f"random Llama, {weights / 2 / 1e9:.2f}B parameters, {weights / gib:.2f} GiB of bf16 "
          f"weights in {n_shards} shards")
    print("| loader | RSS before loading | peak, loaded | peak, after a forward | "
          "peak / weights | (peak - before) / weights |")
    print("|---|---|---|---|---|---|")
    for which in ("kvbatch", "transformers"):
        base, loaded, peak, _ = measure(which, model_dir)
        print(f"| {which} | {base / gib:.2f} GiB | {loaded / gib:.2f} GiB | {peak / gib:.2f} GiB"
              f" | {peak / weights:.2f}x | {(peak - base) / weights:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
