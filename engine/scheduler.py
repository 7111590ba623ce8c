"""Iteration-level scheduler: continuous batching, chunked prefill, prefix reuse, preemption."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.outputs import FinishReason, SchedulerCounters
from engine.pooler import embedding
from engine.sampler import Sampled
from engine.sequence import Request, Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: tokens ``[start, start + num_new_tokens)``."""

    seq: Sequence
    start: int
    num_new_tokens: int
    # The chunk reaches the last token of a generating sequence: sample the next one. A
    # pooling sequence never samples; its chunk's hidden states are pooled instead.
    sample: bool


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step computes. Decode-shaped entries (one new token) come first.

    Before the forward the runner makes, in this order, the swap-out copies (device block,
    host block), the swap-in copies (host block, device block) and the copy-on-write
    ``block_copies`` (source, destination); a block freed by a swap-out may be written later
    in the same step.
    """

    seqs: tuple[ScheduledSeq, ...]
    num_decodes: int
    block_copies: tuple[tuple[int, int], ...]
    num_batched_tokens: int
    swap_out: tuple[tuple[int, int], ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, seqs: tuple[ScheduledSeq, ...], block_copies: tuple[tuple[int, int], ...] = (),
           swap_out: tuple[tuple[int, int], ...] = (),
           swap_in: tuple[tuple[int, int], ...] = ()) -> SchedulerOutput:
        """The output that computes ``seqs`` (decode-shaped entries already first)."""
        return cls(seqs=seqs, num_decodes=sum(1 for s in seqs if s.num_new_tokens == 1),
                   block_copies=block_copies,
                   num_batched_tokens=sum(s.num_new_tokens for s in seqs),
                   swap_out=swap_out, swap_in=swap_in)

    def without(self, request_ids: set[str]) -> SchedulerOutput:
        """The sequences of this step that ran, less those of ``request_ids``: what
        ``Scheduler.update`` takes after a step that faulted (its copies and swaps ran)."""
        return self.of(tuple(s for s in self.seqs if s.seq.request_id not in request_ids))

    @property
    def is_empty(self) -> bool:
        return not self.seqs


StopCheck = Callable[[Sequence], FinishReason | None]


@dataclass
class ModelOutput:
    """What the runner computed in one step, by seq_id: the sampled token(s) of the sampling
    sequences, and each pooling sequence's partial of its chunk (``engine.pooler``; absent
    when the chunk holds nothing its method pools)."""

    sampled: dict[int, list[Sampled]] = field(default_factory=dict)
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)

    def __or__(self, other: ModelOutput) -> ModelOutput:
        return ModelOutput(self.sampled | other.sampled, self.pooled | other.pooled)


@dataclass(frozen=True)
class StepUpdate:
    """What :meth:`Scheduler.update` did with one step's tokens."""

    progressed: list[Sequence]  # produced a token this step, forks included, in batch order
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why its check raised


class Scheduler:
    """Decides each step which sequences run and how many tokens each computes.

    Running sequences go first (decodes and unfinished prefill chunks), then waiting ones in
    (priority, arrival) order after a prefix-cache lookup, all under one token budget. A
    waiting sequence whose next uncached block is being computed by a running sequence waits
    for it instead of computing it again (in-batch prefix dedup). When blocks run out, the
    lowest-priority, latest running sequence is preempted. With a host pool that has room,
    its KV is swapped out and it waits in ``swapped``; swapped sequences come back (swap in)
    before any waiting one of lower priority is admitted. Otherwise its blocks are freed and
    it goes back to the front of the waiting queue to be recomputed (mostly from the prefix
    cache).

    A pooling (embedding) sequence is scheduled as any prefill, chunks and preemption
    included, but never samples: it finishes in :meth:`update` at the step that computes its
    last prompt token, its blocks freed there (full ones stay in the prefix cache). One that
    does not read cached prefixes (``reads_cached_prefix``) is computed from position 0, and
    a recompute starts its pooled sum again.
    """

    def __init__(self, config: EngineConfig, kv: KVCacheManager,
                 stop_check: StopCheck | None = None) -> None:
        self.config = config
        self.kv = kv
        self.stop_check = stop_check  # why a sequence stops after its newest token
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []  # sorted by Sequence.sort_key
        # Unfinished requests by id, the one registry (the engine drops one once its output is
        # final).
        self.requests: dict[str, Request] = {}
        self.counters = SchedulerCounters()

    def add_request(self, request: Request) -> None:
        """Register ``request`` and queue its sequence."""
        self.requests[request.request_id] = request
        (seq,) = request.seqs
        self.add(seq)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = False
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.can_allocate_slots(seq, n):
                victim = self._pick_victim(i)
                preempted = True
                self._preempt(victim, swap_out)
                if victim is seq:
                    break
            else:
                scheduled.append(self._run(seq, n))
                budget -= n
                i += 1

        if not preempted:
            budget = self._swap_in(scheduled, budget, swap_in)
            budget = self._admit_waiting(scheduled, budget)

        scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # stable: decodes first
        out = SchedulerOutput.of(tuple(scheduled), tuple(self.kv.take_copies()),
                                 tuple(swap_out), tuple(swap_in))
        self.counters.num_steps += 1
        self.counters.num_batched_tokens += out.num_batched_tokens
        return out

    def _num_seats(self) -> int:
        return sum(1 + s.pending_forks for s in self.running)  # forks included

    def _swap_in(self, scheduled: list[ScheduledSeq], budget: int,
                 copies: list[tuple[int, int]]) -> int:
        num_seqs = self._num_seats()
        while self.swapped and budget > 0:
            seq = self.swapped[0]
            seats = 1 + seq.pending_forks
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_seqs + seats > self.config.max_num_seqs or not self.kv.can_swap_in(seq, n):
                break
            copies += self.kv.swap_in(seq)
            del self.swapped[0]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(self._run(seq, n))
            budget -= n
            num_seqs += seats
        return budget

    def _admit_waiting(self, scheduled: list[ScheduledSeq], budget: int) -> int:
        in_flight = self._in_flight_prefix_hashes()
        chunked = self.config.enable_chunked_prefill
        admitted: list[Sequence] = []
        num_seqs = self._num_seats()
        # A swapped sequence that could not come back goes before any waiting one after it.
        first_swapped = self.swapped[0].sort_key() if self.swapped else None
        for seq in self.waiting:
            seats = 1 + seq.pending_forks
            if budget == 0 or num_seqs + seats > self.config.max_num_seqs:
                break
            if first_swapped is not None and seq.sort_key() > first_swapped:
                break
            if seq.pending_grammar is not None:
                continue  # its grammar is compiling: the others go ahead
            cached = self.kv.find_cached_prefix(seq) if seq.reads_cached_prefix else []
            start = len(cached) * self.kv.block_size
            if (seq.reads_cached_prefix and len(cached) < len(seq.block_hashes)
                    and seq.block_hashes[len(cached)] in in_flight):
                continue  # a running sequence computes this block right now: reuse it next step
            remaining = seq.num_tokens - start
            if remaining > budget and not chunked:
                break
            n = min(remaining, budget)
            if not self.kv.can_allocate_slots(seq, n, cached):
                break
            self.kv.allocate_slots(seq, n, cached)
            seq.num_computed_tokens = start
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.monotonic()
                seq.metrics.num_cached_tokens = start
                self.counters.prefix_cache_queries += seq.num_tokens
                self.counters.prefix_cache_hits += start
            seq.status = SequenceStatus.RUNNING
            scheduled.append(self._scheduled(seq, n))
            budget -= n
            num_seqs += seats
            admitted.append(seq)
            in_flight.update(self._unscheduled_hashes(seq, start + n))
        if admitted:
            ids = {id(s) for s in admitted}
            self.waiting = [s for s in self.waiting if id(s) not in ids]
            self.running.extend(admitted)
        return budget

    def _in_flight_prefix_hashes(self) -> set[bytes]:
        # Prompt blocks that running sequences have not computed yet.
        hashes: set[bytes] = set()
        if self.kv.enable_prefix_caching:
            for seq in self.running:
                if seq.num_computed_tokens < seq.num_prompt_tokens:
                    hashes.update(self._unscheduled_hashes(seq, seq.num_computed_tokens))
        return hashes

    def _unscheduled_hashes(self, seq: Sequence, computed: int) -> list[bytes]:
        return seq.block_hashes[computed // self.kv.block_size :]

    def _run(self, seq: Sequence, n: int) -> ScheduledSeq:
        self.kv.allocate_slots(seq, n)
        return self._scheduled(seq, n)

    def _scheduled(self, seq: Sequence, n: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        if start < seq.num_prompt_tokens:
            self.counters.num_prompt_tokens += min(n, seq.num_prompt_tokens - start)
        blocks = len(seq.block_table)
        if blocks > seq.metrics.peak_kv_blocks:
            seq.metrics.peak_kv_blocks = blocks
        return ScheduledSeq(seq, start, n,
                            sample=start + n == seq.num_tokens and seq.pooling is None)

    def _pick_victim(self, current: int) -> Sequence:
        # Lowest priority, latest arrival among those not scheduled yet this step; the
        # current sequence itself when it is the only candidate.
        candidates = self.running[current:]
        return max(candidates, key=Sequence.sort_key)

    def _preempt(self, seq: Sequence, swap_out: list[tuple[int, int]]) -> None:
        self.running.remove(seq)
        seq.metrics.num_preemptions += 1
        self.counters.num_preemptions += 1
        if self.kv.can_swap_out(seq):
            swap_out += self.kv.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=Sequence.sort_key)
            self.counters.num_swaps += 1
            return
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.pooled = None
        self.add(seq)

    def update(self, out: SchedulerOutput, result: ModelOutput) -> StepUpdate:
        """Each token's fate, in one pass after the forward: append it, check the stop
        condition (``stop_check``), and finish and free the sequences that stop.
        ``result.sampled`` maps seq_id -> new token(s): a sequence with pending forks receives
        ``n`` tokens and forks into ``n`` samples. A pooling sequence adds its chunk's partial
        to its pooled sum; at its last prompt token it gets its embedding and finishes
        (``stop``), progressed like a sampled one. A stop check that raises (a grammar refused
        the token) fails its request alone: its sequences are left for the caller to end.
        """
        now = time.monotonic()
        update = StepUpdate([])
        stopped: dict[FinishReason, list[Sequence]] = {}
        for s in out.seqs:
            seq = s.seq
            seq.num_computed_tokens = s.start + s.num_new_tokens
            if seq.pooling is not None:
                if self._pool(seq, result.pooled.get(seq.seq_id), now):
                    update.progressed.append(seq)
                    stopped.setdefault(FinishReason.STOP, []).append(seq)
                continue
            if not s.sample:
                continue
            samples = result.sampled[seq.seq_id]
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            family = [seq]
            if seq.pending_forks:
                family += self._fork(seq, seq.pending_forks)
            for member, sample in zip(family, samples, strict=True):
                member.append(sample.token, sample.logprobs)
                self.counters.num_generated_tokens += 1
                update.progressed.append(member)
                if self.stop_check is None:
                    continue
                try:
                    reason = self.stop_check(member)
                except Exception as exc:
                    update.failed[member.request_id] = f"{type(exc).__name__}: {exc}"
                    continue
                if reason is not None:
                    stopped.setdefault(reason, []).append(member)
        for reason, seqs in stopped.items():
            self.finish([s for s in seqs if s.request_id not in update.failed], reason)
        return update

    @staticmethod
    def _pool(seq: Sequence, partial: torch.Tensor | None, now: float) -> bool:
        """Add a chunk's partial to ``seq``'s pooled sum; whether its prompt is done (its
        embedding set)."""
        if partial is not None:
            seq.pooled = partial if seq.pooled is None else seq.pooled + partial
        if seq.num_computed_tokens < seq.num_prompt_tokens:
            return False
        assert seq.pooled is not None and seq.pooling is not None
        seq.embedding = embedding(seq.pooled, seq.pooling.dimensions)
        seq.metrics.first_token_time = now  # its one output
        return True

    def _fork(self, parent: Sequence, count: int) -> list[Sequence]:
        parent.pending_forks = 0
        children = [parent.fork(parent.index + k + 1) for k in range(count)]
        pos = self.running.index(parent) + 1
        for child in children:
            self.kv.fork(parent, child)
        self.running[pos:pos] = children
        self.requests[parent.request_id].seqs += children
        return children

    def finish(self, seqs: Iterable[Sequence], reason: FinishReason) -> None:
        """Finish sequences (any state) and free their blocks at once."""
        done = {id(s) for s in seqs}
        for seq in [s for s in (*self.running, *self.waiting, *self.swapped) if id(s) in done]:
            self.kv.free(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason
        self.running = [s for s in self.running if id(s) not in done]
        self.waiting = [s for s in self.waiting if id(s) not in done]
        self.swapped = [s for s in self.swapped if id(s) not in done]
