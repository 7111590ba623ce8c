"""Engine test fixtures: tiny random models on disk and a transformers reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.testing import make_tiny_model

# Tiny configurations with awkward shapes: GQA 3:1 with an odd head_dim, MHA, 8:1, qwen2 bias.
TINY_CONFIGS = {
    "llama-gqa3-hd10": dict(hidden_size=60, num_heads=6, num_kv_heads=2, head_dim=10),
    "llama-mha": dict(hidden_size=64, num_heads=4, num_kv_heads=4),
    "llama-gqa8-tied": dict(
        hidden_size=64, num_heads=8, num_kv_heads=1, head_dim=16, tie_word_embeddings=True
    ),
    "qwen2-bias": dict(model_type="qwen2", hidden_size=64, num_heads=4, num_kv_heads=2),
    # Saved in shards of ~20 KB with model.safetensors.index.json, as the big ones are.
    # Llama 3.1's RoPE scaling, with an original context short enough that it changes the
    # frequencies the prompts use.
    "llama3-rope-sharded": dict(
        hidden_size=64, num_heads=4, num_kv_heads=2, max_shard_size="20KB",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    # Qwen3: per-head RMSNorm of q and k (random weights, q's and k's apart), head_dim apart
    # from hidden_size / heads.
    "qwen3-sharded": dict(model_type="qwen3", hidden_size=64, num_heads=4, num_kv_heads=2,
                          head_dim=24, max_shard_size="20KB", random_norms=True),
    "mistral-sharded": dict(model_type="mistral", hidden_size=64, num_heads=4, num_kv_heads=1,
                            max_shard_size="20KB"),
}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: make_tiny_model(root / name, **kw) for name, kw in TINY_CONFIGS.items()}


@pytest.fixture(scope="session")
def tiny_model(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama-gqa3-hd10"]
