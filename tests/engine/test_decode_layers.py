"""A decode step's layers in one C call (``kernels.native.DecodeLayers``) against the
layer-by-layer path: the same logprobs bit for bit, and taken exactly where it applies."""

from __future__ import annotations

import ctypes
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models.llama import LlamaForCausalLM
from engine.testing import make_random_adapter
from kernels import native
from kernels.lora import LoRASlots, c_max_rows

NUM_NEW = 12


def _generate(model_dir: Path, dtype: str, num_prompts: int, one_call: bool,
              shared_prefix: int = 0, adapters: dict[str, Path] | None = None,
              quantization: str | None = None) -> tuple[list, int, LlamaForCausalLM]:
    """Greedy outputs with logprobs, how many steps ran as one C call, and the model. With
    ``adapters``, the prompts take the base model and each adapter in turn."""
    # every prompt prefilled in one step and none preempted, so that the batch decodes and
    # finishes together (194 of 5 to 140 tokens where packed bf16 takes 192 rows)
    lora = tuple(f"{name}={path}" for name, path in (adapters or {}).items())
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, num_kv_blocks=4096,
                                    max_num_batched_tokens=16384, lora=lora,
                                    quantization=quantization))
    model = engine.runner.model
    assert isinstance(model, LlamaForCausalLM)
    calls = 0
    decide = model._in_one_call

    def counted(*args: object) -> bool:
        nonlocal calls
        taken = one_call and decide(*args)  # type: ignore[arg-type]
        calls += taken
        return taken

    model._in_one_call = counted  # type: ignore[method-assign]
    rng = random.Random(3)
    prefix = [rng.randrange(200) for _ in range(shared_prefix)]
    prompts = [prefix + [rng.randrange(200) for _ in range(5 + 9 * (i % 16))]
               for i in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW, logprobs=5)
    names = [None, *(adapters or {})]
    return (engine.generate(prompts, params, lora=[names[i % len(names)] for i in
                                                   range(num_prompts)]), calls, model)


def _logprobs(outputs: list) -> list[list[tuple[int, float]]]:
    return [[(t, lp) for step in o.outputs[0].logprobs for t, lp in step.items()]
            for o in outputs]


# The C linear's most rows: bf16 96 (dot), 32 (AMX tiles), 5 or 24; float32 64 (AVX-512) or 32;
# on the packed GEMMs both every row count (AVX2's) or 128 and 256 (AVX-512's), where these
# tests run 40 (past their 24). The one call on bf16 weights packed for the dot product (where
# this CPU packs them, and these models' shapes all pack): LINEAR_MAX_ROWS_PACKED_DOT.
BOUNDED = not native.library("cpu_linear").linear_packed_from()
BF16_ROWS = ((native.LINEAR_MAX_ROWS_PACKED_DOT if native.packs_bf16()
              else native.linear_max_rows(torch.bfloat16)) if BOUNDED else 40)
F32_ROWS = native.linear_max_rows(torch.float32) if BOUNDED else 40
LORA_ROWS = min(F32_ROWS, c_max_rows(torch.float32))  # float32 adapted rows lora_add takes


@pytest.fixture
def packed_limit(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Where a packed GEMM takes the most rows, a limit of 40 rows (BF16_ROWS, F32_ROWS), so
    that steps past it still go layer by layer (elsewhere nothing reads it)."""
    monkeypatch.setattr(native, "LINEAR_MAX_ROWS_PACKED", 40)
    monkeypatch.setattr(native, "LINEAR_MAX_ROWS_PACKED_AVX512",
                        dict.fromkeys(native.LINEAR_MAX_ROWS_PACKED_AVX512, 40))
    native.linear_max_rows.cache_clear()
    yield
    native.linear_max_rows.cache_clear()  # the real limit computed again once restored


@pytest.mark.parametrize(("model_name", "dtype", "num_prompts", "shared_prefix"), [
    ("llama-gqa3-hd10", "float32", 8, 0),  # head_dim 10: the kernels' padded width
    ("qwen2-bias", "float32", 3, 0),  # the qkv bias
    ("qwen2-bias", "bfloat16", 2, 0),  # its float32 copy
    ("llama-gqa8-tied", "bfloat16", BF16_ROWS, 0),  # as many rows as bf16 takes
    ("llama-gqa8-tied", "float32", F32_ROWS, 0),  # as many rows as float32 takes
    ("mistral-sharded", "bfloat16", 1, 0),  # a lone request
    ("qwen3-sharded", "float32", 3, 0),  # per-head q/k norms
    ("qwen3-sharded", "bfloat16", 2, 0),
    # a prefix cheap enough to read per row: no cascade, so one call (not torch's attention)
    ("llama-gqa3-hd10", "float32", 2, 64),
])
def test_one_call_matches_layer_by_layer(tiny_models: dict[str, Path], model_name: str,
                                         dtype: str, num_prompts: int,
                                         shared_prefix: int) -> None:
    model_dir = tiny_models[model_name]
    ours, calls, _ = _generate(model_dir, dtype, num_prompts, True, shared_prefix)
    theirs, _, reference = _generate(model_dir, dtype, num_prompts, False, shared_prefix)
    assert calls >= NUM_NEW - 1  # every decode step of the batch
    assert reference._decode_layers is None  # the reference never ran it
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
    assert _logprobs(ours) == _logprobs(theirs)  # exact: the same kernels on the same values


@pytest.mark.parametrize(("dtype", "quantization", "num_prompts"), [
    ("float32", None, 7), ("bfloat16", None, 7), ("bfloat16", "int8", 7),  # int8: bf16 adapters
    ("float32", None, LORA_ROWS)])  # as many rows as the C kernel takes adapted
def test_one_call_with_adapters_matches_layer_by_layer(
        tiny_models: dict[str, Path], tmp_path: Path, dtype: str, quantization: str | None,
        num_prompts: int, packed_limit: None) -> None:
    # rows of the base model and of two adapters interleaved: one adapting every projection,
    # one only q (a part of the fused qkv) and down (no pair in the o and gate_up tables)
    model_dir = tiny_models["llama-gqa3-hd10"]
    adapters = {"every": make_random_adapter(model_dir, tmp_path / "every", 8, seed=1),
                "some": make_random_adapter(model_dir, tmp_path / "some", 4, seed=2,
                                            targets=("q_proj", "down_proj"))}
    ours, calls, _ = _generate(model_dir, dtype, num_prompts, True, adapters=adapters,
                               quantization=quantization)
    theirs, _, reference = _generate(model_dir, dtype, num_prompts, False, adapters=adapters,
                                     quantization=quantization)
    base, _, _ = _generate(model_dir, dtype, num_prompts, True, quantization=quantization)
    assert calls >= NUM_NEW - 1
    assert reference._decode_layers is None
    assert _logprobs(ours) == _logprobs(theirs)
    mine = _logprobs(ours)
    assert all(mine[i] != _logprobs(base)[i] for i in range(num_prompts) if i % 3)  # adapted
    assert all(mine[i] == _logprobs(base)[i] for i in range(num_prompts) if i % 3 == 0)


def test_adapted_steps_take_one_call_where_the_lora_kernel_does(
        tiny_models: dict[str, Path], tmp_path: Path, packed_limit: None) -> None:
    # as many adapted rows as lora_add takes, not one more; an adapter of q and down only
    # leaves the o and gate_up projections' tables without adapters, which do not stop it
    model_dir = tiny_models["llama-mha"]
    adapters = {"some": make_random_adapter(model_dir, tmp_path / "some", 8, seed=1,
                                            targets=("q_proj", "down_proj"))}
    _, calls, model = _generate(model_dir, "float32", 2, True, adapters=adapters)
    assert calls >= NUM_NEW - 1
    assert model._adapters_in_c(LORA_ROWS) and not model._adapters_in_c(LORA_ROWS + 1)
    # the projections' holders replaced (another LoRA manager on the model): the one call's
    # table addresses follow them, not the old tables'
    old = [p.lora.table for p in model.int8_linears()]
    for p in model.int8_linears():
        setattr(p, "lora", LoRASlots(list(p.lora.weights)))  # noqa: B010
    assert model._adapters_in_c(1)
    assert model._lora_tables is not None
    tables = [ctypes.addressof(p.lora.table) for p in model.int8_linears()]
    assert list(model._lora_tables[1]) == tables
    assert not {ctypes.addressof(t) for t in old} & set(tables)


def test_moving_the_model_drops_the_weights_addresses(tiny_models: dict[str, Path]) -> None:
    _, calls, model = _generate(tiny_models["llama-mha"], "float32", 2, one_call=True)
    assert calls > 0 and model._decode_layers is not None
    model.to("cpu")  # any .to() / .float() may give the weights new storage
    assert model._decode_layers is None


@pytest.mark.parametrize(("model_name", "dtype", "num_prompts", "shared_prefix"), [
    ("llama-gqa8-tied", "bfloat16", BF16_ROWS + 2, 0),  # more rows than bf16 takes
    ("llama-gqa8-tied", "float32", F32_ROWS + 2, 0),  # more rows than float32 takes
    # a prefix too long to read per row (7 x 160 tokens of KV > a quarter of the weights):
    # cascade, which torch attends
    ("llama-gqa3-hd10", "float32", 8, 160),
])
def test_layer_by_layer_where_one_call_does_not_apply(
        tiny_models: dict[str, Path], model_name: str, dtype: str, num_prompts: int,
        shared_prefix: int, packed_limit: None) -> None:
    outputs, calls, _ = _generate(tiny_models[model_name], dtype, num_prompts, one_call=True,
                                  shared_prefix=shared_prefix)
    assert all(len(o.token_ids) == NUM_NEW for o in outputs)
    # only the last steps, once enough of the batch has finished, could qualify; here none
    # does: the batch finishes together
    assert calls == 0


def test_decode_layers_refuses_what_it_cannot_run() -> None:
    hidden, heads, kv_heads, head_dim, inter = 32, 4, 2, 8, 48
    qkv = (heads + 2 * kv_heads) * head_dim

    def weights(dtype: torch.dtype) -> native.LayerWeights:
        def t(*shape: int) -> torch.Tensor:
            return torch.randn(*shape).to(dtype)

        return native.LayerWeights(t(hidden), t(qkv, hidden), None, t(hidden, heads * head_dim),
                                   t(hidden), t(2 * inter, hidden), t(hidden, inter))

    with pytest.raises(TypeError, match="float16"):
        native.DecodeLayers([weights(torch.float16)], heads, kv_heads, head_dim, 1e-5, 0.3)
    norm = torch.ones(head_dim, dtype=torch.bfloat16)
    normed = replace(weights(torch.bfloat16), head_norms=(norm, norm))
    for layers, match in (
            ([normed, weights(torch.bfloat16)], "per-head q/k norms"),  # one layer without
            ([replace(normed, head_norms=(torch.ones(head_dim + 1, dtype=torch.bfloat16),) * 2)],
             "per-head q/k norms"),
            ([replace(normed, head_norms=(torch.ones(head_dim),) * 2)], "one dtype")):
        with pytest.raises(ValueError, match=match):
            native.DecodeLayers(layers, heads, kv_heads, head_dim, 1e-5, 0.3)
    assert native.DecodeLayers([normed] * 2, heads, kv_heads, head_dim, 1e-5, 0.3).num_layers == 2
    layers = native.DecodeLayers([weights(torch.bfloat16)], heads, kv_heads, head_dim, 1e-5,
                                 0.3)
    assert layers.max_rows == native.linear_max_rows(torch.bfloat16)
    layers.max_rows = 3  # a limit tensors can pass (AVX2's packed GEMM's is every row count)
    rows = layers.max_rows + 1
    kv = torch.zeros(1, 2, 4, 8, kv_heads, head_dim, dtype=torch.bfloat16)
    rope = (torch.ones(rows, head_dim, dtype=torch.bfloat16),) * 2
    with pytest.raises(ValueError, match="up to"):
        layers(torch.zeros(rows, hidden, dtype=torch.bfloat16), rope, kv,
               torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, 1, dtype=torch.int32),
               torch.ones(rows, dtype=torch.int32))
    with pytest.raises(ValueError, match="2 KV caches for 1 layers"):
        layers(torch.zeros(1, hidden, dtype=torch.bfloat16), (rope[0][:1], rope[1][:1]),
               kv.expand(2, -1, -1, -1, -1, -1).contiguous(),
               torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int32),
               torch.ones(1, dtype=torch.int32))
    # adapters: four tables a layer and the rows' int32 slots, else refused before the C call
    table = native.LoRATable()
    for tables, slots in ((native.lora_tables([table] * 3), torch.zeros(1, dtype=torch.int32)),
                          (native.lora_tables([table] * 4), torch.zeros(1, dtype=torch.int64)),
                          (native.lora_tables([table] * 4), torch.zeros(2, dtype=torch.int32))):
        with pytest.raises(ValueError, match="4 adapter tables a layer"):
            layers(torch.zeros(1, hidden, dtype=torch.bfloat16), (rope[0][:1], rope[1][:1]), kv,
                   torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int32),
                   torch.ones(1, dtype=torch.int32), (tables, slots))
