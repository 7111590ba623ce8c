"""LoRA adapters: base and adapter requests mixed in one batch give, token for token (float32),
what transformers gives with each adapter merged into the weights (PEFT's merge_and_unload);
the prefix cache keeps each adapter's blocks apart; adapters load under a memory budget."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.lora_config import LoRAConfig, LoRASpec, adapter_of, parse_lora_flags, served_names

NUM_NEW = 12
# name -> (rank, alpha, target modules, rsLoRA): ranks 8 and 16, different projections each.
ADAPTERS = {
    "attn8": (8, 16, ["q_proj", "v_proj"], False),
    "mlp16": (16, 32, ["o_proj", "gate_proj", "down_proj"], False),
    "all16": (16, 8, ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"], True),
}


def _make_adapter(model_dir: Path, out: Path, rank: int, alpha: int, targets: list[str],
                  rslora: bool, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                 use_rslora=rslora, lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # PEFT starts B at zero (a no-op adapter): make both random
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.15)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {name: _make_adapter(tiny_model, root / name, *spec, seed=i)
            for i, (name, spec) in enumerate(ADAPTERS.items())}


def _merged_greedy(model_dir: Path, adapter: Path | None, prompts: list[list[int]]
                   ) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_NEW,
                             min_new_tokens=NUM_NEW, do_sample=False, pad_token_id=0)
        out.append(seq[0, len(prompt):].tolist())
    return out


def _engine(model_dir: Path, adapters: dict[str, Path], **cfg: object) -> LLMEngine:
    lora = tuple(f"{name}={path}" for name, path in adapters.items())
    return LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=256, lora=lora,
                                  **cfg))  # type: ignore[arg-type]


PARAMS = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_mixed_batch_matches_merged_transformers(tiny_model: Path, adapters: dict[str, Path],
                                                 backend: str) -> None:
    rng = random.Random(5)
    # Every prompt runs under the base and each adapter, all in the same steps: the same
    # tokens under four sets of weights (a shared prefix cache would hand one's KV to another).
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 9, 17, 40)]
    names: list[str | None] = [None, *adapters]
    engine = _engine(tiny_model, adapters, attention_backend=backend)
    batch = [(p, name) for p in prompts for name in names]
    outputs = engine.generate([p for p, _ in batch], PARAMS, lora=[n for _, n in batch])
    assert all(o.error is None for o in outputs)
    got = {(tuple(p), n): o.outputs[0].token_ids for (p, n), o in zip(batch, outputs, strict=True)}

    for name in names:
        want = _merged_greedy(tiny_model, adapters[name] if name else None, prompts)
        for prompt, tokens in zip(prompts, want, strict=True):
            assert got[tuple(prompt), name] == tokens, f"{name}, prompt of {len(prompt)}"
    for name in adapters:  # each adapter changes what the model says
        assert any(got[tuple(p), name] != got[tuple(p), None] for p in prompts), name


def test_prefix_cache_is_per_adapter(tiny_model: Path, adapters: dict[str, Path]) -> None:
    engine = _engine(tiny_model, adapters)
    prompt = list(range(40, 90))  # 50 tokens: several full blocks
    cached = []
    for lora in (None, "attn8", "attn8", "mlp16", None):
        (out,) = engine.generate([prompt], PARAMS, lora=lora)
        cached.append(out.metrics.num_cached_tokens)
    # Each first run of a model computes every block; a second run of one reads them back.
    assert cached[0] == 0 and cached[1] == 0 and cached[3] == 0
    assert cached[2] > 0 and cached[4] == cached[2]


def test_adapters_load_and_unload_under_the_budget(tiny_model: Path,
                                                   adapters: dict[str, Path]) -> None:
    engine = _engine(tiny_model, adapters)
    manager = engine.lora
    assert manager is not None
    sizes = {name: w.nbytes for name, w in manager.resident.items()}
    assert set(sizes) == set(adapters)  # 1 GiB holds all three
    # A budget with room for the two largest but not all three.
    budget = sum(sorted(sizes.values())[1:])
    engine = _engine(tiny_model, adapters, lora_memory_bytes=budget)
    manager = engine.lora
    assert manager is not None and len(manager.resident) == 2
    assert manager.resident_bytes <= budget
    prompts = [[7, 8, 9, 10, 11]] * 3
    alone = {n: engine.generate(prompts[:1], PARAMS, lora=n)[0].outputs[0].token_ids
             for n in adapters}
    assert manager.resident_bytes <= budget
    assert list(manager.resident)[-1] == "all16"  # least recently used first
    # The three at once: the third waits until one of the others finishes, then loads (LRU)
    # and still gives its own tokens.
    loads = manager.num_loads
    outs = engine.generate(prompts, PARAMS, lora=list(adapters))
    assert [o.outputs[0].token_ids for o in outs] == [alone[n] for n in adapters]
    assert manager.num_loads > loads
    assert manager.resident_bytes <= budget
    assert all(count == 0 for count in manager.pins.values())


def test_unknown_adapter_fails_alone(tiny_model: Path, adapters: dict[str, Path]) -> None:
    engine = _engine(tiny_model, adapters)
    outs = engine.generate([[1, 2, 3], [1, 2, 3]], PARAMS, lora=["nope", "attn8"])
    assert outs[0].error is not None and "unknown LoRA adapter 'nope'" in outs[0].error
    assert outs[0].error.endswith("(served: attn8, mlp16, all16)")
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == NUM_NEW
    plain = LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=64))
    (out,) = plain.generate([[1, 2, 3]], PARAMS, lora="attn8")
    assert out.error == "unknown LoRA adapter 'attn8': this engine serves none"


def test_adapter_larger_than_the_budget_is_refused_at_start(tiny_model: Path,
                                                            adapters: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"LoRA adapter 'mlp16' needs \d+ bytes, over "
                                         r"lora_memory_bytes=1000"):
        _engine(tiny_model, {"mlp16": adapters["mlp16"]}, lora_memory_bytes=1000)


def test_adapter_config_refusals(tmp_path: Path) -> None:
    good = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["v_proj", "q_proj"]}
    config = LoRAConfig.of(good)
    assert config.target_modules == ("q_proj", "v_proj") and config.scaling == 2.0
    assert LoRAConfig.of({**good, "use_rslora": True}).scaling == 16 / 8**0.5
    cases = [
        ({"use_dora": True}, "use_dora is not supported"),
        ({"bias": "all"}, "bias 'all' is not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save is not supported"),
        ({"r": 0}, "r must be a positive integer, got 0"),
        ({"target_modules": ["embed_tokens"]}, "target_modules ['embed_tokens'] are not"),
        ({"target_modules": "q_proj|v_proj"}, "target_modules must be a list"),
        ({"peft_type": "IA3"}, "peft_type 'IA3' is not LORA"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=None) as info:
            LoRAConfig.of({**good, **change})
        assert message in str(info.value)
    with pytest.raises(ValueError, match=r"adapter_config\.json not found"):
        LoRAConfig.read(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps(good))
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors not found"):
        LoRAConfig.read(tmp_path)


def test_names_jobs_use() -> None:
    assert served_names("tiny", ["a", "b"]) == ["tiny", "a", "tiny:a", "b", "tiny:b"]
    assert adapter_of("tiny", "tiny", ["a"]) is None
    assert adapter_of("a", "tiny", ["a"]) == "a"
    assert adapter_of("tiny:a", "tiny", ["a"]) == "a"
    with pytest.raises(ValueError, match="unknown model 'tiny:c': this worker serves tiny, a"):
        adapter_of("tiny:c", "tiny", ["a"])
    assert parse_lora_flags(["x=/a", "y=/b"]) == (LoRASpec("x", "/a"), LoRASpec("y", "/b"))
    for bad, message in (("x", "--lora takes NAME=DIR"), ("=/a", "--lora takes NAME=DIR"),
                         ("a b=/x", "must match")):
        with pytest.raises(ValueError, match=message):
            parse_lora_flags([bad])
    with pytest.raises(ValueError, match="given more than once: x"):
        parse_lora_flags(["x=/a", "x=/b"])
