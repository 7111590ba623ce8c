"""Loading Hugging Face directories: which files hold the weights, the model built straight
into its dtype, and a one-line refusal of what cannot load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine import EngineConfig, LLMEngine
from engine.models import loader
from engine.models.llama import LlamaForCausalLM
from kernels import BACKEND_ENV, get_ops


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_shards_come_from_the_index_and_mistrals_consolidated_file_is_ignored(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    model_dir = _copy(tiny_models["mistral-sharded"], tmp_path / "mistral")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert [f.name for f in loader.weight_files(model_dir)] == shards
    # Mistral's own format beside the Hugging Face one (other names): never read.
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)},
              model_dir / "consolidated.safetensors")
    assert "consolidated.safetensors" not in [f.name for f in loader.weight_files(model_dir)]
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=16))
    assert engine.generate([[1, 2, 3]])[0].token_ids
    # Without the index, the shards are found by name, the consolidated file still left out.
    (model_dir / "model.safetensors.index.json").unlink()
    assert [f.name for f in loader.weight_files(model_dir)] == shards


def test_an_index_naming_a_missing_shard_is_refused_by_name(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    model_dir = _copy(tiny_models["qwen3-sharded"], tmp_path / "qwen3")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (model_dir / gone).unlink()
    with pytest.raises(ValueError, match=f"not there: .*{gone}"):
        loader.weight_files(model_dir)


def test_a_directory_without_safetensors_weights_is_refused(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    model_dir = _copy(tiny_models["llama-mha"], tmp_path / "pickled")
    (model_dir / "model.safetensors").rename(model_dir / "pytorch_model.bin")
    with pytest.raises(ValueError, match="no Hugging Face safetensors weights"):
        loader.weight_files(model_dir)


def test_an_unsupported_architecture_is_named_in_one_line(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    model_dir = _copy(tiny_models["llama-mha"], tmp_path / "gemma")
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="gemma2", architectures=["Gemma2ForCausalLM"])
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=16))
    assert "'gemma2' is not supported" in str(err.value) and "\n" not in str(err.value)


def test_the_model_built_on_the_meta_device_allocates_nothing(tiny_model: Path) -> None:
    """Every parameter and the embedding's table stay on the meta device (an init or a table
    made on the host would cost its bytes before the weights arrive); only the RoPE tables are
    computed, on the host."""
    config = loader.load_config(tiny_model)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, get_ops("cpu"), 64)
    assert all(p.is_meta for p in model.parameters())
    assert [name for name, b in model.named_buffers() if not b.is_meta] == ["rotary.cos",
                                                                          "rotary.sin"]


def test_a_cpu_engine_never_imports_dynamo_or_triton(tiny_model: Path) -> None:
    """Loading and serving on the CPU leaves torch._dynamo and triton unimported: a random init
    on the meta device would import both (100 MB of a process's memory, a second of its
    start). A fresh process, since this one may have imported them for other tests."""
    script = (
        "import sys\n"
        "from engine import EngineConfig, LLMEngine\n"
        f"engine = LLMEngine(EngineConfig(model={str(tiny_model)!r}, device='cpu', "
        "num_kv_blocks=16, max_model_len=64))\n"
        "loaded = sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules)\n"
        "engine.generate([[1, 2, 3]])\n"
        "served = sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules)\n"
        "print(loaded, served)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != BACKEND_ENV}  # the CPU's own backend
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                         text=True, cwd=Path(__file__).resolve().parents[2], env=env).stdout
    assert out.splitlines()[-1] == "[] []"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_model_is_built_empty_in_its_dtype_then_filled(
    tiny_models: dict[str, Path], dtype: torch.dtype
) -> None:
    model_dir = tiny_models["qwen3-sharded"]
    config = loader.load_config(model_dir)
    model = LlamaForCausalLM.empty(config, get_ops("torch"), 64, torch.device("cpu"), dtype)
    tensors = [*model.parameters(), *model.buffers()]
    assert all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)
    model.load_weights(loader.iter_safetensors(model_dir))
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).state_dict()
    q_norm = model.layers[0].self_attn.q_norm
    assert q_norm is not None
    torch.testing.assert_close(q_norm.weight, ref["model.layers.0.self_attn.q_norm.weight"],
                               rtol=0, atol=0)
    torch.testing.assert_close(model.embed_tokens.weight, ref["model.embed_tokens.weight"],
                               rtol=0, atol=0)


def test_a_checkpoint_in_the_models_dtype_is_read_into_its_parameters(
    tiny_models: dict[str, Path]
) -> None:
    # Nothing is copied after reading: each tensor is read where the model keeps it (q/k/v and
    # gate/up into their rows of the stacked weights), so no tensor of its own is made, not
    # even for the largest (a real-size embedding table). Values as a copying load gives.
    model_dir = tiny_models["qwen3-sharded"]
    config = loader.load_config(model_dir)

    def empty(dtype: torch.dtype) -> LlamaForCausalLM:
        return LlamaForCausalLM.empty(config, get_ops("torch"), 64, torch.device("cpu"), dtype)

    model, copied = empty(torch.float32), empty(torch.float32)  # the checkpoint's dtype
    params = [*model.parameters()]
    read: list[tuple[str, torch.Tensor]] = []

    def recorded() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in loader.iter_safetensors(model_dir, into=model.weight_destination):
            read.append((name, tensor))
            yield name, tensor

    model.load_weights(recorded())
    copied.load_weights(loader.iter_safetensors(model_dir))
    assert len(read) > len(params)  # q/k/v and gate/up are each several tensors
    for name, tensor in read:
        assert any(p.data_ptr() <= tensor.data_ptr() < p.data_ptr() + p.nbytes
                   for p in params), f"{name} was read into a tensor of its own"
    for (name, got), want in zip(model.named_parameters(), copied.parameters(), strict=True):
        assert torch.equal(got, want), name
    qkv = model.layers[0].self_attn.qkv_proj.weight  # k_proj's rows: after q's
    k_proj = dict(read)["model.layers.0.self_attn.k_proj.weight"]
    assert k_proj.data_ptr() == qkv[config.num_attention_heads * model.head_dim:].data_ptr()
    # Another dtype needs a conversion, and a device's memory is not the host's: no place to
    # read into, the loader makes the tensor.
    table = ("model.embed_tokens.weight", tuple(model.embed_tokens.weight.shape), torch.float32)
    assert empty(torch.bfloat16).weight_destination(*table) is None
    on_device = LlamaForCausalLM.empty(config, get_ops("torch"), 64, torch.device("meta"),
                                       torch.float32)
    assert on_device.weight_destination(*table) is None


def test_tensors_read_as_safetensors_reads_them_and_a_truncated_file_is_refused(
    tmp_path: Path
) -> None:
    from safetensors import safe_open

    tensors = {"bf16": torch.randn(3, 5).to(torch.bfloat16), "f32": torch.randn(7),
               "i64": torch.arange(4), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
               "f16": torch.randn(2, 2, 2).to(torch.float16), "mask": torch.tensor([True, False])}
    file = tmp_path / "t.safetensors"
    save_file(tensors, file, metadata={"format": "pt"})
    ours = dict(loader.read_safetensors(file))
    with safe_open(str(file), framework="pt") as f:
        theirs = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    assert ours.keys() == theirs.keys() == tensors.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    # read into tensors it is given: the same values, in them; not into a strided view
    given = torch.empty(3, 5, dtype=torch.bfloat16)
    into = dict(loader.read_safetensors(
        file, lambda name, shape, dtype: given if name == "bf16" else None))
    assert into["bf16"] is given and torch.equal(given, theirs["bf16"])
    with pytest.raises(ValueError, match="no contiguous"):
        list(loader.read_safetensors(
            file, lambda name, shape, dtype: given.T.contiguous().T if name == "bf16" else None))
    file.write_bytes(file.read_bytes()[:-10])
    with pytest.raises(ValueError, match="does not fit its offsets"):
        list(loader.read_safetensors(file))
