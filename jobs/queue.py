"""The Redis Streams data plane of one model: enqueue, pull, ack, leases, dead letters.

One stream per model with one consumer group; each worker is a consumer named by its worker
id. Entries are deleted when acknowledged, so the stream holds exactly the jobs that are
waiting or held by a worker. A worker's lease is its heartbeat key: the pending entries of a
consumer without a heartbeat are claimed by live workers, and never those of a live one.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import redis

from jobs.constants import (
    CANCEL_MARKER_TTL_S,
    CONSUMER_GROUP,
    DONE_MARKER_TTL_S,
    FIELD_ID,
    FIELD_JOB,
    FIELD_REASON,
    Keys,
)
from jobs.schemas import JobSpec, encode_job

DEAD_LETTER_MAXLEN = 100_000

# Adds entries to a stream so that its undelivered part stays in priority order: the new
# entries and the undelivered ones worse than the best new one are deleted and added again,
# sorted by (priority, arrival). Atomic (a script), so no worker reads in between; entries
# already delivered are never moved. KEYS[1] the stream; ARGV[1] the group, then (job id, job
# JSON, priority) for each new entry in arrival order.
_ENQUEUE = """
local stream, group = KEYS[1], ARGV[1]
local entries, best = {}, nil
for i = 2, #ARGV, 3 do
  local p = tonumber(ARGV[i + 2])
  entries[#entries + 1] = {fields = {'id', ARGV[i], 'job', ARGV[i + 1], 'priority', ARGV[i + 2]},
                           priority = p}
  if best == nil or p < best then best = p end
end
local last = '0-0'
local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', stream)
if ok then
  for _, g in ipairs(groups) do
    for j = 1, #g, 2 do
      if g[j] == 'name' and g[j + 1] ~= group then break end
      if g[j] == 'last-delivered-id' then last = g[j + 1] end
    end
  end
end
local moved = {}
if best ~= nil then
  local moving = false
  for _, e in ipairs(redis.call('XRANGE', stream, '(' .. last, '+')) do
    local fields, p = e[2], 0
    for j = 1, #fields, 2 do
      if fields[j] == 'priority' then p = tonumber(fields[j + 1]) or 0 end
    end
    if p > best then moving = true end
    if moving then moved[#moved + 1] = {id = e[1], fields = fields, priority = p} end
  end
end
local all = {}
for i, e in ipairs(moved) do
  redis.call('XDEL', stream, e.id)
  e.seq = i
  all[#all + 1] = e
end
for i, e in ipairs(entries) do e.seq = #moved + i; all[#all + 1] = e end
table.sort(all, function(a, b)
  if a.priority ~= b.priority then return a.priority < b.priority end
  return a.seq < b.seq
end)
local ids = {}
for _, e in ipairs(all) do
  local id = redis.call('XADD', stream, '*', unpack(e.fields))
  if e.id == nil then ids[#ids + 1] = id end
end
return ids
"""


@dataclass(frozen=True)
class Delivery:
    """One stream entry handed to this worker. ``payload`` is the raw job JSON, unparsed."""

    entry_id: str
    job_id: str | None
    payload: str | None


class JobQueue:
    """Stream operations for ``model``. ``client`` must decode responses to ``str``."""

    def __init__(self, client: redis.Redis, model: str, keys: Keys | None = None) -> None:
        self.client = client
        self.model = model
        self.keys = keys = keys or Keys()
        self.stream = keys.stream(model)
        self._enqueue = client.register_script(_ENQUEUE)

    def ensure_group(self) -> None:
        try:
            self.client.xgroup_create(self.stream, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # -- producers ---------------------------------------------------------------------------

    def enqueue(self, specs: Sequence[JobSpec]) -> list[str]:
        """Add jobs to the stream, in priority order among the entries not yet delivered (a
        better priority goes before worse ones already waiting; equal ones keep their arrival
        order); returns the new entries' ids, in stream order."""
        args: list[str] = [CONSUMER_GROUP]
        for spec in specs:
            if spec.model != self.model:
                raise ValueError(f"job {spec.id} is for model {spec.model!r}, not {self.model!r}")
            args += [spec.id, encode_job(spec), str(spec.priority)]
        if not specs:
            return []
        return [str(e) for e in self._enqueue(keys=[self.stream], args=args)]

    # -- workers -----------------------------------------------------------------------------

    def read(self, consumer: str, count: int, block_ms: int | None = None) -> list[Delivery]:
        """Up to ``count`` new entries for ``consumer`` (blocking up to ``block_ms``)."""
        if count <= 0:
            return []
        try:
            reply = self.client.xreadgroup(
                CONSUMER_GROUP, consumer, {self.stream: ">"}, count=count, block=block_ms
            )
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_group()  # Redis restarted empty, or the stream was deleted
            return []
        return [_delivery(entry_id, fields) for _, entries in reply or [] for entry_id, fields
                in entries]

    def ack(self, entry_ids: Iterable[str]) -> None:
        """Acknowledge and delete entries (their results are stored)."""
        ids = list(entry_ids)
        if not ids:
            return
        pipe = self.client.pipeline(transaction=True)
        pipe.xack(self.stream, CONSUMER_GROUP, *ids)
        pipe.xdel(self.stream, *ids)
        pipe.execute()

    def heartbeat(self, worker_id: str, lease_ttl_ms: int, window: int = 0) -> None:
        """Renew ``worker_id``'s lease on the entries it holds; ``window`` is how many jobs it
        wants kept in the stream for it (see :meth:`window`)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.keys.heartbeat(worker_id), self.model, px=lease_ttl_ms)
        pipe.hset(self.keys.workers(), worker_id, self.model)
        pipe.hset(self.keys.feed_windows(self.model), worker_id, window)
        pipe.execute()

    def drop_heartbeat(self, worker_id: str) -> None:
        """End the lease now, so live workers claim what ``worker_id`` still holds."""
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(self.keys.heartbeat(worker_id))
        pipe.hdel(self.keys.feed_windows(self.model), worker_id)
        pipe.execute()

    def window(self, floor: int) -> int:
        """How many entries the stream should hold (waiting or held): what the live workers
        asked for together, or ``floor`` while none is live. Dead workers' requests are
        dropped here."""
        wanted = self.client.hgetall(self.keys.feed_windows(self.model))
        if not wanted:
            return floor
        pipe = self.client.pipeline(transaction=False)
        for name in wanted:
            pipe.exists(self.keys.heartbeat(name))
        alive = dict(zip(wanted, pipe.execute(), strict=True))
        dead = [n for n, hit in alive.items() if not hit]
        if dead:
            self.client.hdel(self.keys.feed_windows(self.model), *dead)
        live = [int(wanted[n]) for n, hit in alive.items() if hit]
        return sum(live) if live else floor

    def length(self) -> int:
        """Entries in the stream: waiting, or held by a worker."""
        return int(self.client.xlen(self.stream))

    def own_pending(self, consumer: str, page_size: int = 1000) -> list[str]:
        """Entry ids pending on ``consumer``: after a restart under the same worker id, the
        entries its previous process held (``XREADGROUP >`` never returns them again, and
        nobody claims them while the new process keeps the heartbeat alive)."""
        ids: list[str] = []
        start = "-"
        while True:
            try:
                pending = self.client.xpending_range(
                    self.stream, CONSUMER_GROUP, min=start, max="+", count=page_size,
                    consumername=consumer)
            except redis.ResponseError:  # no group yet: nothing pending
                return ids
            ids += [p["message_id"] for p in pending]
            if len(pending) < page_size:
                return ids
            start = "(" + ids[-1]

    def claim(self, consumer: str, entry_ids: Sequence[str],
              min_idle_ms: int = 0) -> tuple[list[Delivery], list[str]]:
        """``XCLAIM`` entries for ``consumer``: (deliveries, ids of entries deleted meanwhile,
        which are acked so they leave the pending list)."""
        if not entry_ids:
            return [], []
        entries = self.client.xclaim(self.stream, CONSUMER_GROUP, consumer, min_idle_ms,
                                     list(entry_ids))
        claimed = [_delivery(e_id, fields) for e_id, fields in entries if fields]
        gone = [e_id for e_id, fields in entries if not fields]
        if gone:
            self.client.xack(self.stream, CONSUMER_GROUP, *gone)
        return claimed, gone

    def claim_orphans(self, consumer: str, count: int, min_idle_ms: int) -> list[Delivery]:
        """Take over up to ``count`` entries pending on consumers whose heartbeat expired.

        ``min_idle_ms`` must be below the lease TTL minus the heartbeat interval (a dead
        consumer's entries have been idle at least that long when its lease expires); it makes
        two live workers claiming the same orphan at once settle on one of them, because a
        claim resets the entry's idle time.
        """
        if count <= 0:
            return []
        try:
            consumers = self.client.xinfo_consumers(self.stream, CONSUMER_GROUP)
        except redis.ResponseError:
            return []
        claimed: list[Delivery] = []
        for info in consumers:
            name = info["name"]
            if name == consumer or self.client.exists(self.keys.heartbeat(name)):
                continue
            if int(info["pending"]) == 0:
                self.client.xgroup_delconsumer(self.stream, CONSUMER_GROUP, name)
                self.client.hdel(self.keys.workers(), name)
                continue
            pending = self.client.xpending_range(
                self.stream, CONSUMER_GROUP, min="-", max="+", count=count - len(claimed),
                consumername=name,
            )
            claimed += self.claim(consumer, [p["message_id"] for p in pending], min_idle_ms)[0]
            if len(claimed) >= count:
                break
        return claimed

    def dead_letter(self, deliveries: Sequence[Delivery], reasons: Sequence[str]) -> None:
        """Copy entries to the dead-letter stream with their reasons, then ack them."""
        if not deliveries:
            return
        pipe = self.client.pipeline(transaction=True)
        for d, reason in zip(deliveries, reasons, strict=True):
            pipe.xadd(
                self.keys.dead_letter(self.model),
                {FIELD_ID: d.job_id or "", FIELD_JOB: d.payload or "", FIELD_REASON: reason},
                maxlen=DEAD_LETTER_MAXLEN, approximate=True,
            )
        ids = [d.entry_id for d in deliveries]
        pipe.xack(self.stream, CONSUMER_GROUP, *ids)
        pipe.xdel(self.stream, *ids)
        pipe.execute()

    def publish_done(self, finished: Iterable[tuple[str, str]]) -> None:
        """Tell waiters that jobs reached a terminal status: a marker key and a message each."""
        publish_done(self.client, self.keys, finished)

    def cancel_requested(self, job_ids: Sequence[str]) -> list[str]:
        """Which of ``job_ids`` have a pending cancel request."""
        if not job_ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.exists(self.keys.cancel(job_id))
        return [j for j, hit in zip(job_ids, pipe.execute(), strict=True) if hit]

    # -- inspection --------------------------------------------------------------------------

    def depth(self) -> tuple[int, int]:
        """(entries not yet delivered, entries delivered and not yet acknowledged)."""
        total = self.client.xlen(self.stream)
        try:
            pending = int(self.client.xpending(self.stream, CONSUMER_GROUP)["pending"])
        except redis.ResponseError:
            pending = 0
        return max(total - pending, 0), pending

    def drop(self, job_ids: Collection[str], chunk: int = 1000) -> int:
        """Delete the stream entries of ``job_ids`` (jobs that ended before a worker took them:
        a cancelled batch's backlog leaves Redis at once); returns how many were deleted."""
        dropped = 0
        start = "-"
        while True:
            entries = self.client.xrange(self.stream, min=start, max="+", count=chunk)
            doomed = [e for e, f in entries if f.get(FIELD_ID) in job_ids]
            if doomed:
                dropped += int(self.client.xdel(self.stream, *doomed))
            if len(entries) < chunk:
                return dropped
            start = "(" + entries[-1][0]

    def job_ids_in_stream(self, chunk: int = 1000) -> set[str]:
        """Ids of all jobs present in the stream (waiting or held by a worker)."""
        ids: set[str] = set()
        start = "-"
        while True:
            entries = self.client.xrange(self.stream, min=start, max="+", count=chunk)
            ids.update(f.get(FIELD_ID, "") for _, f in entries)
            if len(entries) < chunk:
                return ids
            start = "(" + entries[-1][0]

    def live_workers(self) -> set[str]:
        """Worker ids whose heartbeat is current (see :func:`live_workers`)."""
        return live_workers(self.client, self.keys)


def live_workers(client: redis.Redis, keys: Keys) -> set[str]:
    """Worker ids whose heartbeat is current. Workers whose heartbeat is gone leave the
    registry here, so it does not grow with every restart (a worker that comes back
    registers again with its next heartbeat)."""
    names = list(client.hkeys(keys.workers()))
    if not names:
        return set()
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.exists(keys.heartbeat(name))
    alive = dict(zip(names, pipe.execute(), strict=True))
    dead = [n for n, hit in alive.items() if not hit]
    if dead:
        client.hdel(keys.workers(), *dead)
    return {n for n, hit in alive.items() if hit}


def publish_done(client: redis.Redis, keys: Keys, finished: Iterable[tuple[str, str]]) -> None:
    """Tell waiters that jobs reached a terminal status: a marker key (kept
    :data:`DONE_MARKER_TTL_S`) and a message on the done channel each."""
    pipe = client.pipeline(transaction=False)
    for job_id, status in finished:
        pipe.set(keys.done(job_id), status, ex=DONE_MARKER_TTL_S)
        pipe.delete(keys.cancel(job_id))
        pipe.publish(keys.done_channel(), json.dumps({"id": job_id, "status": status}))
    pipe.execute()


def signal_cancel(client: redis.Redis, keys: Keys, job_id: str) -> None:
    """Ask whichever worker holds ``job_id`` to abort it."""
    pipe = client.pipeline(transaction=False)
    pipe.set(keys.cancel(job_id), "1", ex=CANCEL_MARKER_TTL_S)
    pipe.publish(keys.cancel_channel(), job_id)
    pipe.execute()


def _delivery(entry_id: str, fields: dict[str, str]) -> Delivery:
    return Delivery(entry_id=entry_id, job_id=fields.get(FIELD_ID) or None,
                    payload=fields.get(FIELD_JOB))
