"""Real-size model shapes with random weights, saved as a hub checkpoint is: ``config.json``,
bf16 safetensors shards with ``model.safetensors.index.json``, and a tokenizer. A weight's
value does not change a step's speed or memory, so these stand in for the real checkpoints,
which these machines cannot download.

The tokenizer is SmolLM2's (the default model's, 49,152 tokens) under each shape's own
vocabulary size, so that llama.cpp's ``convert_hf_to_gguf.py`` recognizes its pre-tokenizer
and pads the rest of the vocabulary; the benchmarks send token ids.

    python -m bench.shapes llama-3.2-1b /tmp/models/llama-3.2-1b
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

# The architectures' published shapes (rope scaling left out: it does not change the cost).
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, max_position_embeddings=8192),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                       rope_theta=1000000.0, max_position_embeddings=8192),
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                       rope_theta=1000000.0, max_position_embeddings=8192),
    "llama-3.2-3b": dict(model_type="llama", hidden_size=3072, intermediate_size=8192,
                         num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                         head_dim=128, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, max_position_embeddings=8192),
}
# config.json's "architectures", which llama.cpp's converter reads
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a Llama-family checkpoint of ``config`` (Qwen3's per-head q/k
    norms included; no lm_head when the embeddings are tied)."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}
        if config["model_type"] == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (head_dim,),
                       p + "self_attn.k_norm.weight": (head_dim,)}
    shapes["model.norm.weight"] = (h,)
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def write_random_model(path: Path, config: dict[str, Any], shard_bytes: int = 2 << 30,
                       tokenizer_dir: Path | None = None) -> int:
    """Write a random bf16 model of ``config`` to ``path`` in shards of about ``shard_bytes``
    (once: existing weights are kept, the config rewritten); returns the weights' bytes. The
    tokenizer is copied from ``tokenizer_dir``, or the tiny byte-level one of
    ``engine.testing`` without it."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from engine.testing import build_byte_tokenizer

    index_file = path / "model.safetensors.index.json"
    path.mkdir(parents=True, exist_ok=True)
    fields = {k: v for k, v in config.items() if k != "model_type"}
    AutoConfig.for_model(config["model_type"], architectures=[ARCHITECTURES[config["model_type"]]],
                         **fields).save_pretrained(path)
    if index_file.is_file():
        return int(json.loads(index_file.read_text())["metadata"]["total_size"])
    if tokenizer_dir is None:
        build_byte_tokenizer(path)
    else:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy(tokenizer_dir / name, path / name)
    gen = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    files: list[list[str]] = []
    total = size = 0

    def flush() -> None:
        name = f"part-{len(files):05d}.safetensors"
        save_file(shard, path / name, metadata={"format": "pt"})
        files.append(list(shard))
        shard.clear()

    for name, shape in weight_shapes(config).items():
        if len(shape) == 1:  # norms: ones, as a checkpoint's are near
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if size and size + tensor.nbytes > shard_bytes:
            flush()
            size = 0
        shard[name] = tensor
        size += tensor.nbytes
        total += tensor.nbytes
    flush()
    for k, names in enumerate(files, 1):  # the hub's names, once the count is known
        final = f"model-{k:05d}-of-{len(files):05d}.safetensors"
        (path / f"part-{k - 1:05d}.safetensors").rename(path / final)
        weight_map |= dict.fromkeys(names, final)
    index_file.write_text(json.dumps({"metadata": {"total_size": total},
                                      "weight_map": weight_map}, indent=2))
    return total


def write_shape(name: str, path: Path) -> int:
    """:data:`SHAPES` ``name`` at ``path`` with SmolLM2's tokenizer; the weights' bytes."""
    from engine.models.loader import ensure_default_model

    return write_random_model(path, SHAPES[name], tokenizer_dir=ensure_default_model())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shape", choices=SHAPES)
    parser.add_argument("path", type=Path)
    args = parser.parse_args()
    total = write_shape(args.shape, args.path)
    print(f"{args.shape}: {total / 2**30:.2f} GiB of bf16 weights in {args.path}")


if __name__ == "__main__":
    main()
