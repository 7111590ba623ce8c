"""An engine whose bf16 projections are packed for the CPU's dot product
(``LlamaForCausalLM.pack_weights``) against the same model unpacked: the same weights, the same
greedy tokens and logprobs to within bf16's rounding, and one decode call as its layer-by-layer
path. Packing is forced where this CPU would not pack (``kernels.native.packs_bf16``): the C
linear's portable sums then read the packed weights, so that every machine runs these."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models.llama import LlamaForCausalLM
from engine.testing import make_random_adapter, make_tiny_model
from kernels import native


def _engine(model_dir: Path, pack: bool | None, **config: object) -> LLMEngine:
    """A bf16 engine, packing as ``pack`` says (None: the default)."""
    if pack is not None:
        config["pack_cpu_weights"] = pack
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="bfloat16", num_kv_blocks=512,
                                  **config))  # type: ignore[arg-type]


def _model(engine: LLMEngine) -> LlamaForCausalLM:
    model = engine.runner.model
    assert isinstance(model, LlamaForCausalLM)
    return model


@pytest.fixture
def packs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "packs_bf16", lambda: True)


PROMPTS = [[5 + i, 17, 3 * i + 1, 40, 2, 9][: 3 + i % 4] for i in range(6)]


@pytest.mark.parametrize("model_name", ["llama-gqa8-tied", "qwen2-bias", "qwen3-sharded"])
def test_packed_engine_matches_the_unpacked_one(tiny_models: dict[str, Path], model_name: str,
                                                packs: None) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logprobs=3)
    weights, outputs = {}, {}
    for pack in (True, False):
        engine = _engine(tiny_models[model_name], pack)
        projections = [p.weight for p in _model(engine).int8_linears()]
        assert all(native.is_packed(w) == pack for w in projections)
        weights[pack] = [native.unpack_bf16(w) if pack else w for w in projections]
        outputs[pack] = engine.generate(PROMPTS, params)
    assert all(torch.equal(a, b) for a, b in zip(weights[True], weights[False], strict=True))
    for ours, theirs in zip(outputs[True], outputs[False], strict=True):
        # the first token's logprobs: the same prompt, sums in another order
        first, reference = ours.outputs[0].logprobs[0], theirs.outputs[0].logprobs[0]
        assert first.keys() == reference.keys()
        assert all(abs(first[t] - reference[t]) < 0.05 for t in first)
        assert ours.token_ids[0] == theirs.token_ids[0]


@pytest.fixture(scope="module")
def padded_vocab(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny models of 288 tokens, nine whole blocks (the tokenizer's 259 do not make whole
    blocks), as real vocabularies are, so their lm_heads pack: tied, untied, and tied with
    projections that do not pack (a qkv of 100 rows)."""
    root = tmp_path_factory.mktemp("padded-vocab")
    shapes = {"tied": dict(hidden_size=64, num_heads=4, num_kv_heads=2, tie_word_embeddings=True),
              "untied": dict(hidden_size=64, num_heads=4, num_kv_heads=2),
              "tied-hd10": dict(hidden_size=60, num_heads=6, num_kv_heads=2, head_dim=10,
                                tie_word_embeddings=True)}
    return {name: make_tiny_model(root / name, vocab_size=288, **kw)  # type: ignore[arg-type]
            for name, kw in shapes.items()}


@pytest.mark.parametrize("tied", [True, False])
def test_the_lm_head_packs_and_tied_embeddings_read_the_packed_table(
        padded_vocab: dict[str, Path], tied: bool, packs: None) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logprobs=3)
    engines = {pack: _engine(padded_vocab["tied" if tied else "untied"], pack)
               for pack in (True, False)}
    model, reference = _model(engines[True]), _model(engines[False])
    table = reference.embed_tokens.weight
    if tied:
        head, ref_head = model.embed_tokens.weight, table
    else:
        assert model.lm_head is not None and reference.lm_head is not None
        head, ref_head = model.lm_head.weight, reference.lm_head.weight
        assert torch.equal(model.embed_tokens.weight, table)  # only the lm_head packs
    assert native.is_packed(head) and torch.equal(native.unpack_bf16(head), ref_head)
    ids = torch.tensor([0, 31, 32, 287, 5, 5, 100])  # a block's first and last lanes, repeats
    assert torch.equal(model.embed(ids), table[ids])
    assert model.dtype == reference.dtype == torch.bfloat16
    ours, theirs = engines[True].generate(PROMPTS, params), engines[False].generate(PROMPTS, params)
    for a, b in zip(ours, theirs, strict=True):  # the lm_head's sums in another order
        first, expected = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert first.keys() == expected.keys()
        assert all(abs(first[t] - expected[t]) < 0.05 for t in first)
        assert a.token_ids[0] == b.token_ids[0]


def test_adapters_on_a_packed_model(padded_vocab: dict[str, Path], packs: None,
                                    tmp_path: Path) -> None:
    # an adapter's tables take the model's dtype (its norms'), not the packed table's int32
    model_dir = padded_vocab["tied"]
    adapter = make_random_adapter(model_dir, tmp_path / "adapter", rank=4, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4, logprobs=3)
    adapted = {pack: _engine(model_dir, pack, lora=(f"a={adapter}",)).generate(
        PROMPTS, params, lora="a") for pack in (True, False)}
    plain = _engine(model_dir, True).generate(PROMPTS, params)
    for ours, theirs in zip(adapted[True], adapted[False], strict=True):
        first, expected = ours.outputs[0].logprobs[0], theirs.outputs[0].logprobs[0]
        assert first.keys() == expected.keys()
        assert all(abs(first[t] - expected[t]) < 0.05 for t in first)
    assert any(a.outputs[0].logprobs[0] != b.outputs[0].logprobs[0]  # the adapter shows
               for a, b in zip(adapted[True], plain, strict=True))


def test_packed_decode_steps_take_one_call(tiny_models: dict[str, Path], packs: None) -> None:
    engine = _engine(tiny_models["llama-mha"], None)  # packing is the default
    model = _model(engine)
    reference = _engine(tiny_models["llama-mha"], True)
    _model(reference)._in_one_call = lambda *args: False  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6, logprobs=3)
    ours, theirs = engine.generate(PROMPTS, params), reference.generate(PROMPTS, params)
    assert model._decode_layers is not None and model._decode_layers.packed
    assert model.one_call_rows() == native.LINEAR_MAX_ROWS_PACKED_DOT
    assert model._decode_layers.max_rows == native.LINEAR_MAX_ROWS_PACKED_DOT
    assert [o.outputs[0].logprobs for o in ours] == [o.outputs[0].logprobs for o in theirs]


def test_what_is_not_packed(tiny_models: dict[str, Path], padded_vocab: dict[str, Path],
                            packs: None) -> None:
    # head_dim 10 x 10 heads: a qkv of 100 rows, not whole blocks of 32, so no projection is
    # (one decode call takes all four packed or none), nor the lm_head; int8 weights and
    # float32 ones neither
    not_whole = _model(_engine(tiny_models["llama-gqa3-hd10"], True))
    assert not any(native.is_packed(p.weight) for p in not_whole.int8_linears())
    assert not not_whole.pack_weights()
    head_too = _model(_engine(padded_vocab["tied-hd10"], True))  # a table of whole blocks
    assert not native.is_packed(head_too.embed_tokens.weight)
    assert not any(native.is_packed(p.weight) for p in head_too.int8_linears())
    # the projections pack, the table of 259 rows (not whole blocks) stays as it is
    tied = _model(_engine(tiny_models["llama-gqa8-tied"], True))
    assert all(native.is_packed(p.weight) for p in tied.int8_linears())
    assert tied.embed_tokens.weight.dtype == torch.bfloat16
    quantized = _model(_engine(tiny_models["llama-mha"], True, quantization="int8"))
    assert all(p.weight.dtype == torch.int8 for p in quantized.int8_linears())
    wide = _model(LLMEngine(EngineConfig(model=str(tiny_models["llama-mha"]), dtype="float32",
                                         num_kv_blocks=512)))
    assert all(p.weight.dtype == torch.float32 for p in wide.int8_linears())
    # torch's ops (F.linear) read the weights as rows: never packed there
    unfused = _engine(tiny_models["llama-mha"], True, attention_backend="torch")
    assert not any(native.is_packed(p.weight) for p in _model(unfused).int8_linears())
    (out,) = unfused.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=2))
    assert len(out.token_ids) == 2


def test_benchmarks_count_a_packed_models_parameters_as_unpacked(
        tiny_models: dict[str, Path], packs: None) -> None:
    # bench.throughput.model_shape (the FLOPs of bench.realsize's ceiling) reads the weights
    from bench.throughput import model_shape

    shapes = [model_shape(_engine(tiny_models["llama-mha"], pack)) for pack in (True, False)]
    assert shapes[0] == shapes[1]
    # 2 layers of qkv, o, gate_up, down and 2 norms, then the final norm
    assert shapes[0].params_per_token == 2 * (192 * 64 + 64 * 64 + 192 * 64 + 64 * 96 + 2 * 64) + 64


def test_one_decode_call_takes_every_projection_packed_or_none() -> None:
    hidden, heads, kv_heads, head_dim, inter = 64, 4, 2, 16, 96
    qkv = (heads + 2 * kv_heads) * head_dim

    def layer(pack: bool) -> native.LayerWeights:
        def w(*shape: int) -> torch.Tensor:
            t = torch.randn(*shape).to(torch.bfloat16)
            return native.pack_bf16(t) if pack and len(shape) == 2 else t

        return native.LayerWeights(w(hidden), w(qkv, hidden), None, w(hidden, heads * head_dim),
                                   w(hidden), w(2 * inter, hidden), w(hidden, inter))

    assert native.DecodeLayers([layer(True)] * 2, heads, kv_heads, head_dim, 1e-5, 0.3).packed
    assert not native.DecodeLayers([layer(False)], heads, kv_heads, head_dim, 1e-5, 0.3).packed
    with pytest.raises(ValueError, match="all bf16 ones packed"):
        native.DecodeLayers([layer(True), layer(False)], heads, kv_heads, head_dim, 1e-5, 0.3)
    packed = layer(True)  # a packed model whose norms went float32 (model.float())
    wide = native.LayerWeights(packed.input_norm.float(), packed.qkv, None, packed.o,
                               packed.post_norm.float(), packed.gate_up, packed.down)
    with pytest.raises(ValueError, match="packed bf16 projections in a bf16 model"):
        native.DecodeLayers([wide], heads, kv_heads, head_dim, 1e-5, 0.3)
