"""Turns a scheduler output into one forward over a flattened varlen batch, then samples."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.cuda_graphs import DecodeGraphs
from engine.lora import LoRAManager
from engine.models.llama import LlamaForCausalLM
from engine.pooler import PoolingConfig
from engine.sampler import Sampler, SampleRow, torch_argmax
from engine.scheduler import ModelOutput, ScheduledSeq, SchedulerOutput
from engine.sequence import Sequence
from engine.structured_output import StructuredOutput
from kernels import Backend, native
from kernels.cascade import runs_cascade, shared_prefix
from kernels.lora import LoRAMapping


class ModelRunner:
    """Owns the model, the KV cache tensors and the sampler.

    ``backend``: the one the model was built with. ``kv_caches``:
    ``[num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim]`` on the device,
    whose last block is the padding block of graph-replayed decodes (never handed out);
    ``host_kv_caches``: the same layout with the host pool's blocks (pinned on CUDA), or
    ``None`` without swap preemption. ``pooling``: how pooling sequences' hidden states
    become their partials (``engine.pooler``). ``lora``: the LoRA adapters' slots, which a
    step's rows name (None: no adapters served).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: Backend,
        kv_caches: torch.Tensor,
        block_size: int,
        eos_token_ids: frozenset[int],
        seed: int,
        structured: StructuredOutput | None = None,
        host_kv_caches: torch.Tensor | None = None,
        pooling: PoolingConfig | None = None,
        lora: LoRAManager | None = None,
    ) -> None:
        self.model = model
        self.lora = lora
        self.pooling = pooling
        self.backend = backend
        self.kv_caches = kv_caches
        self.host_kv_caches = host_kv_caches
        self.graphs: DecodeGraphs | None = None
        self.block_size = block_size
        self.device = kv_caches.device
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        # With the fused CPU layer ops, greedy batches take the C argmax too.
        argmax = native.argmax if backend.fused else torch_argmax
        self.sampler = Sampler(seed, argmax, structured)
        # what a decode step reads: the weights, and each row's KV (every layer's K and V)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.kv_bytes_per_token = kv_caches[:, :, 0, 0].numel() * kv_caches.element_size()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Build (or load) the kernels now rather than in the first step.

        Runs the decode op once over two sequences of the (empty) cache; it only reads. With
        the fused CPU layer ops, their C libraries (layer ops, linears, the decode step) are
        built too.
        """
        if self.backend.fused:
            for name in ("cpu_layer", "cpu_linear", "cpu_step"):
                native.library(name)
        num_seqs, num_blocks = 2, 2
        query = torch.zeros(
            num_seqs, self.model.num_heads, self.model.head_dim, dtype=self.kv_caches.dtype,
            device=self.device,
        )
        pool_blocks = self.kv_caches.shape[2]
        tables = torch.arange(num_seqs * num_blocks, device=self.device) % pool_blocks
        tables = tables.view(num_seqs, num_blocks).to(torch.int32)
        seq_lens = torch.full((num_seqs,), num_blocks * self.block_size, dtype=torch.int32,
                              device=self.device)
        cache = self.kv_caches[0]
        self.backend.decode(query, cache[0], cache[1], tables, seq_lens, self.model.scale)

    @torch.inference_mode()
    def enable_decode_graphs(self, max_num_seqs: int, max_blocks: int, capture: bool) -> None:
        """Run decode steps of up to ``max_num_seqs`` rows padded on static buffers, replayed
        from CUDA graphs when ``capture`` (``engine.cuda_graphs``)."""
        padding_block = self.kv_caches.shape[2] - 1
        self.graphs = DecodeGraphs(self.model, self.kv_caches, max_num_seqs, max_blocks,
                                   padding_block, capture)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> ModelOutput:
        """Compute the step; return the sampled token(s) per sampling sequence and the pooling
        partial per pooling sequence (by seq_id). Logits are computed only for the rows that
        sample."""
        if self.device.type != "cpu":
            return self._run(out)
        # Denormal activations make CPU matmuls much slower; flush them to zero for the step.
        # The flag is CPU state of the calling thread: restore it, so the process hosting the
        # engine (and its floats) is left as it was.
        torch.set_flush_denormal(True)
        try:
            return self._run(out)
        finally:
            torch.set_flush_denormal(False)

    def _run(self, out: SchedulerOutput) -> ModelOutput:
        if out.swap_out:
            assert self.host_kv_caches is not None
            _copy_blocks(self.kv_caches, self.host_kv_caches, out.swap_out)
        if out.swap_in:
            assert self.host_kv_caches is not None
            _copy_blocks(self.host_kv_caches, self.kv_caches, out.swap_in)
        if out.block_copies:
            _copy_blocks(self.kv_caches, self.kv_caches, out.block_copies)
        input_ids, positions, meta = self._prepare(out)
        sampling = [s for s in out.seqs if s.sample]
        rows = [row for s in sampling for row in self._rows(s.seq)]
        masks = self.sampler.start_masks(rows)  # grammar masks fill during the forward
        hidden = self._forward(input_ids, positions, meta)  # [T, hidden], after the last norm
        result = ModelOutput(pooled=self._pool(out, hidden))
        if not sampling:
            return result
        ends = meta.query_start_loc[1:].to(torch.long) - 1
        last = [i for i, s in enumerate(out.seqs) if s.sample]
        # A sequence that forks into n samples gets its last row repeated n times.
        repeats = torch.tensor([1 + s.seq.pending_forks for s in sampling])
        rows_idx = ends[last].repeat_interleave(repeats.to(self.device))
        logits = self.model.compute_logits(hidden[rows_idx])  # sampled on its device
        sampled = self.sampler(logits, rows, masks)
        it = iter(sampled)
        for s in sampling:
            result.sampled[s.seq.seq_id] = list(itertools.islice(it, 1 + s.seq.pending_forks))
        return result

    def _pool(self, out: SchedulerOutput, hidden: torch.Tensor) -> dict[int, torch.Tensor]:
        # Each pooling sequence's partial, from its chunk's rows (no logits for them).
        pooled: dict[int, torch.Tensor] = {}
        lo = 0
        for s in out.seqs:
            hi = lo + s.num_new_tokens
            if s.seq.pooling is not None:
                assert self.pooling is not None
                partial = self.pooling.partial(hidden[lo:hi], s.start, s.seq.num_prompt_tokens)
                if partial is not None:
                    pooled[s.seq.seq_id] = partial
            lo = hi
        return pooled

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        cascade = meta.decode_prefix is not None and meta.decode_prefix[1] > 0
        if (self.graphs is not None and meta.num_decode_tokens == n and not cascade
                and meta.lora is None
                and self.graphs.padded_size(n) is not None):
            return self.graphs.run(input_ids, positions, meta)
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _rereads_prefix(self, num_decodes: int, num_tokens: int, sharing: int,
                        prefix_tokens: int) -> bool:
        """Whether a decode step of few enough rows for the model's one C call runs without
        cascade, each row reading the shared prefix itself: when those extra reads are at most
        a quarter of the weights' bytes. Cascade needs the layer-by-layer path (torch's
        attention for the prefix), whose per-op costs are a third of such a step or more
        (SmolLM2 in bf16: up to 8 rows reading a 170-token prompt each, 7 x 170 x 23 KB =
        27 MB against 67 MB)."""
        if num_decodes != num_tokens or num_decodes > self.model.one_call_rows():
            return False
        extra = (sharing - 1) * prefix_tokens * self.kv_bytes_per_token
        return extra <= self.weight_bytes // 4

    def _rows(self, seq: Sequence) -> list[SampleRow]:
        p = seq.params
        blocked = (() if p.ignore_eos else self.eos_token_ids) + tuple(p.stop_token_ids or ())
        extra = seq.fork_generators or [None] * seq.pending_forks
        generators = [seq.generator, *extra[: seq.pending_forks]]
        return [
            SampleRow(p, seq.prompt_token_ids, seq.output_token_ids, g, blocked, seq.grammar)
            for g in generators
        ]

    def _prepare(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        seqs = out.seqs
        q_lens = np.fromiter((s.num_new_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        starts = np.fromiter((s.start for s in seqs), dtype=np.int64, count=len(seqs))
        qsl = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        num_tokens = int(qsl[-1])

        input_ids = np.empty(num_tokens, dtype=np.int64)
        for s, lo, hi in zip(seqs, qsl[:-1].tolist(), qsl[1:].tolist(), strict=True):
            input_ids[lo:hi] = s.seq.token_ids[s.start : s.start + s.num_new_tokens]
        seq_index = np.repeat(np.arange(len(seqs)), q_lens)
        positions = np.arange(num_tokens) - qsl[:-1][seq_index] + starts[seq_index]

        max_blocks = max(len(s.seq.block_table) for s in seqs)
        tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)
        for i, s in enumerate(seqs):
            tables[i, : len(s.seq.block_table)] = s.seq.block_table
        slot_mapping = tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs

        nd = out.num_decodes
        dev = self.device
        decode_prefix = None
        if self.backend.cascade:  # cascade backends get the step's shared prefix, found once
            rows, shared = shared_prefix(tables[:nd], starts[:nd] + 1, bs)
            if not runs_cascade(len(rows), shared, bs) or self._rereads_prefix(
                    nd, num_tokens, len(rows), shared * bs):
                rows, shared = rows[:0], 0  # said once here, not found again in every layer
            decode_prefix = torch.from_numpy(rows).to(dev), shared
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy((starts + q_lens).astype(np.int32)).to(dev),
            num_decode_tokens=nd,
            prefill_query_start_loc=torch.from_numpy((qsl[nd:] - qsl[nd]).astype(np.int32)).to(
                dev
            ),
            decode_prefix=decode_prefix,
            lora=self._lora_mapping(seqs, seq_index),
        )
        return torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), meta

    def _lora_mapping(self, seqs: tuple[ScheduledSeq, ...],
                      seq_index: np.ndarray) -> LoRAMapping | None:
        # Each row's adapter slot, from its sequence's adapter (-1: the base model).
        if self.lora is None:
            return None
        slot_of = self.lora.slot_of
        slots = np.array([slot_of[s.seq.lora] if s.seq.lora else -1 for s in seqs])
        return LoRAMapping.of(slots[seq_index], self.device)


def _copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: tuple[tuple[int, int], ...]) -> None:
    # One gather on the source's device, one transfer, one scatter: a step's swap is one
    # host<->device copy, not one per block and layer. The transfer is synchronous (a gather
    # from pinned memory is pageable); the step waits for its sampled tokens anyway.
    src_blocks, dst_blocks = zip(*pairs, strict=True)
    dst[:, :, list(dst_blocks)] = src[:, :, list(src_blocks)].to(dst.device)
