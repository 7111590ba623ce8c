"""The worker's intake (``worker.intake.Intake``) driven by hand on real Redis and PostgreSQL,
without an engine: how many deliveries a pull takes, what becomes of a malformed, refused or
second copy of a job, and what each decision of ``decide`` sends (acks, dead letters,
notices, metrics)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
import redis
import sqlalchemy as sa
from services import all_roles_store, wait_until

from jobs.client import JobClient
from jobs.constants import CONSUMER_GROUP, FIELD_ID, FIELD_JOB, Keys
from jobs.limits import JobLimits
from jobs.models import Job
from jobs.queue import STEAL_AFTER_MS, JobQueue
from jobs.route import bucket_of, owned_buckets
from jobs.schemas import JobSpec, JobStatus, Outcome
from jobs.store import DeliveryStore
from worker import intake as intake_module
from worker.intake import Intake
from worker.metrics import WorkerMetrics
from worker.outbox import Outbox
from worker.persist import ResultWriter
from worker.retry import RedisBackoff

SQL = all_roles_store()
MODEL = "tiny"


def _intake(redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, *,
            worker_id: str = "w1", max_deliveries: int = 3, lease_ttl_s: float = 60.0,
            limits: JobLimits | None = None, adapters: tuple[str, ...] = (),
            affinity: bool = False) -> Intake:
    q = JobQueue(redis_client, MODEL, keys)
    q.ensure_group()
    store = DeliveryStore(pg_engine)
    outbox = Outbox(q)
    metrics = WorkerMetrics(MODEL)
    writer = ResultWriter(store, worker_id, outbox, RedisBackoff(), metrics)
    return Intake(q, store, writer, outbox, metrics, limits or JobLimits(),
                  worker_id=worker_id, model_name=MODEL, max_deliveries=max_deliveries,
                  lease_ttl_s=lease_ttl_s, affinity=affinity, adapters=adapters)


def _pending(client: redis.Redis, q: JobQueue, consumer: str | None = None) -> int:
    total = 0
    for s in q.streams:
        if not client.exists(s):
            continue
        if consumer is None:
            total += int(client.xpending(s, CONSUMER_GROUP)["pending"])
        else:
            total += len(client.xpending_range(s, CONSUMER_GROUP, "-", "+", 1000,
                                               consumername=consumer))
    return total


def _finished(metrics: WorkerMetrics, status: str) -> float:
    return metrics.registry.get_sample_value(
        "kvbatch_jobs_total", {"model_name": MODEL, "status": status}) or 0.0


def _dead_lettered(metrics: WorkerMetrics) -> float:
    return metrics.registry.get_sample_value(
        "kvbatch_jobs_dead_lettered_total", {"model_name": MODEL}) or 0.0


def _specs(n: int, **kw) -> list[JobSpec]:  # type: ignore[no-untyped-def]
    return [JobSpec(model=MODEL, prompt=f"job {i}", **kw) for i in range(n)]


# -- pull ------------------------------------------------------------------------------------

@pytest.mark.parametrize("count", [1, 3, 5])
def test_a_pull_takes_exactly_the_room_it_is_given(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, count: int) -> None:
    intake = _intake(redis_client, keys, pg_engine)
    specs = _specs(5)
    intake.queue.enqueue(specs)
    assert intake.pull(time.time(), count, held=(), idle=False) == count
    assert len(intake) == count
    assert [s.id for _, s in intake.undecided] == [s.id for s in specs[:count]]
    assert _pending(redis_client, intake.queue, "w1") == count
    assert intake.queue.depth()[0] == 5 - count


def test_a_pull_without_room_reads_nothing(redis_client: redis.Redis, keys: Keys,
                                           pg_engine: sa.Engine) -> None:
    intake = _intake(redis_client, keys, pg_engine)
    intake.queue.enqueue(_specs(2))
    for count in (0, -1):
        assert intake.pull(time.time(), count, held=(), idle=True) == 0
    assert len(intake) == 0 and _pending(redis_client, intake.queue) == 0
    assert intake.queue.depth()[0] == 2


def test_each_delivery_keeps_its_own_job(redis_client: redis.Redis, keys: Keys,
                                         pg_engine: sa.Engine) -> None:
    intake = _intake(redis_client, keys, pg_engine)
    specs = [JobSpec(model=MODEL, prompt=f"p{i}", priority=0,
                     sampling={"max_tokens": i + 1, "temperature": 0.5 * i}) for i in range(3)]
    intake.queue.enqueue(specs)
    intake.pull(time.time(), 10, held=(), idle=False)
    for (d, spec), want in zip(intake.undecided, specs, strict=True):
        assert d.job_id == spec.id == want.id
        assert spec.prompt == want.prompt
        assert spec.sampling.max_tokens == want.sampling.max_tokens
        assert spec.sampling.temperature == want.sampling.temperature


def test_an_idle_pull_waits_for_a_new_entry_and_a_busy_one_does_not(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    intake = _intake(redis_client, keys, pg_engine)
    assert intake.pull(time.time(), 4, held=(), idle=False) == 0
    assert intake.pull(time.time(), 4, held=(), idle=True) == 0  # blocks briefly, nothing came
    intake.queue.enqueue(_specs(1))
    assert intake.pull(time.time(), 4, held=(), idle=True) == 1


def test_a_restarted_worker_takes_back_its_own_entries_first_and_only_as_many_as_it_has_room(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    first = _intake(redis_client, keys, pg_engine)
    old = _specs(3)
    first.queue.enqueue(old)
    assert first.pull(time.time(), 3, held=(), idle=False) == 3
    new = [JobSpec(model=MODEL, prompt="new")]
    first.queue.enqueue(new)
    # The same worker id after a restart: XREADGROUP > never returns those three again.
    again = _intake(redis_client, keys, pg_engine)
    again.take_back_own()
    assert again.pull(time.time(), 2, held=(), idle=False) == 2
    first_two = {s.id for _, s in again.undecided}
    assert len(first_two) == 2 and first_two < {s.id for s in old}
    assert again.pull(time.time(), 2, held=(), idle=False) == 2
    assert {s.id for _, s in again.undecided[2:]} == {s.id for s in [*old, *new]} - first_two
    assert again.pull(time.time(), 2, held=(), idle=False) == 0


def test_orphans_of_a_dead_worker_are_claimed_after_half_a_lease_only(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    dead = _intake(redis_client, keys, pg_engine, worker_id="dead")
    specs = _specs(2)
    dead.queue.enqueue(specs)
    assert dead.pull(time.time(), 2, held=(), idle=False) == 2
    lease = 4.0
    taker = _intake(redis_client, keys, pg_engine, worker_id="w2", lease_ttl_s=lease)
    t0 = time.time()
    assert taker.pull(t0, 10, held=(), idle=False) == 0  # not idle long enough
    time.sleep(lease / 2 + 0.1)
    # Claims are paced (lease / 3 apart, on the clock the loop passes in).
    assert taker.pull(t0 + lease / 3 - 0.01, 10, held=(), idle=False) == 0
    assert taker.pull(t0 + lease / 3, 1, held=(), idle=False) == 1  # within its room
    assert taker.pull(t0 + lease / 3 + 0.01, 10, held=(), idle=False) == 0
    assert taker.pull(t0 + 2 * lease / 3, 10, held=(), idle=False) == 1
    assert sorted(s.id for _, s in taker.undecided) == sorted(s.id for s in specs)
    assert _pending(redis_client, taker.queue, "w2") == 2


# -- parsing and refusals --------------------------------------------------------------------

def _raw(redis_client: redis.Redis, q: JobQueue, fields: dict[str, str]) -> None:
    redis_client.xadd(q.streams[0], fields)


def test_a_malformed_job_fails_alone_and_an_unreadable_entry_is_dead_lettered(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    intake = _intake(redis_client, keys, pg_engine)
    q = intake.queue
    good, mismatched, not_json = _specs(3)
    _raw(redis_client, q, {FIELD_ID: not_json.id, FIELD_JOB: "{not json"})
    _raw(redis_client, q, {FIELD_ID: mismatched.id, FIELD_JOB: good.model_dump_json()})
    _raw(redis_client, q, {FIELD_ID: "no such id!", FIELD_JOB: "{}"})
    _raw(redis_client, q, {"junk": "no id at all"})
    q.enqueue([good])
    assert intake.pull(time.time(), 10, held=(), idle=False) == 5
    assert [s.id for _, s in intake.undecided] == [good.id]
    unsaved = {o.job_id: (o, d) for o, d in intake.results._unsaved}
    assert set(unsaved) == {not_json.id, mismatched.id}
    for job_id, (outcome, d) in unsaved.items():
        assert outcome.status is JobStatus.FAILED
        assert outcome.error is not None
        assert outcome.error.startswith("malformed job message: ")
        assert d is not None and d.job_id == job_id
    assert good.id in unsaved[mismatched.id][0].error
    dead = intake.outbox.dead
    assert len(dead) == 2 and all(r.startswith("malformed job message: ") for _, r in dead)
    assert {d.job_id for d, _ in dead} == {"no such id!", None}
    assert _dead_lettered(intake.metrics) == 2
    assert not intake.outbox.acks


def test_a_job_of_another_model_or_over_a_limit_is_failed_with_the_reason(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    limits = JobLimits(max_job_tokens=100)
    intake = _intake(redis_client, keys, pg_engine, limits=limits, adapters=("ad",))
    q = intake.queue
    other = JobSpec(model="other", prompt="x")
    over = JobSpec(model=MODEL, prompt="x", sampling={"max_tokens": 101})
    at = JobSpec(model=MODEL, prompt="x", sampling={"max_tokens": 100})
    lora = JobSpec(model=f"{MODEL}:ad", prompt="x")
    lora_embed = JobSpec(model=f"{MODEL}:ad", embed={"input": ["a"]})
    base_embed = JobSpec(model=MODEL, embed={"input": ["a"]})
    for spec in (other, over, at, lora, lora_embed, base_embed):
        _raw(redis_client, q, {FIELD_ID: spec.id, FIELD_JOB: spec.model_dump_json()})
    assert intake.pull(time.time(), 10, held=(), idle=False) == 6
    assert [s.id for _, s in intake.undecided] == [at.id, lora.id, base_embed.id]
    errors = {o.job_id: o.error for o, _ in intake.results._unsaved}
    assert set(errors) == {other.id, over.id, lora_embed.id}
    assert all(o.status is JobStatus.FAILED for o, _ in intake.results._unsaved)
    assert all(d is not None and d.job_id == o.job_id for o, d in intake.results._unsaved)
    assert errors[other.id] == (f"unknown model 'other': this queue is served by {MODEL!r} "
                                "and its LoRA adapters ad")
    assert "max_tokens is 101, over the limit of 100" in errors[over.id]
    assert errors[lora_embed.id] == (f"embedding jobs run on the base model ({MODEL!r}), "
                                     f"not a LoRA adapter ('{MODEL}:ad')")


def test_an_unknown_model_without_adapters_names_the_model_only(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    intake = _intake(redis_client, keys, pg_engine)
    other = JobSpec(model="other", prompt="x")
    _raw(redis_client, intake.queue, {FIELD_ID: other.id, FIELD_JOB: other.model_dump_json()})
    intake.pull(time.time(), 10, held=(), idle=False)
    ((outcome, _),) = intake.results._unsaved
    assert outcome.error == f"unknown model 'other': this queue is served by {MODEL!r}"


def test_a_second_copy_is_acked_and_only_the_first_runs(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    intake = _intake(redis_client, keys, pg_engine)
    a, b, c = _specs(3)
    intake.queue.enqueue([a, b, a])
    intake.pull(time.time(), 10, held={c.id}, idle=False)
    assert [s.id for _, s in intake.undecided] == [a.id, b.id]
    ((copy,),) = [intake.outbox.acks]
    assert copy.job_id == a.id and copy.entry_id != intake.undecided[0][0].entry_id
    # A job held by the engine, and one still undecided from the last pull: copies too.
    intake.queue.enqueue([c, b])
    intake.pull(time.time(), 10, held={c.id}, idle=False)
    assert [s.id for _, s in intake.undecided] == [a.id, b.id]
    assert [d.job_id for d in intake.outbox.acks] == [a.id, c.id, b.id]
    assert not intake.results._unsaved


# -- decide ----------------------------------------------------------------------------------

def _set(pg_engine: sa.Engine, job_id: str, **values) -> None:  # type: ignore[no-untyped-def]
    with pg_engine.begin() as conn:
        conn.execute(sa.update(Job).where(Job.id == job_id).values(**values))


def test_decide_runs_some_and_settles_the_others(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    intake = _intake(redis_client, keys, pg_engine, max_deliveries=2)
    run, done, dead, expired, cancelled = specs = _specs(5)
    client.submit(specs)
    DeliveryStore(pg_engine).finish(
        [Outcome(done.id, JobStatus.SUCCEEDED, time.time())])
    _set(pg_engine, dead.id, attempts=2)
    _set(pg_engine, expired.id, deadline_at=datetime.now(UTC) - timedelta(seconds=30))
    _set(pg_engine, cancelled.id, cancel_requested=True)
    assert intake.pull(time.time(), 10, held=(), idle=False) == 5
    decided = intake.decide(time.time())
    assert [(d.job_id, s.id) for d, s in decided] == [(run.id, run.id)]
    assert len(intake) == 0 and intake.decide(time.time()) == []
    box = intake.outbox
    assert [(d.job_id, r) for d, r in box.dead] == [(dead.id, "delivered more than 2 times")]
    assert sorted(d.job_id for d in box.acks) == sorted([done.id, expired.id, cancelled.id])
    assert sorted(box.done) == sorted([(dead.id, "failed"), (expired.id, "expired"),
                                       (cancelled.id, "cancelled")])
    m = intake.metrics
    assert (_finished(m, "failed"), _finished(m, "expired"), _finished(m, "cancelled"),
            _finished(m, "succeeded"), _dead_lettered(m)) == (1, 1, 1, 0, 1)
    infos = {i.id: i for i in client.get_many([s.id for s in specs])}
    assert infos[run.id].status is JobStatus.RUNNING and infos[run.id].worker_id == "w1"
    assert infos[run.id].attempts == 1
    assert infos[dead.id].status is JobStatus.FAILED and infos[dead.id].attempts == 3
    box.flush()
    assert _pending(redis_client, intake.queue) == 1  # the one that runs


def test_decide_keeps_its_jobs_while_the_database_is_down(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    intake = _intake(redis_client, keys, pg_engine)
    specs = _specs(2)
    client.submit(specs)
    intake.pull(time.time(), 10, held=(), idle=False)
    down = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none",
                            connect_args={"connect_timeout": 2})
    up, intake.deliveries = intake.deliveries, DeliveryStore(down)
    now = time.time()
    assert intake.decide(now) == [] and len(intake) == 2
    intake.deliveries = up
    assert intake.decide(now) == []  # backing off
    assert len(intake) == 2
    decided = intake.decide(now + 30)
    assert sorted(s.id for _, s in decided) == sorted(s.id for s in specs) and len(intake) == 0
    # Recovered: a later outage backs off from the first step again (0.2 s).
    later = [JobSpec(model=MODEL, prompt="later")]
    client.submit(later)
    intake.pull(time.time(), 10, held=(), idle=False)
    intake.deliveries = DeliveryStore(down)
    assert intake.decide(now + 100) == []
    intake.deliveries = up
    assert [s.id for _, s in intake.decide(now + 100.25)] == [later[0].id]
    down.dispose()


def test_the_live_workers_of_the_pull_are_the_ones_a_delivery_is_decided_against(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    """A job running on a live worker is a second copy: skipped, not charged an attempt."""
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    (spec,) = _specs(1)
    client.submit([spec])
    q = JobQueue(redis_client, MODEL, keys)
    q.heartbeat("other", 60_000)
    # It runs on "other" (which read an entry of it since acked); its stream entry is a copy.
    DeliveryStore(pg_engine).begin_deliveries([spec.id], "other", 3, time.time())
    intake = _intake(redis_client, keys, pg_engine)
    intake.pull(time.time(), 10, held=(), idle=False)
    assert intake.decide(time.time()) == []
    assert [d.job_id for d in intake.outbox.acks] == [spec.id] and not intake.outbox.done
    (info,) = client.get_many([spec.id])
    assert (info.status, info.worker_id, info.attempts) == (JobStatus.RUNNING, "other", 1)


def test_a_copy_with_no_payload_id_mismatch_is_reported_in_json(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    """An entry whose payload is valid JSON of another shape fails with the parser's reason."""
    intake = _intake(redis_client, keys, pg_engine)
    (spec,) = _specs(1)
    _raw(redis_client, intake.queue, {FIELD_ID: spec.id, FIELD_JOB: json.dumps({"id": spec.id})})
    intake.pull(time.time(), 10, held=(), idle=False)
    ((outcome, d),) = intake.results._unsaved
    assert outcome.job_id == spec.id and outcome.status is JobStatus.FAILED
    assert d is not None and d.job_id == spec.id and not intake.undecided


@pytest.mark.parametrize("room", [2, 3])
def test_a_restart_takes_its_own_entries_then_orphans_within_the_same_room(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, room: int) -> None:
    lease = 4.0
    before = _intake(redis_client, keys, pg_engine, worker_id="w1", lease_ttl_s=lease)
    own = _specs(2)
    before.queue.enqueue(own)
    assert before.pull(time.time(), 2, held=(), idle=False) == 2
    dead = _intake(redis_client, keys, pg_engine, worker_id="dead")
    orphans = [JobSpec(model=MODEL, prompt=f"orphan {i}") for i in range(2)]
    dead.queue.enqueue(orphans)
    assert dead.pull(time.time(), 2, held=(), idle=False) == 2
    time.sleep(lease / 2 + 0.1)
    again = _intake(redis_client, keys, pg_engine, worker_id="w1", lease_ttl_s=lease)
    again.take_back_own()
    t0 = time.time()
    assert again.pull(t0, room, held=(), idle=False) == room
    got = [s.id for _, s in again.undecided]
    assert set(got[:2]) == {s.id for s in own}
    assert set(got[2:]) < {s.id for s in orphans} and len(got[2:]) == room - 2
    if room == 2:  # no room was left for orphans: the next pull claims them, unpaced
        assert again.pull(t0, 10, held=(), idle=False) == 2
        assert set(s.id for _, s in again.undecided[2:]) == {s.id for s in orphans}


def _split(worker_id: str, other: str) -> tuple[list[JobSpec], list[JobSpec]]:
    """Jobs of ``worker_id``'s buckets, and jobs of one bucket of ``other``'s, 6 each."""
    own = set(owned_buckets(worker_id, {other}))
    mine: list[JobSpec] = []
    theirs: list[JobSpec] = []
    i = 0
    while len(mine) < 6 or len(theirs) < 6:
        spec = JobSpec(model=MODEL, prompt=f"{i} " * 40)
        i += 1
        b = bucket_of(spec)
        if b in own:
            mine.append(spec)
        elif not theirs or b == bucket_of(theirs[0]):
            theirs.append(spec)
    return mine[:6], theirs[:6]


@pytest.mark.parametrize("room", [2, 4])
def test_a_pull_reads_its_own_buckets_first_then_steals_only_the_room_left(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, room: int) -> None:
    intake = _intake(redis_client, keys, pg_engine, affinity=True)
    intake.queue.heartbeat("w2", 60_000)  # a live worker owning the other buckets
    mine, theirs = _split("w1", "w2")
    intake.queue.enqueue([mine[0], *theirs[:3]])
    time.sleep(STEAL_AFTER_MS / 1000 + 0.2)  # theirs have waited long enough to be stolen
    assert intake.pull(time.time(), room, held=(), idle=False) == min(room, 4)
    got = [s.id for _, s in intake.undecided]
    assert got[0] == mine[0].id
    assert set(got[1:]) <= {s.id for s in theirs[:3]} and len(got) == min(room, 4)
    assert set(intake.owned) == set(owned_buckets("w1", {"w2"}))
    assert set(intake._others) == set(range(len(intake.queue.streams))) - set(intake.owned)


def test_an_idle_pull_blocks_on_its_own_buckets_and_returns_what_arrives(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(intake_module, "IDLE_BLOCK_MS", 20_000)  # a window the test can see
    name = f"intake-{uuid.uuid4().hex[:8]}"
    blocking = redis.Redis(host="127.0.0.1", port=6379, decode_responses=True,
                           client_name=name, socket_timeout=60)
    intake = _intake(blocking, keys, pg_engine, affinity=True)
    intake.queue.heartbeat("w2", 60_000)
    mine, _ = _split("w1", "w2")
    pulled: list[int] = []
    thread = threading.Thread(target=lambda: pulled.append(
        intake.pull(time.time(), 4, held=(), idle=True)), daemon=True)
    thread.start()

    def blocked() -> bool:
        return any(c.get("name") == name and c.get("cmd") == "xreadgroup"
                   for c in redis_client.client_list())

    try:
        assert wait_until(blocked, 15, 0.02)
        JobQueue(redis_client, MODEL, keys).enqueue(mine[:1])
        thread.join(30)
        assert pulled == [1] and [s.id for _, s in intake.undecided] == [mine[0].id]
    finally:
        thread.join(30)
        blocking.close()


def test_an_idle_pull_takes_no_more_than_its_room_and_the_rest_comes_next(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of several streams hands out one entry a stream: jobs that land in three buckets
    between a pull's reads and its idle wait are more than a room of one. The pull takes one;
    the others stay pending on the worker and its next pull takes them back first, none lost
    or doubled."""
    intake = _intake(redis_client, keys, pg_engine)
    jobs: list[JobSpec] = []
    i = 0
    while len(jobs) < 3:  # three jobs, three buckets
        spec = JobSpec(model=MODEL, prompt=f"{i} " * 40)
        i += 1
        if bucket_of(spec) not in {bucket_of(j) for j in jobs}:
            jobs.append(spec)
    read = intake.queue.read

    def read_then_jobs_arrive(*args, **kwargs):  # type: ignore[no-untyped-def]
        got = read(*args, **kwargs)
        if kwargs.get("steal"):  # the pull's last read: the jobs arrive right after it
            JobQueue(redis_client, MODEL, keys).enqueue(jobs)
        return got

    monkeypatch.setattr(intake.queue, "read", read_then_jobs_arrive)
    assert intake.pull(time.time(), 1, held=(), idle=True) == 1
    assert len(intake.undecided) == 1
    monkeypatch.undo()
    assert intake.pull(time.time(), 5, held=(), idle=False) == 2
    assert sorted(s.id for _, s in intake.undecided) == sorted(j.id for j in jobs)
    assert _pending(redis_client, intake.queue, "w1") == 3
