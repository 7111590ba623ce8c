"""``quantization="int8"``: the engine on tiny random models against the torch reference path
(same quantized weights) and against float32; the weights the model holds; the config's and the
flag's way in; GGUF ``Q8_0`` projections loaded as int8 as they are stored."""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from engine import EngineConfig, LLMEngine
from engine.models import loader
from engine.models.llama import LlamaForCausalLM
from engine.sampling_params import SamplingParams
from kernels import get_ops, int8, native
from worker.settings import add_settings_arguments, settings_from_args

PROMPTS = ["hello world", "the cat sat on the mat", "abc def ghi jkl mno", "x", "0123456789"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3)
PER_CHANNEL_ROWS = native.linear_int8_max_rows(0)


def _generate(model: Path, **kw: object) -> list:
    engine = LLMEngine(EngineConfig(model=str(model), **kw))  # type: ignore[arg-type]
    return engine.generate(PROMPTS, GREEDY)


@pytest.mark.parametrize("name", ["llama-gqa3-hd10", "qwen2-bias", "llama-gqa8-tied"])
def test_cpu_kernels_give_the_torch_reference_paths_tokens(tiny_models: dict[str, Path],
                                                           name: str) -> None:
    # The torch backend runs kernels.int8.linear_reference on the same quantized weights. The
    # C kernel's decode steps (VNNI, per-channel scales) round each x row to int16 fixed
    # point: ~1e-4 of a row's largest value, which moves logprobs by ~1e-4 here.
    cpu = _generate(tiny_models[name], dtype="float32", quantization="int8")
    ref = _generate(tiny_models[name], dtype="float32", quantization="int8",
                    attention_backend="torch")
    for c, r in zip(cpu, ref, strict=True):
        assert c.token_ids == r.token_ids
        for lc, lr in zip(c.outputs[0].logprobs, r.outputs[0].logprobs, strict=True):
            assert lc.keys() == lr.keys()
            assert all(abs(lc[t] - lr[t]) < 1e-3 for t in lc)


@pytest.mark.parametrize(("name", "dtype", "group", "num_prompts"), [
    ("qwen2-bias", "float32", None, 3),  # the qkv bias
    ("llama-gqa8-tied", "bfloat16", None, 1),  # a lone request
    ("qwen3-sharded", "bfloat16", 32, 2),  # per-head q/k norms
    ("llama-mha", "bfloat16", 32, native.linear_int8_max_rows(32)),  # Q8_0's groups, most rows
    # per channel, most rows (the packed GEMM has no limit, the columns 1024: 80, past their
    # 12 and 32)
    ("llama-mha", "float32", None, PER_CHANNEL_ROWS if PER_CHANNEL_ROWS <= 512 else 80),
])
def test_one_call_decode_matches_layer_by_layer(tiny_models: dict[str, Path], name: str,
                                                dtype: str, group: int | None,
                                                num_prompts: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # The decode step's layers in one C call (cpu_step.c) take the int8 kernel for the
    # projections: the same logprobs, bit for bit, as the layer-by-layer path.
    empty = LlamaForCausalLM.empty.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(LlamaForCausalLM, "empty", classmethod(
        lambda cls, *a, **kw: empty(cls, *a, **kw, int8_group=group)))
    outs, calls = {}, {}
    for one_call in (True, False):
        engine = LLMEngine(EngineConfig(model=str(tiny_models[name]), dtype=dtype,
                                        quantization="int8"))
        model = engine.runner.model
        assert model.layers[0].mlp.down_proj.weight_scale.shape[1] == (
            1 if group is None else 96 // group)
        decide, calls[one_call] = model._in_one_call, 0

        def counted(*args: object, decide=decide, one_call=one_call) -> bool:
            taken = one_call and decide(*args)
            calls[one_call] += taken
            return taken

        model._in_one_call = counted  # type: ignore[method-assign]
        outs[one_call] = engine.generate((PROMPTS * 13)[:num_prompts], GREEDY)
    assert calls[True] >= GREEDY.max_tokens - 1 and calls[False] == 0
    for a, b in zip(outs[True], outs[False], strict=True):
        assert a.token_ids == b.token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_int8_is_close_to_float32_and_not_equal(tiny_model: Path) -> None:
    fp32 = _generate(tiny_model, dtype="float32")
    q8 = _generate(tiny_model, dtype="float32", quantization="int8")
    differences = []
    for f, q in zip(fp32, q8, strict=True):
        first_f, first_q = f.outputs[0].logprobs[0], q.outputs[0].logprobs[0]
        assert f.token_ids[0] == q.token_ids[0]  # the prompt's own next token agrees
        differences += [abs(first_f[t] - first_q[t]) for t in first_f.keys() & first_q.keys()]
    assert max(differences) < 0.05  # per-channel int8 of weights ~N(0, 0.1)
    assert max(differences) > 0  # ... and the int8 weights did run


def test_projections_hold_int8_and_the_rest_stays_float(tiny_models: dict[str, Path]) -> None:
    path = tiny_models["qwen2-bias"]  # a q/k/v bias too, which stays float
    model = LlamaForCausalLM.empty(loader.load_config(path), get_ops("cpu"), 64,
                                   torch.device("cpu"), torch.bfloat16, "int8")
    model.load_weights(loader.iter_safetensors(path))
    checkpoint = dict(loader.iter_safetensors(path))
    for i, layer in enumerate(model.layers):
        for linear, parts in ((layer.self_attn.qkv_proj, ("q_proj", "k_proj", "v_proj")),
                              (layer.mlp.down_proj, ("down_proj",))):
            assert linear.weight.dtype == torch.int8
            assert linear.weight_scale.dtype == torch.float32
            assert linear.weight_scale.shape == (linear.weight.shape[0], 1)  # per channel
            where = "self_attn" if parts[0] != "down_proj" else "mlp"
            want = torch.cat([checkpoint[f"model.layers.{i}.{where}.{p}.weight"] for p in parts])
            got = int8.dequantize(linear.weight, linear.weight_scale)
            half_step = linear.weight_scale / 2 * (1 + 1e-6)
            assert bool(((got - want).abs() <= half_step).all())
        assert layer.self_attn.qkv_proj.bias.dtype == torch.bfloat16
        assert layer.input_layernorm.weight.dtype == torch.bfloat16
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    head = model.lm_head  # int8 too, quantized from the checkpoint's lm_head
    assert head is not None and head.weight.dtype == torch.int8
    assert bool(((int8.dequantize(head.weight, head.weight_scale) - checkpoint["lm_head.weight"])
                 .abs() <= head.weight_scale / 2 * (1 + 1e-6)).all())


def test_tied_embeddings_get_an_int8_copy_for_the_lm_head(tiny_models: dict[str, Path]) -> None:
    path = tiny_models["llama-gqa8-tied"]
    config = loader.load_config(path)
    plain = LlamaForCausalLM.empty(config, get_ops("cpu"), 64, torch.device("cpu"),
                                   torch.float32)
    assert plain.lm_head is None  # tied and not int8: the table multiplies
    model = LlamaForCausalLM.empty(config, get_ops("cpu"), 64, torch.device("cpu"),
                                   torch.float32, "int8")
    model.load_weights(loader.iter_safetensors(path))
    table = dict(loader.iter_safetensors(path))["model.embed_tokens.weight"]
    assert torch.equal(model.embed_tokens.weight, table)  # the lookup reads the float table
    head = model.lm_head
    assert head is not None and head.weight.dtype == torch.int8
    q, scale = int8.quantize(table)
    assert torch.equal(head.weight, q) and torch.equal(head.weight_scale, scale)
    hidden = torch.randn(3, table.shape[1])
    torch.testing.assert_close(model.compute_logits(hidden),
                               int8.linear_reference(hidden, q, scale), rtol=0, atol=1e-3)


def test_an_unknown_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown quantization"):
        LlamaForCausalLM.empty(None, get_ops("cpu"), 8, torch.device("cpu"),  # type: ignore
                               torch.float32, "fp8")


def test_the_flag_reaches_the_engine(tiny_model: Path) -> None:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    settings = settings_from_args(parser.parse_args(
        ["--model", str(tiny_model), "--quantization", "int8", "--dtype", "float32"]))
    assert settings.engine.quantization == "int8"
    engine = LLMEngine(settings.engine)
    assert engine.runner.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.int8
    default = settings_from_args(parser.parse_args(["--model", str(tiny_model)]))
    assert default.engine.quantization is None


def _write_q8_0_gguf(model_dir: Path, out: Path) -> None:
    """The tiny model as llama.cpp's converter writes it: llama.cpp names, q and k rows
    permuted for its RoPE, projections and embeddings Q8_0, norms float32."""
    config = loader.load_config(model_dir)
    hf_to_gguf = {v: k for k, v in loader.GGUF_GLOBALS.items()}
    parts = {**loader.GGUF_PROJECTIONS, **loader.GGUF_OTHERS}
    writer = gguf.GGUFWriter(str(out), "llama")
    for name, tensor in loader.iter_safetensors(model_dir):
        if name in hf_to_gguf:
            gguf_name = hf_to_gguf[name]
        else:
            layer, target = name.split(".")[2], ".".join(name.split(".")[3:-1])
            kind = next(k for k, v in parts.items() if v == target)
            gguf_name = f"blk.{layer}.{kind}.weight"
        data = tensor.float().numpy()
        heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
        kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else None
        if kind in heads:  # convert_hf_to_gguf's permute
            n = heads[kind]
            data = (data.reshape(n, 2, data.shape[0] // n // 2, *data.shape[1:])
                    .swapaxes(1, 2).reshape(data.shape))
        if data.ndim == 2:
            writer.add_tensor(gguf_name, quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_q8_0_loads_as_int8_with_its_own_blocks(tiny_models: dict[str, Path],
                                                     tmp_path: Path) -> None:
    model_dir = tiny_models["llama-mha"]  # hidden 64, intermediate 96: whole Q8_0 blocks
    path = tmp_path / "tiny.Q8_0.gguf"
    _write_q8_0_gguf(model_dir, path)
    config = loader.load_config(model_dir)
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}

    model = LlamaForCausalLM.empty(config, get_ops("cpu"), 64, torch.device("cpu"),
                                   torch.float32, "int8", int8_group=32)
    model.load_weights(loader.iter_gguf(path, config, int8=True))
    floats = dict(loader.iter_gguf(path, config, int8=False))
    checkpoint = dict(loader.iter_safetensors(model_dir))
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    assert attn.qkv_proj.weight.dtype == torch.int8 and attn.qkv_proj.weight_scale.shape[1] == 2
    # The int8 values and fp16 scales are the file's, bit for bit: gguf's own dequantization of
    # the gate rows (not permuted) is q * scale exactly.
    gate = torch.from_numpy(dequantize(stored["blk.1.ffn_gate.weight"].data,
                                       gguf.GGMLQuantizationType.Q8_0).copy())
    got = int8.dequantize(mlp.gate_up_proj.weight, mlp.gate_up_proj.weight_scale)
    assert torch.equal(got[:96], gate)
    # q's rows are permuted back to Hugging Face's order: the float path agrees exactly, and
    # both are within about half a Q8_0 step of the original checkpoint's q_proj (a rounded
    # row would be off by a whole step or more somewhere; the step's own fp16 rounding adds
    # up to 127 * 2^-11 of it).
    q_rows = int8.dequantize(attn.qkv_proj.weight, attn.qkv_proj.weight_scale)[:64]
    assert torch.equal(q_rows, floats["model.layers.1.self_attn.q_proj.weight"])
    original = checkpoint["model.layers.1.self_attn.q_proj.weight"]
    step = attn.qkv_proj.weight_scale[:64].repeat_interleave(32, dim=1)
    assert bool(((q_rows - original).abs() <= step * 0.57).all())
    # Embeddings and norms come as floats (dequantized Q8_0 / float32 as stored).
    assert model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(model.norm.weight, checkpoint["model.norm.weight"])

    # A float model loads the same values from the same file (the Q8_0 blocks dequantized).
    reference = LlamaForCausalLM.empty(config, get_ops("torch"), 64, torch.device("cpu"),
                                       torch.float32)
    reference.load_weights(loader.iter_gguf(path, config, int8=False))
    assert torch.equal(reference.layers[1].mlp.gate_up_proj.weight[:96], gate)


@pytest.mark.slow
def test_a_gguf_file_as_the_model_runs_as_its_converted_directory() -> None:
    # The bundled SmolLM2 GGUF (Q4_1) opened directly, its tensors dequantized and quantized to
    # int8 per channel as they load, against the default model (the same GGUF converted once
    # to safetensors by transformers): the same int8 weights, so the same greedy tokens.
    import importlib.util

    spec = importlib.util.find_spec(loader.DEFAULT_GGUF_PACKAGE)
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin).parent / loader.DEFAULT_GGUF_FILE
    assert loader.gguf_path(str(path)) == path and loader.gguf_int8_group(path) is None
    outs = []
    for model in (str(path), "smollm2-135m-instruct"):
        engine = LLMEngine(EngineConfig(model=model, dtype="bfloat16", quantization="int8",
                                        kv_cache_memory_bytes=1 << 28))
        assert engine.runner.model.layers[0].mlp.down_proj.weight.dtype == torch.int8
        outs.append([o.token_ids for o in engine.generate(
            ["The capital of France is", "def fib(n):"],
            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))])
    assert outs[0] == outs[1]


def test_batch_invariant_int8_tokens_do_not_depend_on_the_batch(tiny_model: Path) -> None:
    # kernels.batch_invariant swaps the int8 linear too (the C kernel for every row count):
    # otherwise prefill rows past linear_int8_max_rows would take the dequantize + GEMM path.
    engine = LLMEngine(EngineConfig(model=str(tiny_model), dtype="bfloat16", quantization="int8",
                                    batch_invariant=True, max_num_batched_tokens=64))
    prompts = [[(7 * i + j) % 200 + 1 for j in range(5 + 3 * i)] for i in range(12)]
    alone = [engine.generate([p], GREEDY)[0] for p in prompts[:4]]
    batched = engine.generate(prompts, GREEDY)[:4]
    for a, b in zip(alone, batched, strict=True):
        assert a.token_ids == b.token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # bit for bit
