"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

Numerics follow Hugging Face transformers' implementation (RMSNorm in float32, RoPE tables from
transformers' own init functions) so that greedy outputs match it token for token. With a
``fused`` backend (the CPU one), the elementwise work between the matmuls (residual add +
RMSNorm, Qwen3's per-head q/k RMSNorm, RoPE, SiLU * up) runs in fused C kernels
(``kernels/cpu_layer.c``) that round where transformers' eager ops round; elsewhere it runs as
those torch ops. Its linear layers call the backend's ``linear``: on the CPU
``kernels.native.linear``, a C kernel for the few rows of a decode step (the weights read once,
bf16 ones widened as read or multiplied as pairs), torch's GEMM for more; and a decode step of
that few rows runs all its layers in one C call (``kernels.native.DecodeLayers``), the same
kernels in the same order. Where the C linear has AVX512-BF16's dot product and no AMX, the
engine packs the projections' and the lm_head's bf16 weights once loaded
(:meth:`LlamaForCausalLM.pack_weights`; a tied table is looked up in its packed form) for a
kernel that takes every row count, prefill's too. In the batch-invariant mode the
backend's linear and attention reduce each row in one order whatever the batch
(``kernels.batch_invariant``). With
``quantization="int8"`` the attention and MLP projections hold int8 weights with float32 scales
(``kernels.int8``), quantized as the checkpoint loads, and call the backend's ``linear_int8``
(the C kernel on the CPU, Triton on CUDA); so does the lm_head (with tied embeddings, an int8
copy of the table: the lookup keeps the model's dtype); embeddings and norms stay in the
model's dtype.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.attention import AttentionMetadata, PagedAttention, softmax_scale
from kernels import Backend, int8, native
from kernels.cascade import runs_cascade
from kernels.lora import LoRAMapping, LoRASlots, c_max_rows, in_c

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Inputs per scale of a bf16/float32 checkpoint quantized to int8 (None: one scale per output
# channel). GGUF Q8_0 tensors bring their own (32). bench/int8.py measured per-channel against
# SmolLM2 in bf16: see bench/RESULTS.md.
INT8_GROUP_SIZE: int | None = None
# HF name part -> (our param part, shard index): q/k/v and gate/up are stacked row-wise.
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class RMSNorm(nn.Module):
    """``weight * norm(x)``; given the residual stream, adds ``x`` to it first (vLLM style).

    ``forward(x)`` returns the norm of ``x``; ``forward(x, residual)`` returns the norm of
    ``x + residual`` and that sum, the new residual stream.
    """

    def __init__(self, hidden_size: int, eps: float, fused: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused = fused

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:  # the residual add is done in place, in the kernel
            out = native.rms_norm(x, self.weight, self.eps, residual)
            return out, x if residual is None else residual
        if residual is not None:
            x = x + residual
        # Normalised in float32, cast back, then scaled: transformers' order of operations.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype), x


class Linear(nn.Linear):
    """``nn.Linear`` through the backend's ``linear`` (``F.linear``'s signature); once
    :meth:`to_int8` made its weight int8 with a float32 scale per group (``weight_scale``),
    through the backend's ``linear_int8``."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 backend: Backend) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.op: Callable[..., torch.Tensor] = backend.linear
        self.op_int8: Callable[..., torch.Tensor] = backend.linear_int8
        self.op_lora: Callable[..., torch.Tensor] = backend.lora
        self.weight_scale: torch.Tensor | None
        self.register_buffer("weight_scale", None)

    def to_int8(self, group: int | None) -> None:
        """Make the weight int8 (``[out, in]``) with a float32 scale per ``group`` inputs
        (``[out, in / group]``; None: per output channel), both uninitialized on the weight's
        device: ``LlamaForCausalLM.load_weights`` quantizes into them or copies a quantized
        checkpoint's."""
        n, k = self.weight.shape
        if group is not None and k % group:
            raise ValueError(f"int8 groups of {group} do not divide {k} inputs")
        device = self.weight.device
        self.weight = nn.Parameter(torch.empty(n, k, dtype=torch.int8, device=device),
                                   requires_grad=False)
        self.weight_scale = torch.empty(n, 1 if group is None else k // group,
                                        dtype=torch.float32, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale is not None:
            return self.op_int8(x, self.weight, self.weight_scale, self.bias)
        return self.op(x, self.weight, self.bias)


class Rotary(nn.Module):
    """cos/sin tables for every position, computed as transformers computes them."""

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        rope_params = getattr(config, "rope_parameters", None) or getattr(
            config, "rope_scaling", None
        ) or {}
        rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
        if rope_type == "default":
            base = rope_params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (
                base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
            )
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)  # [P, D] float32
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the step's positions, ``[T, D]`` each; shared by every layer."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def apply_rotary(
    x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], fused: bool
) -> torch.Tensor:
    """``x`` ([T, heads, D]) rotated by the step's RoPE tables; in place when ``fused``."""
    cos, sin = rope
    if fused:
        native.rotary_(x, cos, sin)
        return x
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: Backend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qk_size = q_size + kv_size
        self.fused = backend.fused
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias, backend)
        self.o_proj = Linear(q_size, config.hidden_size, False, backend)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, backend)
        # Qwen3 normalizes each head of q and k (RMSNorm over head_dim) before RoPE.
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.model_type == "qwen3":  # a fused backend runs native.head_norms_ on these
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, fused=False)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, fused=False)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, D]
        x: torch.Tensor,  # [T, hidden]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, H_kv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = _adapted(self.qkv_proj, x, meta.lora)
        qk = qkv[:, : self.qk_size].view(t, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            if self.fused:  # in place, the kernel the one-call decode step runs
                native.head_norms_(qk, self.num_heads, self.q_norm.weight, self.k_norm.weight,
                                   self.q_norm.eps)
            else:
                h = self.num_heads
                qk = torch.cat([self.q_norm(qk[:, :h])[0], self.k_norm(qk[:, h:])[0]], dim=1)
        # q and k rotated together: one set of elementwise ops for both.
        qk = apply_rotary(qk, rope, self.fused)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.qk_size :].view(t, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, kv_cache, meta)  # [T, H, D]
        return _adapted(self.o_proj, out.reshape(t, -1), meta.lora)


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: Backend) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False,
                                   backend)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, backend)
        self.fused = backend.fused

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        gate_up = _adapted(self.gate_up_proj, x, lora)
        if self.fused:
            return _adapted(self.down_proj, native.silu_mul(gate_up), lora)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return _adapted(self.down_proj, F.silu(gate) * up, lora)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: Backend) -> None:
        super().__init__()
        eps, fused = config.rms_norm_eps, backend.fused
        self.input_layernorm = RMSNorm(config.hidden_size, eps, fused)
        self.self_attn = Attention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, fused)
        self.mlp = MLP(config, backend)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,  # the previous layer's MLP output (the embeddings for the first)
        residual: torch.Tensor | None,  # the residual stream before x is added to it
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # this layer's MLP output, the residual stream
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, meta.lora), residual


class LlamaForCausalLM(nn.Module):
    """Decoder over a flattened varlen batch; ``kv_caches[layer]`` is ``[2, N, B, H_kv, D]``.

    Its attention shape (``num_heads``, ``num_kv_heads``, ``head_dim``, the softmax ``scale``)
    is that of every layer.
    """

    def __init__(self, config: PretrainedConfig, backend: Backend, max_positions: int) -> None:
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {config.model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        self.scale = softmax_scale(self.head_dim)
        with torch.device("cpu"):  # float32 tables, as transformers computes them
            self.rotary = Rotary(config, self.head_dim, max_positions)
        # Uninitialized (the weights are loaded; empty() builds on the meta device): a random
        # init there goes through torch's Python decompositions, which import torch._dynamo and
        # with it triton, 100 MB of a CPU process's memory that nothing else needs.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size,
                                                             config.hidden_size))
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.fused)
        self.fused = backend.fused
        self.linear = backend.linear
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Tied: the embedding table multiplies (lm_head is only made, as an int8 copy of the
        # table, by empty(quantization="int8")).
        self.lm_head: Linear | None = None
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, backend)
        self._decode_layers: native.DecodeLayers | None = None  # built on first use
        # the projections' adapter tables (kept alive here) and their addresses, likewise
        self._lora_tables: tuple[list[native.LoRATable], ctypes.Array] | None = None

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self._decode_layers = None  # .to(), .float(), ...: its weights' addresses may change
        self._lora_tables = None
        return super()._apply(fn, recurse)

    @classmethod
    def empty(cls, config: PretrainedConfig, backend: Backend, max_positions: int,
              device: torch.device, dtype: torch.dtype, quantization: str | None = None,
              int8_group: int | None = INT8_GROUP_SIZE) -> LlamaForCausalLM:
        """The model with its weights allocated, uninitialized, in ``dtype`` on ``device``:
        built on the meta device, so no float32 copy and no random init ever exist (an 8B
        model would need 32 GB for those); :meth:`load_weights` fills them. With
        ``quantization="int8"``, the projections (:meth:`int8_linears`) and the lm_head are int8
        with a scale per ``int8_group`` inputs (None: per output channel) from the start: no
        bf16 copy of them either. With tied embeddings the lm_head is an int8 copy of the
        table, which the lookup still reads in ``dtype`` (bench/int8.py: on SmolLM2, whose
        tied table is a third of an int8 step's bytes, 1.86x bf16's speed with it against
        1.5-1.7x without, perplexity +0.03%)."""
        if quantization not in (None, "int8"):
            raise ValueError(f"unknown quantization {quantization!r}")
        with torch.device("meta"):
            model = cls(config, backend, max_positions)
        rotary = model.rotary  # computed tables (see __init__), which to_empty would drop
        del model.rotary
        model = model.to(dtype=dtype)
        if quantization == "int8":  # after .to(dtype), which would cast the float32 scales
            if model.lm_head is None:
                with torch.device("meta"):
                    model.lm_head = Linear(config.hidden_size, config.vocab_size, False, backend)
            for linear in [*model.int8_linears(), model.lm_head]:
                linear.to_int8(int8_group)
        model = model.to_empty(device=device)
        model.rotary = rotary.to(device=device, dtype=dtype)
        return model

    def pack_weights(self) -> bool:
        """Pack each layer's four projections for the CPU's dot product
        (``kernels.native.pack_bf16``) where that is this machine's fastest linear
        (``native.packs_bf16``): with the fused CPU ops, bf16 weights (not int8) on the CPU, and
        every projection of a packable shape (all or none: one decode call takes them all).
        The lm_head's weight too where it is packable: with tied embeddings that is the
        embedding table, whose rows the lookup then reads from the packed blocks
        (:meth:`embed`). Each weight is packed in place (no second copy of the model). Whether
        the projections were packed."""
        linears = self.int8_linears()
        if not (self.fused and native.packs_bf16()
                and all(native.packable(linear.weight) for linear in linears)):
            return False
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        for module in [*linears, *([head] if native.packable(head.weight) else [])]:
            module.weight = nn.Parameter(native.pack_bf16(module.weight.data),
                                         requires_grad=False)
        self._decode_layers = None  # holds the weights' addresses
        return True

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype, the model's (its norms': a packed or int8 weight is not)."""
        return self.norm.weight.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        """The embedding table's rows of ``input_ids``, packed (tied, :meth:`pack_weights`) or
        not."""
        table = self.embed_tokens.weight
        if native.is_packed(table):
            return native.packed_rows(table, input_ids)
        return self.embed_tokens(input_ids)

    def int8_linears(self) -> list[Linear]:
        """The projections ``quantization="int8"`` makes int8: each layer's qkv, o, gate_up
        and down (the embeddings and lm_head stay as they are)."""
        found: list[Linear] = []
        for module in self.layers:
            layer = cast(DecoderLayer, module)
            found += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                      layer.mlp.down_proj]
        return found

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: torch.Tensor,  # [L, 2, num_blocks, block_size, H_kv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], final-normed
        x = self.embed(input_ids)
        rope = self.rotary.tables(positions, x.dtype)
        if self._in_one_call(x.shape[0], kv_caches, meta):
            assert self._decode_layers is not None
            assert meta.lora is None or self._lora_tables is not None  # set by _in_one_call
            lora = None if meta.lora is None else (self._lora_tables[1], meta.lora.index)
            out = self._decode_layers(x, rope, kv_caches, meta.slot_mapping, meta.block_tables,
                                      meta.seq_lens, lora)
            return self.norm(out, x)[0]  # x: the residual stream, in place
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(rope, x, residual, kv_cache, meta)
        return self.norm(x, residual)[0]

    def one_call_rows(self) -> int:
        """The most rows a decode step may have to run its layers as one C call (0: never):
        with the fused CPU ops and weights of a dtype the C linear takes, as many rows as it
        takes."""
        if not self.fused:
            return 0
        qkv = self.layers[0].self_attn.qkv_proj
        if qkv.weight_scale is not None:
            return native.linear_int8_max_rows(int8.scale_group(qkv.weight, qkv.weight_scale))
        if native.is_packed(qkv.weight):
            return native.LINEAR_MAX_ROWS_PACKED_DOT
        return native.linear_max_rows(qkv.weight.dtype)

    def _adapters_in_c(self, rows: int) -> bool:
        """Whether a decode step of ``rows`` adapted rows runs their adapters in the C kernel
        layer by layer (``kernels.lora.add_lora_cpu``'s condition), so in one call too: every
        projection's adapters in its table, and at most ``kernels.lora.c_max_rows`` rows."""
        dtype = self.dtype
        holders = [getattr(p, "lora", None) for p in self.int8_linears()]
        if rows > c_max_rows(dtype) or not all(
                isinstance(h, LoRASlots) and in_c(h, dtype) for h in holders):
            return False
        tables = [cast(LoRASlots, h).table for h in holders]
        if self._lora_tables is None or any(
                t is not u for t, u in zip(tables, self._lora_tables[0], strict=True)):
            self._lora_tables = (tables, native.lora_tables(tables))
        return True

    def _in_one_call(self, rows: int, kv_caches: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step's layers run as one C call: decodes only, without a cascade
        prefix (torch's attention computes it), at most ``one_call_rows()`` of them, over a
        contiguous CPU KV cache of the weights' dtype; with adapted rows, where the layer by
        layer path adds their products in C too (:meth:`_adapters_in_c`)."""
        if not (meta.num_decode_tokens == rows and meta.decode_prefix is not None
                and 0 < rows <= self.one_call_rows()
                and (meta.lora is None or self._adapters_in_c(rows))):
            return False
        prefix_rows, shared = meta.decode_prefix
        if runs_cascade(len(prefix_rows), shared, kv_caches.shape[3]):
            return False
        if not (kv_caches.device.type == "cpu" and kv_caches.dtype == self.dtype
                and kv_caches.is_contiguous()):
            return False
        if self._decode_layers is None:
            self._decode_layers = native.DecodeLayers(
                [native.LayerWeights(
                    layer.input_layernorm.weight, layer.self_attn.qkv_proj.weight,
                    layer.self_attn.qkv_proj.bias, layer.self_attn.o_proj.weight,
                    layer.post_attention_layernorm.weight, layer.mlp.gate_up_proj.weight,
                    layer.mlp.down_proj.weight, _int8_scales(layer), _head_norms(layer))
                    for layer in self.layers],
                self.num_heads, self.num_kv_heads, self.head_dim, self.config.rms_norm_eps,
                self.scale)
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab], model dtype
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return self.linear(hidden, self.embed_tokens.weight, None)

    def _weight_params(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint fills: the parameters and the int8 scales."""
        params: dict[str, torch.Tensor] = dict(self.named_parameters())
        params.update((n, b) for n, b in self.named_buffers() if n.endswith(".weight_scale"))
        return params

    def _target(self, hf_name: str, params: dict[str, torch.Tensor]
                ) -> tuple[str, slice] | None:
        """The parameter and its rows a checkpoint tensor fills (None: not loaded)."""
        name = hf_name.removeprefix("model.")
        if (name == "lm_head.weight" and self.tie_word_embeddings) or "rotary_emb" in name:
            return None
        for part, (target, shard) in STACKED.items():
            if f".{part}." in name:
                name = name.replace(part, target)
                sizes = self._shard_sizes(target, params[name].shape[0])
                offset = sum(sizes[:shard])
                return name, slice(offset, offset + sizes[shard])
        if name not in params:
            raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
        return name, slice(None)

    def weight_destination(self, hf_name: str, shape: tuple[int, ...], dtype: torch.dtype
                           ) -> torch.Tensor | None:
        """Where a checkpoint tensor of ``shape`` and ``dtype`` can be read as it is: its
        parameter's rows in host memory, when they are contiguous and of that dtype and shape
        (``loader.read_safetensors``' ``into``). None where it needs a conversion (another
        dtype, int8 quantization), lives on a device, or is not loaded."""
        params = self._weight_params()
        target = self._target(hf_name, params)
        if target is None:
            return None
        name, rows = target
        dest = params[name].data[rows]
        if (dest.device.type != "cpu" or dest.dtype != dtype or tuple(dest.shape) != shape
                or not dest.is_contiguous()):
            return None
        return dest

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face tensors (``model.layers.N.self_attn.q_proj.weight``, ...).

        Into an int8 projection (``empty(quantization="int8")``), a float tensor is quantized
        as it is copied (its rows' scales with it: scales are per row, so the fused q/k/v and
        gate/up parts quantize apart as they would together); an int8 tensor is copied as it is
        and its scales come as ``<name>.weight_scale`` (GGUF Q8_0, ``loader.iter_gguf``). A
        tensor already read into its place (:meth:`weight_destination`) is not copied again.
        """
        self._decode_layers = None  # holds the weights' addresses
        params = self._weight_params()
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            target = self._target(hf_name, params)
            if target is None:
                continue
            name, rows = target
            loaded |= self._copy_weight(params, name, rows, tensor)
            if name == "embed_tokens.weight" and self.tie_word_embeddings and (
                    self.lm_head is not None):  # int8: the table's quantized copy
                loaded |= self._copy_weight(params, "lm_head.weight", rows, tensor)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}")

    @staticmethod
    def _copy_weight(params: dict[str, torch.Tensor], name: str, rows: slice,
                     tensor: torch.Tensor) -> set[str]:
        """Copy ``tensor`` into ``rows`` of parameter ``name``, quantizing it when the parameter
        is int8 and the tensor is not; the names it filled."""
        param = params[name]
        if param.dtype != torch.int8 or tensor.dtype == torch.int8:
            if tensor.dtype == torch.int8 and param.dtype != torch.int8:
                raise ValueError(f"{name} is int8 in the checkpoint: load it with "
                                 "quantization='int8'")
            dest = param.data[rows]
            if dest.data_ptr() != tensor.data_ptr() or dest.shape != tensor.shape:
                dest.copy_(tensor)  # else read into its place by the loader
            return {name}
        scale_name = name.removesuffix("weight") + "weight_scale"
        scale = params[scale_name]
        int8.quantize(tensor, param.shape[1] // scale.shape[1],
                      out=(param.data[rows], scale.data[rows]))
        return {name, scale_name}

    def _shard_sizes(self, target: str, total: int) -> list[int]:
        if target == "qkv_proj":
            kv = self.num_kv_heads * self.head_dim
            return [total - 2 * kv, kv, kv]
        return [total // 2, total // 2]


def _adapted(linear: Linear, x: torch.Tensor, lora: LoRAMapping | None) -> torch.Tensor:
    """``linear(x)`` plus each row's LoRA adapter product when the step has adapted rows
    (``engine.lora`` keeps the adapters' weights on the module, as ``lora``), by the
    backend's ``lora``."""
    y = linear(x)
    slots = getattr(linear, "lora", None)
    return y if lora is None or slots is None else linear.op_lora(slots, x, y, lora)


def _int8_scales(layer: nn.Module
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The int8 scales of the layer's qkv, o, gate_up and down projections, or None."""
    assert isinstance(layer, DecoderLayer)
    qkv, o = layer.self_attn.qkv_proj.weight_scale, layer.self_attn.o_proj.weight_scale
    gate_up, down = layer.mlp.gate_up_proj.weight_scale, layer.mlp.down_proj.weight_scale
    if qkv is None or o is None or gate_up is None or down is None:
        return None
    return qkv, o, gate_up, down


def _head_norms(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The weights of the layer's per-head q and k norms (Qwen3's), or None."""
    assert isinstance(layer, DecoderLayer)
    q, k = layer.self_attn.q_norm, layer.self_attn.k_norm
    return None if q is None or k is None else (q.weight, k.weight)


def _head_dim(config: PretrainedConfig) -> int:
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads
