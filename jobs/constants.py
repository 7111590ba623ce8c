"""Every Redis key, stream, group and channel name in one place, the wire limits, and the
connection defaults every process (SDK, CLI, worker, control plane) falls back to.

A deployment (or a test) picks a key prefix; all names derive from it through :class:`Keys`,
so two prefixes never see each other's data.
"""

from __future__ import annotations

from dataclasses import dataclass

# The served name of the default model: what ``kvbatch worker`` loads without ``--model``.
from engine.config import DEFAULT_MODEL as DEFAULT_MODEL

DEFAULT_KEY_PREFIX = "kvbatch"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_DATABASE_URL = "sqlite:///kvbatch.db"
# Deliveries of one job before it is dead-lettered (the workers' limit, the reaper's too).
DEFAULT_MAX_DELIVERIES = 3
CONSUMER_GROUP = "workers"
# Largest JSON payload of one job on the wire (prompt, messages, parameters, metadata).
MAX_PAYLOAD_BYTES = 1 << 20
EMBED_TEXTS_PER_JOB = 64  # Client.embed's texts in one job
# Stream entry fields: the job id on its own (readable without parsing) and the job as JSON.
FIELD_ID = "id"
FIELD_JOB = "job"
FIELD_PRIORITY = "priority"  # the job's priority, so the stream can be kept in order
FIELD_SEQ = "seq"  # the job's place in its model's arrivals, across the model's streams
FIELD_REASON = "reason"
# How long a "job finished" marker stays for waiters that subscribe late.
DONE_MARKER_TTL_S = 24 * 3600
# How long a cancel request waits for the worker that holds the job.
CANCEL_MARKER_TTL_S = 24 * 3600


@dataclass(frozen=True)
class Keys:
    """Redis names under one prefix. Streams are per model; the rest are shared."""

    prefix: str = DEFAULT_KEY_PREFIX

    def stream(self, model: str, bucket: int) -> str:
        """Jobs of one routing bucket (``jobs.route``) waiting for (or held by) the workers of
        ``model``; group :data:`CONSUMER_GROUP`."""
        return f"{self.prefix}:jobs:{model}:{bucket}"

    def arrivals(self, model: str) -> str:
        """Counter numbering the entries added to ``model``'s streams (their ``seq`` field)."""
        return f"{self.prefix}:arrivals:{model}"

    def dead_letter(self, model: str) -> str:
        """Jobs given up on: delivered too often, or unreadable."""
        return f"{self.prefix}:dead:{model}"

    def heartbeat(self, worker_id: str) -> str:
        """Exists while the worker is alive; its TTL is the worker's lease."""
        return f"{self.prefix}:worker:{worker_id}"

    def workers(self) -> str:
        """Hash of worker id -> model of every worker that has ever registered (for listings)."""
        return f"{self.prefix}:workers"

    def adapters(self) -> str:
        """Hash of worker id -> JSON list of the LoRA adapters it serves, as jobs name them."""
        return f"{self.prefix}:adapters"

    def cpu_hosts(self) -> str:
        """Hash of worker id -> host name of every worker whose CPU engine shares its host's
        cores with the others on that host (``worker.cpu_share``)."""
        return f"{self.prefix}:cpu-hosts"

    def cancel(self, job_id: str) -> str:
        """Set when cancellation of a running job is requested."""
        return f"{self.prefix}:cancel:{job_id}"

    def cancel_channel(self) -> str:
        """Pub/sub channel carrying job ids to cancel, so workers react without polling."""
        return f"{self.prefix}:cancels"

    def done(self, job_id: str) -> str:
        """Set to the terminal status once the job's result is stored."""
        return f"{self.prefix}:done:{job_id}"

    def done_channel(self) -> str:
        """Pub/sub channel carrying ``{"id": ..., "status": ...}`` for each finished job."""
        return f"{self.prefix}:done"

    def batch_done(self, batch_id: str) -> str:
        """Set to the batch's final status (``BatchStatus``) once it is finalized."""
        return f"{self.prefix}:batch-done:{batch_id}"

    def batch_done_channel(self) -> str:
        """Pub/sub channel carrying the completion event of each finalized batch (JSON)."""
        return f"{self.prefix}:batches:done"

    def control_lock(self, name: str) -> str:
        """Held while one control-plane task runs, so replicas do not run it twice at once."""
        return f"{self.prefix}:lock:control:{name}"

    def reconcile_lock(self, model: str) -> str:
        """Held by the one worker reconciling ``model``'s stream against SQL."""
        return f"{self.prefix}:lock:reconcile:{model}"

    def feed_lock(self, model: str) -> str:
        """Held by the one process moving jobs of ``model`` from the SQL backlog to its stream."""
        return f"{self.prefix}:lock:feed:{model}"

    def batch_lease(self, batch_id: str) -> str:
        """Held by the one HTTP API process validating the batch or writing its files."""
        return f"{self.prefix}:lock:batch:{batch_id}"

    def feed_windows(self, model: str) -> str:
        """Hash of worker id -> how many jobs of ``model`` it wants kept in the stream."""
        return f"{self.prefix}:window:{model}"
