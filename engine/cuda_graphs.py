"""Decode steps replayed from CUDA graphs, one per batch size of a ladder.

A decode step launches a few kernels per layer from Python (hundreds a step); at small batch
sizes the GPU waits on those launches. A graph records one step's launches once and replays
them with a single call. A graph's tensors are fixed, so the step's inputs are copied into
static buffers, and its batch is padded to the next size of the ladder (vLLM's: 1, 2, 4, then
multiples of 8): padded rows read and write only the KV pool's padding block, a block the
block pool never hands out, and their outputs are dropped. A size's graph is captured the
first time a step needs it (tens of milliseconds, once), all into one memory pool: a worker
captures only the sizes its traffic reaches, and an engine that never decodes captures none.

Steps with prefill chunks run eagerly (their shapes vary too much to capture), and so do
decode steps that read a shared prefix in cascade (the prefix is a launch parameter).
Without ``capture`` (the CPU, where tests check the padding), :meth:`DecodeGraphs.run` runs the
same padded step eagerly on the same buffers.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from engine.attention import AttentionMetadata
from engine.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def captures_decode_graphs(device: torch.device, enforce_eager: bool, backend: str) -> bool:
    """Whether an engine replays its decode steps from CUDA graphs: on CUDA, unless
    ``enforce_eager``, with the Triton kernels only. The torch reference backend reads the
    sequence lengths on the host, which a capture cannot record (the capture fails and the
    step's requests with it)."""
    return device.type == "cuda" and not enforce_eager and backend == "triton"


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, then multiples of 8, up to ``max_num_seqs``."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] < max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    """Static decode buffers of up to ``max_num_seqs`` rows over ``kv_caches``, and the graphs
    captured on them.

    ``padding_block`` is the pool's block that padded rows use; ``max_blocks`` the width of
    a block table (``max_model_len`` in blocks).
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: torch.Tensor, max_num_seqs: int,
                 max_blocks: int, padding_block: int, capture: bool) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = graph_batch_sizes(max_num_seqs)
        n, dev = self.sizes[-1], kv_caches.device
        block_size = kv_caches.shape[3]
        self.padding_block = padding_block
        self.padding_slot = padding_block * block_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), self.padding_slot, dtype=torch.long, device=dev)
        self.block_tables = torch.full((n, max_blocks), padding_block, dtype=torch.int32,
                                       device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.hidden = torch.empty(n, model.config.hidden_size, dtype=kv_caches.dtype,
                                  device=dev)
        self.capture = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.num_runs = 0  # padded steps run (replayed or, without graphs, eager)

    def padded_size(self, num_seqs: int) -> int | None:
        """The batch size a decode step of ``num_seqs`` rows runs at; None past the largest."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:  # [num_seqs, hidden]
        """The decode step of ``meta`` (decodes only, none in cascade), padded."""
        n = input_ids.shape[0]
        size = self.padded_size(n)
        assert size is not None and meta.num_decode_tokens == n
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.seq_lens[:n].copy_(meta.seq_lens)
        # Rows past n may hold an earlier, larger step's: make them padding again. Columns
        # past `width` may too; seq_lens keep every row from reading them.
        self.slot_mapping[n:size].fill_(self.padding_slot)
        self.block_tables[n:size, 0].fill_(self.padding_block)
        self.seq_lens[n:size].fill_(1)
        if self.capture and size not in self.graphs:
            self._capture(size)
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
        else:
            self._forward(size)
        self.num_runs += 1
        return self.hidden[:n]

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            num_decode_tokens=size,
            prefill_query_start_loc=self.query_start_loc[:1],
        )

    def _forward(self, size: int) -> None:
        self.hidden[:size] = self.model(self.input_ids[:size], self.positions[:size],
                                        self.kv_caches, self._meta(size))

    def _capture(self, size: int) -> None:
        # On the step's own inputs: the warm-up writes the K/V the replay writes again.
        started = time.monotonic()
        self._forward(size)  # warm-up: kernels compiled, the allocator settled
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward(size)
        self.graphs[size] = graph
        log.info("captured the decode CUDA graph of batch size %d in %.0f ms", size,
                 (time.monotonic() - started) * 1000)
