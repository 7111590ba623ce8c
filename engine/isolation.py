"""Per-request fault isolation for one engine step.

A step runs every scheduled sequence in one forward; when it raises, the batch is bisected:
each half runs again (the KV it writes is the same, and the step's block copies ran with the
first attempt), down to single sequences. A sequence that fails alone is its request's fault;
the others get their tokens.

A fault that is the engine's (a device error, a bug) fails every request it meets. So faults
are counted: once :data:`MAX_BLAMED_WITHOUT_SUCCESS` requests have been blamed with no
successful run in between, the next fault is raised, and the caller gives its requests back
(a worker exits, and its jobs go to other workers) rather than failing every job it holds.
Two poison requests alone in a step, or one on an idle engine, still fail alone.

The sampler's per-request generators may have advanced in a failed attempt, so a seeded
co-tenant's draw can differ from a fault-free run; greedy outputs do not.
"""

from __future__ import annotations

import logging

from engine.model_runner import ModelRunner
from engine.sampler import Sampled
from engine.scheduler import ScheduledSeq, SchedulerOutput

log = logging.getLogger(__name__)

MAX_BLAMED_WITHOUT_SUCCESS = 3


class FaultIsolator:
    """Runs steps through ``runner``, bisecting a failed one down to the requests it fails."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.blamed_without_success = 0

    def run(self, batch: SchedulerOutput) -> tuple[dict[int, list[Sampled]], dict[str, str]]:
        """(sampled tokens by seq_id, request id -> error) of the sequences that ran."""
        try:
            sampled = self.runner.run(batch)
        except Exception as exc:
            sampled, faults = self._bisect(batch, exc)
            self.blamed_without_success += len(faults)
            if self.blamed_without_success >= MAX_BLAMED_WITHOUT_SUCCESS and not sampled:
                raise  # every request it meets fails: the engine's fault, not theirs
            log.warning("step failed (%s: %s); failed alone: %s", type(exc).__name__, exc,
                        ", ".join(sorted(faults)))
            return sampled, faults
        self.blamed_without_success = 0
        return sampled, {}

    def _bisect(self, batch: SchedulerOutput,
                exc: Exception) -> tuple[dict[int, list[Sampled]], dict[str, str]]:
        if len(batch.seqs) == 1:
            return {}, {batch.seqs[0].seq.request_id: f"{type(exc).__name__}: {exc}"}
        sampled: dict[int, list[Sampled]] = {}
        faults: dict[str, str] = {}
        middle = len(batch.seqs) // 2
        for seqs in (batch.seqs[:middle], batch.seqs[middle:]):
            part = _part(seqs, ())  # the block copies ran with the first attempt
            try:
                sampled |= self.runner.run(part)
                self.blamed_without_success = 0
            except Exception as part_exc:
                part_sampled, part_faults = self._bisect(part, part_exc)
                sampled |= part_sampled
                faults |= part_faults
        return sampled, faults


def without_requests(batch: SchedulerOutput, request_ids: set[str]) -> SchedulerOutput:
    """``batch`` less the sequences of ``request_ids`` (for the scheduler's update)."""
    kept = tuple(s for s in batch.seqs if s.seq.request_id not in request_ids)
    return _part(kept, batch.block_copies)


def _part(seqs: tuple[ScheduledSeq, ...],
          block_copies: tuple[tuple[int, int], ...]) -> SchedulerOutput:
    # Decode-shaped entries stay first: the order of a slice of the batch.
    return SchedulerOutput(seqs=seqs, num_decodes=sum(1 for s in seqs if s.num_new_tokens == 1),
                           block_copies=block_copies,
                           num_batched_tokens=sum(s.num_new_tokens for s in seqs))
