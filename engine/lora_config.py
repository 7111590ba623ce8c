"""LoRA adapters as a worker is given them: names, directories, and what PEFT's
``adapter_config.json`` says. Torch-free, so settings and job routing can read it.

A worker started with ``--lora NAME=DIR`` serves the base model under its served name and each
adapter under ``NAME`` and ``<base>:NAME`` (as vLLM's ``--lora-modules``); a job names one of
them as its model (:func:`adapter_of`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target: Hugging Face's names of a Llama layer's linears.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"


@dataclass(frozen=True)
class LoRASpec:
    """One adapter: the name jobs use and the PEFT directory it loads from."""

    name: str
    path: str

    def __post_init__(self) -> None:
        if not re.fullmatch(ADAPTER_NAME_PATTERN, self.name):
            raise ValueError(f"LoRA adapter name {self.name!r} must match "
                             f"{ADAPTER_NAME_PATTERN} (letters, digits, '.', '_', '-')")

    @classmethod
    def parse(cls, text: str) -> LoRASpec:
        """``NAME=DIR`` (the ``--lora`` flag's form)."""
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora takes NAME=DIR, got {text!r}")
        return cls(name.strip(), path.strip())


@dataclass(frozen=True)
class LoRAConfig:
    """The part of PEFT's ``adapter_config.json`` the engine uses, validated.

    ``scaling`` multiplies the low-rank product: ``lora_alpha / r`` (``/ sqrt(r)`` with
    rsLoRA), as PEFT's ``LoraLayer`` computes it.
    """

    rank: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @classmethod
    def read(cls, directory: str | Path) -> LoRAConfig:
        """Read and check ``directory/adapter_config.json``.

        Raises:
            ValueError: the file is missing or not a plain LoRA adapter of a Llama layer's
                projections (DoRA, biases, ``modules_to_save``, per-module ranks are not
                supported), each refusal naming the field.
        """
        path = Path(directory) / CONFIG_FILE
        if not path.is_file():
            raise ValueError(f"{path} not found: a LoRA adapter directory holds PEFT's "
                             f"{CONFIG_FILE} and {WEIGHTS_FILE}")
        if not (Path(directory) / WEIGHTS_FILE).is_file():
            raise ValueError(f"{Path(directory) / WEIGHTS_FILE} not found")
        raw = json.loads(path.read_text())
        return cls.of(raw, str(path))

    @classmethod
    def of(cls, raw: dict[str, object], where: str = CONFIG_FILE) -> LoRAConfig:
        def refuse(why: str) -> ValueError:
            return ValueError(f"{where}: {why}")

        if raw.get("peft_type", "LORA") != "LORA":
            raise refuse(f"peft_type {raw.get('peft_type')!r} is not LORA")
        for flag in ("use_dora", "fan_in_fan_out", "lora_bias"):
            if raw.get(flag):
                raise refuse(f"{flag} is not supported")
        if raw.get("bias", "none") != "none":
            raise refuse(f"bias {raw.get('bias')!r} is not supported (only 'none')")
        for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layer_replication"):
            if raw.get(key):
                raise refuse(f"{key} is not supported")
        rank = raw.get("r")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise refuse(f"r must be a positive integer, got {rank!r}")
        alpha = raw.get("lora_alpha", rank)
        if not isinstance(alpha, int | float) or isinstance(alpha, bool):
            raise refuse(f"lora_alpha must be a number, got {alpha!r}")
        targets = raw.get("target_modules")
        if not isinstance(targets, list) or not targets:
            raise refuse(f"target_modules must be a list of module names, got {targets!r}")
        unknown = sorted(set(map(str, targets)) - set(TARGET_MODULES))
        if unknown:
            raise refuse(f"target_modules {unknown} are not supported "
                         f"(supported: {', '.join(TARGET_MODULES)})")
        ordered = tuple(m for m in TARGET_MODULES if m in targets)
        return cls(rank, float(alpha), ordered, bool(raw.get("use_rslora", False)))


def parse_lora_flags(values: tuple[str, ...] | list[str]) -> tuple[LoRASpec, ...]:
    """The ``--lora`` values as specs; a name given twice is refused."""
    specs = tuple(LoRASpec.parse(v) for v in values)
    names = [s.name for s in specs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"LoRA adapter names given more than once: {', '.join(repeated)}")
    return specs


def served_names(base: str, adapters: tuple[str, ...] | list[str]) -> list[str]:
    """The model names a worker of ``base`` with ``adapters`` answers to: the base, then each
    adapter as ``NAME`` and ``base:NAME`` (what ``GET /v1/models`` lists)."""
    return [base, *(n for a in adapters for n in (a, f"{base}:{a}"))]


def adapter_of(model: str, base: str, adapters: tuple[str, ...] | list[str]) -> str | None:
    """The adapter a job naming ``model`` runs with (None: the base model).

    Raises:
        ValueError: ``model`` is neither the base nor one of its adapters.
    """
    if model == base:
        return None
    name = model.removeprefix(f"{base}:")
    if name in adapters:
        return name
    known = ", ".join(served_names(base, adapters))
    raise ValueError(f"unknown model {model!r}: this worker serves {known}")
