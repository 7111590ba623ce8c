"""Tiny random Llama-family models on disk, for tests and quick runs without the real weights.

A tiny model is a normal Hugging Face directory (``config.json``, ``model.safetensors``, a
tokenizer), so everything that loads the real model loads it the same way, and transformers
can load it too as the reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def build_byte_tokenizer(path: Path) -> int:
    """Save a byte-level tokenizer (256 byte tokens + ChatML specials); return its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(path)
    return len(fast)


def make_tiny_model(
    path: str | Path,
    *,
    model_type: str = "llama",
    hidden_size: int = 64,
    intermediate_size: int = 96,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    initializer_range: float = 0.1,
    rope_scaling: dict[str, Any] | None = None,
    max_shard_size: str | None = None,
    seed: int = 0,
    random_norms: bool = False,
    vocab_size: int | None = None,
) -> Path:
    """Write a random model of ``model_type`` (llama, mistral, qwen2 or qwen3) and a tokenizer
    to ``path``, as transformers saves it: ``max_shard_size`` (e.g. ``"20KB"``) splits it into
    shards with a ``model.safetensors.index.json``; ``rope_scaling`` goes to the config as it
    is (e.g. Llama 3.1's ``{"rope_type": "llama3", ...}``).

    ``initializer_range`` is larger than the usual 0.02 so that logits are peaked and greedy
    decoding is not decided by near ties. RMSNorm weights start as ones, which a test cannot
    tell apart: ``random_norms`` draws them in [0.5, 1.5]. ``vocab_size`` pads the model's
    vocabulary past the tokenizer's (as Llama 3 and Qwen pad theirs to whole blocks).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokens = build_byte_tokenizer(path)
    eos_id = tokens - 1  # <|im_end|>, the last special token added
    if vocab_size is not None and vocab_size < tokens:
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {tokens}")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size or tokens,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim if head_dim is not None else hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=tokens - 3,
        **({"rope_scaling": rope_scaling} if rope_scaling is not None else {}),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if random_norms:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size
                                   else {}))
    return path


def make_random_adapter(model_dir: Path, out: Path, rank: int, seed: int,
                        targets: tuple[str, ...] | None = None) -> Path:
    """Write a random LoRA adapter of ``rank`` for the model in ``model_dir`` as PEFT saves
    one (``adapter_config.json``, ``adapter_model.safetensors``), adapting ``targets`` of
    every layer, A and B both nonzero; returns ``out``."""
    import json

    from safetensors.torch import save_file

    from engine.lora_config import TARGET_MODULES
    from engine.models import loader

    targets = targets or TARGET_MODULES
    config = loader.load_config(model_dir)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for part in targets:
            block = "self_attn" if part in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{part}"
            d_in, d_out = shapes[part]
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) / d_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
        "bias": "none", "base_model_name_or_path": str(model_dir)}))
    return out
