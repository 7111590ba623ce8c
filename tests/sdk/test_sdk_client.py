"""The SDK against real Redis and PostgreSQL with an in-thread worker on a tiny model."""

from __future__ import annotations

import asyncio
import time

import pytest
from pydantic import ValidationError

from jobs import AsyncClient, Client, JobFailed
from jobs.schemas import JobStatus

MODEL = "tiny"


def test_submit_result_status(client: Client, start_worker) -> None:  # type: ignore[no-untyped-def]
    start_worker()
    job = client.submit(raw_prompt="hello", max_tokens=6, temperature=0.0, metadata={"k": 1})
    chat = client.submit(messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                         temperature=0.0)
    # A plain prompt on a model with a chat template is one user message.
    user = client.submit(prompt="hi", max_tokens=4, temperature=0.0)
    result = job.result(timeout_s=60)
    assert len(result.token_ids) == result.usage.completion_tokens
    assert 0 < result.usage.completion_tokens <= 6 and result.usage.prompt_tokens == 5
    assert job.status() is JobStatus.SUCCEEDED and job.info().metadata == {"k": 1}
    chat_result = chat.result(timeout_s=60)
    assert chat_result.usage.completion_tokens <= 4
    assert user.result(timeout_s=60).token_ids == chat_result.token_ids
    assert user.result().usage.prompt_tokens == chat_result.usage.prompt_tokens > 2
    # A handle made later, from the id alone, sees the same job.
    assert client.job(job.id).result(timeout_s=1) == result


def test_validation_before_enqueue(client: Client) -> None:
    with pytest.raises(ValidationError):
        client.submit(prompt="x", messages=[{"role": "user", "content": "y"}])
    with pytest.raises(ValidationError):
        client.submit(prompt="x", max_tokens="many")
    with pytest.raises(ValidationError):
        client.submit(prompt="x", no_such_param=1)
    with pytest.raises(ValueError, match=r"row 1: .*unknown field"):
        client.submit_batch([{"prompt": "a"}, {"prompt": "b", "colour": "red"}])
    with pytest.raises(ValueError, match="custom_id 'a' appears more than once"):
        client.submit_batch([{"custom_id": "a", "prompt": "a"}, {"custom_id": "a", "prompt": "b"}])
    assert client.jobs.redis.keys(f"{client.jobs.keys.prefix}:*") == []
    assert client.jobs.count_by_status() == {}


def test_cancel_queued_and_running(client: Client, start_worker) -> None:  # type: ignore[no-untyped-def]
    queued = client.submit(prompt="never runs", max_tokens=4)
    assert queued.cancel() is JobStatus.CANCELLED
    with pytest.raises(JobFailed) as failed:
        queued.result(timeout_s=5)
    assert failed.value.status is JobStatus.CANCELLED
    assert failed.value.reason == "cancelled before it started"

    start_worker()
    long = client.submit(prompt="long", max_tokens=5000, ignore_eos=True)
    deadline = time.monotonic() + 60
    while long.status() is not JobStatus.RUNNING and time.monotonic() < deadline:
        time.sleep(0.05)
    assert long.cancel() is JobStatus.RUNNING
    with pytest.raises(JobFailed) as failed:
        long.result(timeout_s=60)
    assert failed.value.status is JobStatus.CANCELLED
    assert 0 < len(failed.value.info.result.token_ids) < 5000


def test_failed_job_carries_reason_and_timeout(client: Client, start_worker) -> None:  # type: ignore[no-untyped-def]
    job = client.submit(prompt="x", max_tokens=4)
    with pytest.raises(TimeoutError):
        job.result(timeout_s=0.3)  # no worker yet
    start_worker()
    bad = client.submit(prompt="x" * 3000, max_tokens=4)  # over the tiny model's 2048 tokens
    with pytest.raises(JobFailed, match="max_model_len") as failed:
        bad.result(timeout_s=60)
    assert failed.value.status is JobStatus.FAILED and "max_model_len" in failed.value.reason
    assert job.result(timeout_s=60).usage.completion_tokens > 0


def test_bad_sampling_value_refused_at_submission(client: Client) -> None:
    """The engine's own rules run when the job is built: nothing reaches SQL or Redis."""
    for bad, field in (({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                       ({"max_tokens": 0}, "max_tokens"), ({"min_tokens": 9, "max_tokens": 4},
                                                           "min_tokens")):
        with pytest.raises(ValidationError, match=field):
            client.submit(prompt="x", **bad)
    with pytest.raises(ValueError, match=r"row 1: sampling: .*top_k must be in \[0, \d+\], got -3"):
        client.submit_batch([{"prompt": "fine"}, {"prompt": "x", "top_k": -3}])
    assert client.jobs.count_by_status() == {}
    assert client.jobs.redis.keys(f"{client.jobs.keys.prefix}:*") == []


def test_async_client_parity(services, start_worker) -> None:  # type: ignore[no-untyped-def]
    start_worker()

    async def main() -> None:
        async with AsyncClient(model=MODEL, **services) as client:
            jobs = [await client.submit(prompt=f"p{i}", max_tokens=4, temperature=0.0)
                    for i in range(5)]
            results = await asyncio.gather(*(j.result(timeout_s=60) for j in jobs))
            assert all(r.usage.completion_tokens > 0 for r in results)
            assert await jobs[0].status() is JobStatus.SUCCEEDED

            rows = [{"custom_id": f"r{i}", "prompt": f"row {i}"} for i in range(20)]
            batch = await client.submit_batch(rows, batch_id="abatch", max_tokens=3)
            seen = [info.custom_id async for info in batch.results(timeout_s=60)]
            assert sorted(seen) == sorted(r["custom_id"] for r in rows)
            counts = await batch.wait(timeout_s=5)
            assert counts.succeeded == 20 and counts.active == 0
            again = await client.submit_batch(rows, batch_id="abatch", max_tokens=3)
            assert await again.job_ids() == await batch.job_ids()
            stats = await client.stats(batch_id="abatch")
            assert stats.jobs == 20 and stats.generated_tokens > 0 and stats.gpu_s > 0

            queued = await client.submit(prompt="x", max_tokens=4, model="nobody-serves")
            assert await queued.cancel() is JobStatus.CANCELLED
            with pytest.raises(JobFailed):
                await queued.result(timeout_s=5)
            with pytest.raises(TimeoutError):
                await (await client.submit(prompt="x", model="nobody")).result(timeout_s=0.3)
            with pytest.raises(ValidationError):
                await client.submit(prompt="x", top_k="all")

    asyncio.run(main())


def test_submit_batch_sets_the_batch_webhook_and_deadline(client: Client) -> None:
    from datetime import UTC, datetime, timedelta

    from sqlalchemy.orm import Session

    from jobs.models import Batch

    deadline = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
    client.submit_batch([{"custom_id": "a", "prompt": "hi"}], batch_id="hooked",
                        webhook_url="http://127.0.0.1:9/hook", deadline=deadline, max_tokens=2)
    client.submit_batch([{"custom_id": "b", "prompt": "hi"}], batch_id="plain", max_tokens=2)
    with Session(client.jobs.engine) as session:
        hooked, plain = session.get(Batch, "hooked"), session.get(Batch, "plain")
    assert hooked is not None and plain is not None
    assert hooked.webhook_url == "http://127.0.0.1:9/hook"
    assert hooked.deadline_at is not None and hooked.deadline_at.timestamp() == deadline.timestamp()
    assert plain.webhook_url is None and plain.deadline_at is None


def test_thousands_of_async_waiters_share_one_subscription(services) -> None:  # type: ignore[no-untyped-def]
    """2,000 concurrent ``result()`` awaits once opened 2,000 pub/sub connections and most
    failed with MaxConnectionsError; they share one subscription now, and each wakes on its own
    job's notice."""
    import redis

    from jobs.aio import AsyncJobHandle
    from jobs.queue import publish_done
    from jobs.schemas import JobSpec

    n = 2000
    specs = [JobSpec(model=MODEL, prompt=f"p{i}") for i in range(n)]

    async def main() -> None:
        async with AsyncClient(model=MODEL, **services) as client:
            jobs = client.jobs
            await asyncio.to_thread(jobs.submit, specs)
            waiters = [asyncio.create_task(AsyncJobHandle(client, s.id).result(timeout_s=300))
                       for s in specs]
            while len(jobs.notices) < n:  # every waiter registered
                await asyncio.sleep(0.05)
            plain = redis.Redis.from_url(services["redis_url"])
            ((_, subscribers),) = plain.pubsub_numsub(jobs.done_channel)
            assert subscribers == 1
            # What a worker does: store the outcomes, then announce them.
            ids = [s.id for s in specs]
            await asyncio.to_thread(_finish, jobs.engine, ids)
            publish_done(plain, jobs.keys, [(i, "succeeded") for i in ids])
            results = await asyncio.gather(*waiters)
            assert [r.text for r in results] == ids
            assert plain.pubsub_numsub(jobs.done_channel) == [(jobs.done_channel.encode(), 1)]
            plain.close()

    asyncio.run(main())


def _finish(engine, ids: list[str]) -> None:  # type: ignore[no-untyped-def]
    """What a worker does before it announces jobs: store their outcomes."""
    from jobs.schemas import JobResult, Outcome
    from jobs.store import DeliveryStore

    store = DeliveryStore(engine)
    store.begin_deliveries(ids, "w", 3, time.time())
    store.finish([Outcome(i, JobStatus.SUCCEEDED, time.time(), result=JobResult(text=i))
                  for i in ids])


def test_threads_of_a_sync_client_share_one_subscription(client: Client, services) -> None:  # type: ignore[no-untyped-def]
    """Each sync ``result()`` once subscribed to the done channel on a connection of its own;
    the client's threads now share one subscription, woken each by its own job's notice."""
    import threading

    import redis

    from jobs.queue import publish_done

    handles = [client.submit(prompt=f"p{i}") for i in range(64)]
    results: dict[str, str] = {}

    def wait(handle) -> None:  # type: ignore[no-untyped-def]
        results[handle.id] = handle.result(timeout_s=60).text

    threads = [threading.Thread(target=wait, args=(h,)) for h in handles]
    for t in threads:
        t.start()
    plain = redis.Redis.from_url(services["redis_url"])
    channel = client.jobs.done_channel
    deadline = time.monotonic() + 10
    while len(client.jobs.notices) < len(handles) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert plain.pubsub_numsub(channel) == [(channel.encode(), 1)]
    ids = [h.id for h in handles]
    _finish(client.jobs.engine, ids)
    publish_done(plain, client.jobs.keys, [(i, "succeeded") for i in ids])
    for t in threads:
        t.join(60)
    assert results == {i: i for i in ids}
    assert len(client.jobs.notices) == 0  # every waiter left the hub
    plain.close()


def test_waiters_without_notices_are_found_by_one_batched_poll(services) -> None:  # type: ignore[no-untyped-def]
    """Jobs that end with no notice (a worker died between its commit and its publish) are
    found by the client's poll: a few ``IN`` reads a second for all waiters, not one query
    per waiter."""
    from jobs.aio import AsyncJobHandle
    from jobs.schemas import JobSpec

    n = 3000
    specs = [JobSpec(model=MODEL, prompt=f"p{i}") for i in range(n)]

    async def main() -> None:
        async with AsyncClient(model=MODEL, **services) as client:
            reads: list[int] = []
            reader = client.jobs.reader
            terminal_ids = reader.terminal_ids

            def counted(ids, *args, **kwargs):  # type: ignore[no-untyped-def]
                reads.append(len(ids))
                return terminal_ids(ids, *args, **kwargs)

            reader.terminal_ids = counted  # type: ignore[method-assign]
            await asyncio.to_thread(client.jobs.submit, specs)
            waiters = [asyncio.create_task(AsyncJobHandle(client, s.id).wait(timeout_s=60))
                       for s in specs]
            # One whole poll (3 reads) before the jobs end, however slow the machine is.
            deadline = time.monotonic() + 30
            while len(reads) < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            polls_before, started = len(reads), time.monotonic()
            await asyncio.to_thread(_finish, client.jobs.engine, [s.id for s in specs])
            infos = await asyncio.gather(*waiters)
            seconds = time.monotonic() - started
            assert {i.status for i in infos} == {JobStatus.SUCCEEDED}
            # Each read covers up to 1,000 waiters' jobs: 3 reads a poll, a poll a second (one
            # query per waiter would be 3,000 a second), however long the jobs took to end.
            assert polls_before >= 3 and max(reads) == 1000
            assert 0 < len(reads) - polls_before <= 3 * (seconds + 2)

    asyncio.run(main())


def test_batch_waits_read_statuses_not_results(services, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``BatchHandle.wait`` (sync and async) learns that jobs ended from ids and statuses:
    waiting on a million-row batch must not read a million results."""
    import threading

    from jobs.queue import publish_done
    from jobs.schemas import JobResult, Outcome
    from jobs.store import DeliveryStore, JobReader

    def no_rows(*_args, **_kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a wait read result rows")

    def finish_later(client: Client, ids: list[str]) -> threading.Thread:
        """What a worker does, a little later: store the outcomes, then announce them."""
        def run() -> None:
            time.sleep(0.3)
            store = DeliveryStore(client.jobs.engine)
            store.begin_deliveries(ids, "w", 3, time.time())
            store.finish([Outcome(i, JobStatus.SUCCEEDED, time.time(), result=JobResult(text=i))
                          for i in ids])
            publish_done(client.jobs.redis, client.jobs.keys, [(i, "succeeded") for i in ids])
        thread = threading.Thread(target=run)
        thread.start()
        return thread

    rows = [{"custom_id": f"r{i}", "raw_prompt": f"p{i}"} for i in range(50)]
    with Client(model=MODEL, **services) as client:
        batch = client.submit_batch(rows, batch_id="sync-wait")
        done = finish_later(client, list(batch.job_ids.values()))
        with monkeypatch.context() as patch:
            patch.setattr(JobReader, "get_many", no_rows)
            assert batch.wait(timeout_s=30).succeeded == 50
        done.join()
        async_batch = client.submit_batch(rows, batch_id="async-wait")
        done = finish_later(client, list(async_batch.job_ids.values()))

    async def main() -> None:
        async with AsyncClient(model=MODEL, **services) as aclient:
            handle = await aclient.batch("async-wait")
            with monkeypatch.context() as patch:
                patch.setattr(JobReader, "get_many", no_rows)
                assert (await handle.wait(timeout_s=30)).succeeded == 50

    asyncio.run(main())
    done.join()
