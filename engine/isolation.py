"""Per-request fault isolation for one engine step.

A step runs every scheduled sequence in one forward; when it raises, the batch is bisected:
each half runs again (the KV it writes is the same, and the step's block copies ran with the
first attempt), down to single sequences. A sequence that fails alone is its request's fault;
the others get their tokens.

A fault that is the engine's (a device error, a bug) fails every request it meets. So when a
bisection finds that nothing could run, the runner's warm-up forward is tried as a probe: if it
fails too, the fault is raised and the caller gives its requests back (a worker exits, and its
jobs go to other workers) rather than failing them; if it runs, the requests that failed alone
were the culprits, however many there were.

The sampler's per-request generators may have advanced in a failed attempt, so a seeded
co-tenant's draw can differ from a fault-free run; greedy outputs do not.
"""

from __future__ import annotations

import logging

from engine.model_runner import ModelRunner
from engine.scheduler import ModelOutput, SchedulerOutput

log = logging.getLogger(__name__)


class FaultIsolator:
    """Runs steps through ``runner``, bisecting a failed one down to the requests it fails."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._ran = False  # some part of the current step ran

    def run(self, batch: SchedulerOutput) -> tuple[ModelOutput, dict[str, str]]:
        """(what the runner computed, request id -> error) of the sequences that ran."""
        try:
            return self.runner.run(batch), {}
        except Exception as exc:
            self._ran = False
            sampled, faults = self._bisect(batch, exc)
            if not self._ran and not self._engine_works():
                raise  # every request it meets fails: the engine's fault, not theirs
            log.warning("step failed (%s: %s); failed alone: %s", type(exc).__name__, exc,
                        ", ".join(sorted(faults)))
            return sampled, faults

    def _engine_works(self) -> bool:
        try:
            self.runner.warm_up()  # a decode over the cache, no request involved
        except Exception:
            log.exception("the engine fails without any request: its fault")
            return False
        return True

    def _bisect(self, batch: SchedulerOutput,
                exc: Exception) -> tuple[ModelOutput, dict[str, str]]:
        if len(batch.seqs) == 1:
            return ModelOutput(), {batch.seqs[0].seq.request_id: f"{type(exc).__name__}: {exc}"}
        sampled = ModelOutput()
        faults: dict[str, str] = {}
        middle = len(batch.seqs) // 2
        for seqs in (batch.seqs[:middle], batch.seqs[middle:]):
            part = SchedulerOutput.of(seqs)  # its copies and swaps ran with the first attempt
            try:
                sampled |= self.runner.run(part)
                self._ran = True
            except Exception as part_exc:
                part_sampled, part_faults = self._bisect(part, part_exc)
                sampled |= part_sampled
                faults |= part_faults
        return sampled, faults
