"""The Redis Streams data plane of one model: enqueue, pull, ack, leases, dead letters.

Each model has :data:`~jobs.route.ROUTE_BUCKETS` streams (a job goes to the bucket of its
prompt prefix, ``jobs.route``), each with one consumer group; each worker is a consumer named
by its worker id, in every bucket. Entries are deleted when acknowledged, so the streams hold
exactly the jobs that are waiting or held by a worker. A worker's lease is its heartbeat key:
the pending entries of a consumer without a heartbeat are claimed by live workers, and never
those of a live one.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

import redis

from jobs.constants import (
    CANCEL_MARKER_TTL_S,
    CONSUMER_GROUP,
    DONE_MARKER_TTL_S,
    FIELD_ID,
    FIELD_JOB,
    FIELD_PRIORITY,
    FIELD_REASON,
    FIELD_SEQ,
    Keys,
)
from jobs.route import ROUTE_BUCKETS, bucket_of
from jobs.schemas import JobSpec, JobStatus, encode_job, queue_model

DEAD_LETTER_MAXLEN = 100_000
# A worker steals an entry of another's bucket once it has waited this long: an idle owner
# (blocked on its buckets) takes a new entry well within it, so a burst of jobs arriving at an
# idle fleet is not scattered by whichever worker wakes first.
STEAL_AFTER_MS = 250

# Lua: the stream fields' names as locals, from ``jobs.constants`` (the scripts spell none),
# and the last id delivered to ``group`` in ``stream`` (entries after it are undelivered),
# creating the group, and the stream, where missing.
_PRELUDE = "".join(f"local {name} = '{value}'\n" for name, value in (
    ("FIELD_ID", FIELD_ID), ("FIELD_JOB", FIELD_JOB), ("FIELD_PRIORITY", FIELD_PRIORITY),
    ("FIELD_SEQ", FIELD_SEQ))) + """
local function last_delivered(stream, group)
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', stream)
  if ok then
    for _, g in ipairs(groups) do
      local name, last = nil, nil
      for j = 1, #g, 2 do
        if g[j] == 'name' then name = g[j + 1] end
        if g[j] == 'last-delivered-id' then last = g[j + 1] end
      end
      if name == group then return last end
    end
  end
  redis.call('XGROUP', 'CREATE', stream, group, '0', 'MKSTREAM')
  return '0-0'
end
"""

# Adds entries to a stream so that its undelivered part stays in priority order: the new
# entries and the undelivered ones worse than the best new one are deleted and added again,
# sorted by (priority, arrival). Atomic (a script), so no worker reads in between; entries
# already delivered are never moved. Creates the group if missing. KEYS[1] the stream;
# ARGV[1] the group, then (job id, job JSON, priority, seq) for each new entry in arrival
# order, where seq is its number in the model's arrivals (kept when the entry moves).
_ENQUEUE = _PRELUDE + """
local stream, group = KEYS[1], ARGV[1]
local entries, best = {}, nil
for i = 2, #ARGV, 4 do
  local p = tonumber(ARGV[i + 2])
  entries[#entries + 1] = {fields = {FIELD_ID, ARGV[i], FIELD_JOB, ARGV[i + 1],
                                     FIELD_PRIORITY, ARGV[i + 2], FIELD_SEQ, ARGV[i + 3]},
                           priority = p}
  if best == nil or p < best then best = p end
end
local last = last_delivered(stream, group)
local moved = {}
if best ~= nil then
  local moving = false
  for _, e in ipairs(redis.call('XRANGE', stream, '(' .. last, '+')) do
    local fields, p = e[2], 0
    for j = 1, #fields, 2 do
      if fields[j] == FIELD_PRIORITY then p = tonumber(fields[j + 1]) or 0 end
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

# Delivers up to ARGV[3] entries from the streams KEYS to consumer ARGV[2] of group ARGV[1]
# (created where missing), choosing them by ARGV[4]:
#   'merge': the best (priority, arrival) first across all the streams, as if they were one
#            stream (each stream's undelivered part is in that order, and FIELD_SEQ numbers the
#            model's arrivals: _ENQUEUE);
#   'drain': whole streams in turn, the one whose next entry has the best priority first, and
#            among equals the one with the most undelivered entries (a thief takes runs of one
#            prefix, not a job of each); only streams whose next entry was added ARGV[5] ms
#            ago or earlier (its owner had the time to take it).
# Returns XREADGROUP's reply: {stream, entries} for each stream read.
_READ = _PRELUDE + """
local group, consumer, count, mode = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local now = redis.call('TIME')
local added_before = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
                     - (tonumber(ARGV[5]) or 0)
local function field(fields, name)
  for j = 1, #fields, 2 do
    if fields[j] == name then return fields[j + 1] end
  end
  return nil
end
local function priority(fields) return tonumber(field(fields, FIELD_PRIORITY)) or 0 end
local function arrival(fields) return tonumber(field(fields, FIELD_SEQ)) or 0 end
local streams = {}
for i, key in ipairs(KEYS) do
  local last = last_delivered(key, group)
  local head = redis.call('XRANGE', key, '(' .. last, '+', 'COUNT', 1)[1]
  if head and mode == 'drain' and tonumber(string.match(head[1], '^(%d+)')) > added_before then
    head = nil
  end
  if head then
    local s = {key = key, head = head, take = 0}
    if mode == 'drain' then
      local pending = redis.call('XPENDING', key, group)[1]
      s.waiting = math.max(redis.call('XLEN', key) - pending, 1)
    end
    streams[#streams + 1] = s
  end
end
local left = count
if mode == 'merge' then
  while left > 0 do
    local best = nil
    for _, s in ipairs(streams) do
      if s.head then
        if best == nil then best = s else
          local p, q = priority(s.head[2]), priority(best.head[2])
          if p < q or (p == q and arrival(s.head[2]) < arrival(best.head[2])) then best = s end
        end
      end
    end
    if best == nil then break end
    best.take = best.take + 1
    left = left - 1
    best.head = redis.call('XRANGE', best.key, '(' .. best.head[1], '+', 'COUNT', 1)[1]
  end
else
  table.sort(streams, function(a, b)
    local p, q = priority(a.head[2]), priority(b.head[2])
    if p ~= q then return p < q end
    return a.waiting > b.waiting
  end)
  for _, s in ipairs(streams) do
    if left <= 0 then break end
    s.take = math.min(left, s.waiting)
    left = left - s.take
  end
end
local reply = {}
for _, s in ipairs(streams) do
  if s.take > 0 then
    local r = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', s.take,
                         'STREAMS', s.key, '>')
    reply[#reply + 1] = r[1]
  end
end
return reply
"""


@dataclass(frozen=True)
class Delivery:
    """One stream entry handed to this worker. ``payload`` is the raw job JSON, unparsed."""

    stream: str
    entry_id: str
    job_id: str | None
    payload: str | None


EntryRef = tuple[str, str]  # (stream, entry id)


class JobQueue:
    """Stream operations for ``model``. ``client`` must decode responses to ``str``."""

    def __init__(self, client: redis.Redis, model: str, keys: Keys | None = None) -> None:
        self.client = client
        self.model = model
        self.keys = keys = keys or Keys()
        self.streams = [keys.stream(model, b) for b in range(ROUTE_BUCKETS)]
        self.arrivals = keys.arrivals(model)
        self._enqueue = client.register_script(_ENQUEUE)
        self._read = client.register_script(_READ)

    def ensure_group(self) -> None:
        """Create the consumer group of every bucket's stream where missing (producers and
        reads create them too; this is for blocking reads and claims)."""
        pipe = self.client.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, redis.ResponseError) and "BUSYGROUP" not in str(reply):
                raise reply

    # -- producers ---------------------------------------------------------------------------

    def enqueue(self, specs: Sequence[JobSpec]) -> list[str]:
        """Add jobs to their buckets' streams (``jobs.route``), each in priority order among
        the entries not yet delivered (a better priority goes before worse ones already
        waiting; equal ones keep their arrival order, numbered across the model's streams by
        the counter ``Keys.arrivals``); returns the new entries' ids."""
        for spec in specs:
            if queue_model(spec.model) != self.model:
                raise ValueError(f"job {spec.id} is for model {spec.model!r}, not {self.model!r}")
        if not specs:
            return []
        first = int(self.client.incrby(self.arrivals, len(specs))) - len(specs)
        by_bucket: dict[int, list[str]] = {}
        for seq, spec in enumerate(specs, first + 1):
            by_bucket.setdefault(bucket_of(spec), []).extend(
                (spec.id, encode_job(spec), str(spec.priority), str(seq)))
        pipe = self.client.pipeline(transaction=False)
        for bucket, args in by_bucket.items():
            self._enqueue(keys=[self.streams[bucket]], args=[CONSUMER_GROUP, *args], client=pipe)
        return [str(e) for ids in pipe.execute() for e in ids]

    # -- workers -----------------------------------------------------------------------------

    def read(self, consumer: str, count: int, buckets: Sequence[int] | None = None, *,
             steal: bool = False) -> list[Delivery]:
        """Up to ``count`` new entries of ``buckets`` (all by default) for ``consumer``, now
        (never blocks): the best priority first across them, then the first to arrive. With
        ``steal``, runs of one bucket at a time, the fullest first, of buckets whose next
        entry has waited :data:`STEAL_AFTER_MS` (see ``_READ``)."""
        streams = self._streams(buckets)
        if count <= 0 or not streams:
            return []
        reply = self._read(keys=streams, args=[CONSUMER_GROUP, consumer, count,
                                               "drain" if steal else "merge", STEAL_AFTER_MS])
        found = [(stream, entry_id, dict(zip(fields[::2], fields[1::2], strict=True)))
                 for stream, entries in reply for entry_id, fields in entries]
        if not steal:  # the script's choice order, which it returns grouped by stream
            found.sort(key=lambda e: (_int(e[2], FIELD_PRIORITY), _int(e[2], FIELD_SEQ)))
        return [_delivery(*e) for e in found]

    def wait(self, consumer: str, block_ms: int,
             buckets: Sequence[int] | None = None) -> list[Delivery]:
        """Block up to ``block_ms`` for the first new entry of ``buckets`` (all by default);
        returns what arrived (one entry a stream at most)."""
        streams = self._streams(buckets) or self.streams
        try:
            reply = self.client.xreadgroup(CONSUMER_GROUP, consumer, dict.fromkeys(streams, ">"),
                                           count=1, block=block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_group()  # Redis restarted empty, or a stream was deleted
            return []
        return [_delivery(stream, entry_id, fields) for stream, entries in reply or []
                for entry_id, fields in entries]

    def _streams(self, buckets: Sequence[int] | None) -> list[str]:
        return self.streams if buckets is None else [self.streams[b] for b in buckets]

    def ack(self, deliveries: Iterable[Delivery]) -> None:
        """Acknowledge and delete entries (their results are stored)."""
        by_stream = _by_stream((d.stream, d.entry_id) for d in deliveries)
        if not by_stream:
            return
        pipe = self.client.pipeline(transaction=True)
        for stream, ids in by_stream.items():
            pipe.xack(stream, CONSUMER_GROUP, *ids)
            pipe.xdel(stream, *ids)
        pipe.execute()

    def heartbeat(self, worker_id: str, lease_ttl_ms: int, window: int = 0,
                  adapters: Sequence[str] = (), cpu_host: str | None = None) -> None:
        """Renew ``worker_id``'s lease on the entries it holds; ``window`` is how many jobs it
        wants kept in the streams for it (see :meth:`window`); ``adapters``: the names of the
        LoRA adapters it serves (``<model>:<adapter>``, see :func:`live_adapters`);
        ``cpu_host``: the host whose cores its engine shares (see :func:`live_cpu_peers`)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.keys.heartbeat(worker_id), self.model, px=lease_ttl_ms)
        pipe.hset(self.keys.workers(), worker_id, self.model)
        pipe.hset(self.keys.feed_windows(self.model), worker_id, window)
        if adapters:
            pipe.hset(self.keys.adapters(), worker_id, json.dumps(list(adapters)))
        if cpu_host:
            pipe.hset(self.keys.cpu_hosts(), worker_id, cpu_host)
        pipe.execute()

    def drop_heartbeat(self, worker_id: str) -> None:
        """End the lease now, so live workers claim what ``worker_id`` still holds and take
        over its buckets."""
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(self.keys.heartbeat(worker_id))
        pipe.hdel(self.keys.feed_windows(self.model), worker_id)
        pipe.execute()

    def serving(self) -> dict[str, int]:
        """The live workers of this model, each with the window it asked for (see
        :func:`live_entries`)."""
        wanted = live_entries(self.client, self.keys, self.keys.feed_windows(self.model))
        return {name: int(window) for name, window in wanted.items()}

    def window(self, floor: int) -> int:
        """How many entries the streams should hold (waiting or held): what the live workers
        asked for together, or ``floor`` while none is live."""
        return sum(self.serving().values()) or floor

    def length(self) -> int:
        """Entries in the streams: waiting, or held by a worker."""
        pipe = self.client.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xlen(stream)
        return sum(int(n) for n in pipe.execute())

    def own_pending(self, consumer: str, page_size: int = 1000) -> list[EntryRef]:
        """Entries pending on ``consumer``: after a restart under the same worker id, the
        entries its previous process held (``XREADGROUP >`` never returns them again, and
        nobody claims them while the new process keeps the heartbeat alive)."""
        refs: list[EntryRef] = []
        for stream in self.streams:
            start = "-"
            while True:
                try:
                    pending = self.client.xpending_range(
                        stream, CONSUMER_GROUP, min=start, max="+", count=page_size,
                        consumername=consumer)
                except redis.ResponseError:  # no group yet: nothing pending
                    break
                refs += [(stream, p["message_id"]) for p in pending]
                if len(pending) < page_size:
                    break
                start = "(" + refs[-1][1]
        return refs

    def claim(self, consumer: str, refs: Sequence[EntryRef],
              min_idle_ms: int = 0) -> tuple[list[Delivery], list[EntryRef]]:
        """``XCLAIM`` entries for ``consumer``: (deliveries, entries deleted meanwhile, which
        are acked so they leave the pending list)."""
        claimed: list[Delivery] = []
        gone: list[EntryRef] = []
        for stream, ids in _by_stream(refs).items():
            entries = self.client.xclaim(stream, CONSUMER_GROUP, consumer, min_idle_ms, ids)
            claimed += [_delivery(stream, e_id, fields) for e_id, fields in entries if fields]
            lost = [e_id for e_id, fields in entries if not fields]
            if lost:
                self.client.xack(stream, CONSUMER_GROUP, *lost)
                gone += [(stream, e_id) for e_id in lost]
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
        pipe = self.client.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xinfo_consumers(stream, CONSUMER_GROUP)
        replies = pipe.execute(raise_on_error=False)
        names = {info["name"] for reply in replies if isinstance(reply, list) for info in reply}
        names.discard(consumer)
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.exists(self.keys.heartbeat(name))
        dead = {n for n, hit in zip(names, pipe.execute(), strict=True) if not hit}
        if not dead:
            return []
        claimed: list[Delivery] = []
        for stream, reply in zip(self.streams, replies, strict=True):
            if not isinstance(reply, list):
                continue
            for info in reply:
                name = info["name"]
                if name not in dead:
                    continue
                if int(info["pending"]) == 0:
                    self.client.xgroup_delconsumer(stream, CONSUMER_GROUP, name)
                    continue
                if len(claimed) >= count:
                    continue
                pending = self.client.xpending_range(
                    stream, CONSUMER_GROUP, min="-", max="+", count=count - len(claimed),
                    consumername=name)
                claimed += self.claim(consumer, [(stream, p["message_id"]) for p in pending],
                                      min_idle_ms)[0]
        self.client.hdel(self.keys.workers(), *dead)
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
        for stream, ids in _by_stream((d.stream, d.entry_id) for d in deliveries).items():
            pipe.xack(stream, CONSUMER_GROUP, *ids)
            pipe.xdel(stream, *ids)
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
        pipe = self.client.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xlen(stream)
            pipe.xpending(stream, CONSUMER_GROUP)
        replies = pipe.execute(raise_on_error=False)
        total = sum(int(n) for n in replies[0::2])
        pending = sum(int(r["pending"]) for r in replies[1::2] if isinstance(r, dict))
        return max(total - pending, 0), pending

    def _entries(self, chunk: int) -> Iterator[tuple[str, list[tuple[str, dict[str, str]]]]]:
        """Every entry of the streams, a page (of one stream) at a time."""
        for stream in self.streams:
            start = "-"
            while True:
                entries = self.client.xrange(stream, min=start, max="+", count=chunk)
                yield stream, entries
                if len(entries) < chunk:
                    break
                start = "(" + entries[-1][0]

    def drop(self, job_ids: Collection[str], chunk: int = 1000) -> int:
        """Delete the stream entries of ``job_ids`` (jobs that ended before a worker took them:
        a cancelled batch's backlog leaves Redis at once); returns how many were deleted."""
        dropped = 0
        for stream, entries in self._entries(chunk):
            doomed = [e for e, f in entries if f.get(FIELD_ID) in job_ids]
            if doomed:
                dropped += int(self.client.xdel(stream, *doomed))
        return dropped

    def job_ids_in_stream(self, chunk: int = 1000) -> set[str]:
        """Ids of all jobs present in the streams (waiting or held by a worker)."""
        return {f.get(FIELD_ID, "") for _, entries in self._entries(chunk) for _, f in entries}

    def live_workers(self) -> set[str]:
        """Worker ids whose heartbeat is current (see :func:`live_entries`)."""
        return set(live_workers(self.client, self.keys))


def live_workers(client: redis.Redis, keys: Keys) -> dict[str, str]:
    """Worker id -> served model name of every worker whose heartbeat is current (see
    :func:`live_entries`)."""
    return live_entries(client, keys, keys.workers())


def live_adapters(client: redis.Redis, keys: Keys) -> set[str]:
    """The LoRA adapters live workers serve, as jobs name them (``<model>:<adapter>``)."""
    entries = live_entries(client, keys, keys.adapters())
    return {name for names in entries.values() for name in json.loads(names)}


def live_cpu_peers(client: redis.Redis, keys: Keys, host: str) -> list[str]:
    """The live workers whose CPU engines share ``host``'s cores (their heartbeats name
    it), by worker id."""
    return sorted(w for w, h in live_entries(client, keys, keys.cpu_hosts()).items() if h == host)


def live_entries(client: redis.Redis, keys: Keys, registry: str) -> dict[str, str]:
    """The entries of ``registry``, a hash keyed by worker id, whose worker's heartbeat is
    current. The dead workers' entries leave the hash here, so it does not grow with every
    restart (a worker that comes back registers again with its next heartbeat)."""
    entries = client.hgetall(registry)
    if not entries:
        return {}
    pipe = client.pipeline(transaction=False)
    for name in entries:
        pipe.exists(keys.heartbeat(name))
    alive = dict(zip(entries, pipe.execute(), strict=True))
    dead = [n for n, hit in alive.items() if not hit]
    if dead:
        client.hdel(registry, *dead)
    return {n: entries[n] for n, hit in alive.items() if hit}


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


def announce_ended(client: redis.Redis, keys: Keys, status: JobStatus,
                   ended: Sequence[tuple[str, str]]) -> None:
    """Tell waiters that the jobs ``ended`` (id, status before) are now ``status``, then ask
    the workers of those that were running to abort them, so that their KV blocks are freed
    (first: publishing a job's end clears its cancel marker)."""
    publish_done(client, keys, [(job_id, status.value) for job_id, _ in ended])
    for job_id, before in ended:
        if before == JobStatus.RUNNING.value:
            signal_cancel(client, keys, job_id)


def _delivery(stream: str, entry_id: str, fields: dict[str, str]) -> Delivery:
    return Delivery(stream=stream, entry_id=entry_id, job_id=fields.get(FIELD_ID) or None,
                    payload=fields.get(FIELD_JOB))


def _int(fields: dict[str, str], name: str) -> int:
    try:
        return int(fields.get(name, 0))
    except ValueError:
        return 0


def _by_stream(refs: Iterable[EntryRef]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for stream, entry_id in refs:
        grouped.setdefault(stream, []).append(entry_id)
    return grouped
