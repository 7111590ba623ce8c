"""LoRA adapters on the device: loaded from PEFT's files, kept under a memory budget, given
slots that a step's rows name (``kernels.lora``).

PEFT names a layer's projections as Hugging Face does (``q_proj``, ``k_proj``, ...); the model
fuses some (``qkv_proj``, ``gate_up_proj``). An adapter's parts of a fused projection are
stacked along the rank in ``A`` and placed block-diagonally in ``B`` (scaling folded in), so
``x @ A.T @ B.T`` is each part's product in its own columns and zero elsewhere. ``B`` is kept
transposed (``Bt``), as ``kernels.lora`` reads it.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open
from torch import nn

from engine.lora_config import TARGET_MODULES, WEIGHTS_FILE, LoRAConfig, LoRASpec
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from kernels.lora import LoRASlots, stack_slots

log = logging.getLogger(__name__)

# Our fused projection -> its Hugging Face parts, in the order of its output columns.
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])\.weight$")


def projections(model: LlamaForCausalLM) -> dict[tuple[int, str], nn.Linear]:
    """(layer, fused projection name) -> its linear module, for every adaptable projection."""
    found: dict[tuple[int, str], nn.Linear] = {}
    for i, module in enumerate(model.layers):
        layer = cast(DecoderLayer, module)
        found[i, "qkv_proj"] = layer.self_attn.qkv_proj
        found[i, "o_proj"] = layer.self_attn.o_proj
        found[i, "gate_up_proj"] = layer.mlp.gate_up_proj
        found[i, "down_proj"] = layer.mlp.down_proj
    return found


def part_sizes(model: LlamaForCausalLM, name: str, out_features: int) -> list[int]:
    """Output columns of each Hugging Face part of fused projection ``name``."""
    if name == "qkv_proj":
        kv = model.num_kv_heads * model.head_dim
        return [out_features - 2 * kv, kv, kv]
    if name == "gate_up_proj":
        return [out_features // 2, out_features // 2]
    return [out_features]


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter's weights for the model: (layer, fused projection) -> ``A [R, in]``,
    ``Bt [R, out]`` (``B`` transposed, scaling folded in), contiguous, on the model's device
    and dtype."""

    name: str
    config: LoRAConfig
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.weights.values() for t in pair)


def load_adapter(spec: LoRASpec, model: LlamaForCausalLM) -> LoRAWeights:
    """Read ``spec``'s PEFT adapter for ``model`` (its safetensors read directly).

    Raises:
        ValueError: the config is not supported (``LoRAConfig.read``), a tensor is not a LoRA
            weight of a Llama layer's projection, a shape does not fit the model or the rank,
            or a projection has ``A`` without ``B`` (or the reverse).
    """
    config = LoRAConfig.read(spec.path)
    path = Path(spec.path) / WEIGHTS_FILE
    linears = projections(model)
    raw: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            m = _KEY.match(key)
            if m is None or m.group(2) not in TARGET_MODULES:
                raise ValueError(f"{path}: tensor {key!r} is not a LoRA weight of a "
                                 f"projection ({', '.join(TARGET_MODULES)})")
            layer, part, which = int(m.group(1)), m.group(2), m.group(3)
            if part not in config.target_modules:
                raise ValueError(f"{path}: {key!r} adapts {part}, not in target_modules")
            raw.setdefault((layer, part), {})[which] = f.get_tensor(key).float()
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, fused), linear in linears.items():
        parts = FUSED[fused]
        targeted = [p for p in parts if (layer, p) in raw]
        if not targeted:
            continue
        sizes = part_sizes(model, fused, linear.out_features)
        r = config.rank
        a = torch.zeros(r * len(targeted), linear.in_features)
        b = torch.zeros(linear.out_features, r * len(targeted))
        col = 0
        for part, size, offset in zip(parts, sizes, _offsets(sizes), strict=True):
            if part not in targeted:
                continue
            pair = raw.pop((layer, part))
            if set(pair) != {"A", "B"}:
                raise ValueError(f"{path}: layer {layer} {part} has lora_{''.join(pair)} only")
            if pair["A"].shape != (r, linear.in_features) or pair["B"].shape != (size, r):
                raise ValueError(
                    f"{path}: layer {layer} {part}: lora_A {tuple(pair['A'].shape)}, lora_B "
                    f"{tuple(pair['B'].shape)} do not fit rank {r} and the model's "
                    f"{linear.in_features} -> {size}")
            a[col : col + r] = pair["A"]
            b[offset : offset + size, col : col + r] = pair["B"] * config.scaling
            col += r
        param = model.norm.weight  # the model's dtype (an int8 or packed weight's is not)
        weights[layer, fused] = (a.to(param.device, param.dtype),
                                 b.t().contiguous().to(param.device, param.dtype))
    if raw:
        layer, part = next(iter(raw))
        raise ValueError(f"{path}: layer {layer} is not in the model "
                         f"({len(model.layers)} layers)")
    return LoRAWeights(spec.name, config, weights)


def _offsets(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


class LoRAManager:
    """The adapters a worker serves, which of them are resident on the device, and their slots.

    Structures:
        specs: name -> ``LoRASpec`` of every adapter served.
        resident: name -> ``LoRAWeights``, least recently acquired first (LRU order).
        slots: slot -> name of the adapter in it, or None; ``slot_of`` its inverse.
        pins: name -> unfinished requests holding it.

    Invariants:
        - the resident adapters' bytes are at most ``memory_bytes``;
        - a pinned adapter is resident and keeps its slot;
        - each projection's ``LoRASlots`` (the module's ``lora`` attribute) holds, at each
          slot, the weights of the adapter in it, or None if that adapter does not adapt it.

    ``can_acquire`` / ``acquire`` pin an adapter for a request (loading it, and unloading
    unpinned ones least recently used first, when the budget needs room); ``release`` unpins.
    """

    def __init__(self, specs: tuple[LoRASpec, ...], model: LlamaForCausalLM,
                 memory_bytes: int) -> None:
        self.model = model
        self.specs = {s.name: s for s in specs}
        self.memory_bytes = memory_bytes
        self.resident: OrderedDict[str, LoRAWeights] = OrderedDict()
        self.slots: list[str | None] = []
        self.slot_of: dict[str, int] = {}
        self.pins: dict[str, int] = {}
        self.num_loads = 0
        self._linears = projections(model)
        # Each projection's slots, also set on its module as ``lora`` (what the model reads).
        self._holders = {key: LoRASlots([]) for key in self._linears}
        for key, linear in self._linears.items():
            setattr(linear, "lora", self._holders[key])  # noqa: B010 (not a declared attribute)
        self._sizes: dict[str, int] = {}
        for spec in specs:  # fail fast: every adapter loads, and fits the budget on its own
            w = load_adapter(spec, model)
            self._sizes[spec.name] = w.nbytes
            if w.nbytes > memory_bytes:
                raise ValueError(f"LoRA adapter {spec.name!r} needs {w.nbytes} bytes, over "
                                 f"lora_memory_bytes={memory_bytes}")
            if self.resident_bytes + w.nbytes <= memory_bytes:  # the first ones that fit
                self._install(w)
        log.info("LoRA adapters: %s (%d resident)", ", ".join(self.specs) or "none",
                 len(self.resident))

    @property
    def resident_bytes(self) -> int:
        return sum(w.nbytes for w in self.resident.values())

    def check(self, name: str) -> None:
        """Raise ``ValueError`` for an adapter this engine does not serve."""
        if name not in self.specs:
            served = ", ".join(self.specs) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (served: {served})")

    def can_acquire(self, name: str) -> bool:
        """Whether ``name`` is resident or can be made so by unloading unpinned adapters."""
        if name in self.resident:
            return True
        free = self.memory_bytes - sum(w.nbytes for n, w in self.resident.items()
                                       if self.pins.get(n))
        return self._sizes[name] <= free

    def acquire(self, name: str) -> bool:
        """Pin ``name`` for one request, loading it if needed; False when it cannot be loaded
        now (the budget is held by pinned adapters: try again after a release)."""
        self.check(name)
        if not self.can_acquire(name):
            return False
        if name not in self.resident:
            self._room_for(self._sizes[name])
            self._install(load_adapter(self.specs[name], self.model))
        self.resident.move_to_end(name)
        self.pins[name] = self.pins.get(name, 0) + 1
        return True

    def release(self, name: str) -> None:
        """Unpin ``name`` for one request (it stays resident until room is needed)."""
        count = self.pins.get(name, 0) - 1
        if count < 0:
            raise RuntimeError(f"LoRA adapter {name!r} released more often than acquired")
        self.pins[name] = count

    def _room_for(self, nbytes: int) -> bool:
        # Unload unpinned adapters, least recently acquired first, until nbytes fit.
        for name in list(self.resident):
            if self.resident_bytes + nbytes <= self.memory_bytes:
                break
            if not self.pins.get(name):
                self._uninstall(name)
        return self.resident_bytes + nbytes <= self.memory_bytes

    def _install(self, w: LoRAWeights) -> None:
        slot = self.slots.index(None) if None in self.slots else len(self.slots)
        if slot == len(self.slots):
            self.slots.append(None)
        self.slots[slot], self.slot_of[w.name] = w.name, slot
        self.resident[w.name] = w
        self.num_loads += 1
        for key, holder in self._holders.items():
            holder.weights += [None] * (len(self.slots) - len(holder.weights))
            holder.weights[slot] = w.weights.get(key)
        self._refresh()

    def _uninstall(self, name: str) -> None:
        slot = self.slot_of.pop(name)
        self.slots[slot] = None
        del self.resident[name]
        for holder in self._holders.values():
            holder.weights[slot] = None
        self._refresh()

    def _refresh(self) -> None:
        # The C kernel's tables follow the slots; the Triton path reads every slot from one
        # zero-padded tensor per projection.
        for key, holder in self._holders.items():
            linear = self._linears[key]
            holder.refresh()
            holder.stacked = (stack_slots(holder.weights, linear.in_features,
                                          linear.out_features)
                              if linear.weight.device.type == "cuda" else None)
