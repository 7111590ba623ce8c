"""Prefix-affinity routing (``jobs.route``) value by value: the exact prefix keys, the buckets
and owners of fixed inputs (the hash is part of the deployment's contract: producers and
workers of different releases must agree on both), every bucket reachable and owned, and a
worker counted live whether or not the live set names it."""

from __future__ import annotations

from jobs.route import PREFIX_KEY_CHARS, ROUTE_BUCKETS, bucket_of, owned_buckets, prefix_key
from jobs.schemas import JobSpec


def _chat(*messages: tuple[str, str]) -> JobSpec:
    return JobSpec(model="m", messages=[{"role": r, "content": c} for r, c in messages])


def test_the_constants() -> None:
    assert (ROUTE_BUCKETS, PREFIX_KEY_CHARS) == (64, 64)


def test_prefix_keys_exactly() -> None:
    assert prefix_key(_chat(("system", "A"), ("user", "x"))) == 'system:["A"]'
    # every leading system message, and only the leading ones
    assert prefix_key(_chat(("system", "A"), ("system", "B"), ("user", "x"),
                            ("system", "C"))) == 'system:["A", "B"]'
    long = "".join(chr(ord("a") + i % 26) for i in range(100))
    assert prefix_key(JobSpec(model="m", prompt=long)) == "text:" + long[:64]
    assert prefix_key(JobSpec(model="m", raw_prompt=long)) == "text:" + long[:64]
    assert prefix_key(JobSpec(model="m", prompt="short")) == "text:short"
    # no system message: the first message's opening, whatever its role
    assert prefix_key(_chat(("user", long), ("assistant", "y"), ("user", "z"))) == (
        "text:" + long[:64])
    assert prefix_key(_chat(("assistant", "hi"), ("system", "A"))) == "text:hi"


def test_buckets_of_fixed_keys() -> None:
    assert bucket_of(JobSpec(model="m", prompt="hello world")) == 54
    assert bucket_of(_chat(("system", "You rate reviews."), ("user", "x"))) == 38
    assert bucket_of(JobSpec(model="m", raw_prompt="x" * 100)) == 12
    # the model is not part of the key
    assert bucket_of(JobSpec(model="other", prompt="hello world")) == 54


def test_every_bucket_is_reached() -> None:
    seen = {bucket_of(JobSpec(model="m", prompt=f"prompt {i}")) for i in range(2000)}
    assert seen == set(range(ROUTE_BUCKETS))


def test_owners_of_fixed_live_sets() -> None:
    live = {f"w{i}" for i in range(5)}
    assert owned_buckets("w0", live) == [4, 5, 10, 14, 19, 32, 33, 36, 44, 57]
    assert owned_buckets("w3", live) == [1, 3, 6, 9, 22, 23, 26, 28, 29, 41, 49, 51, 54, 60,
                                         61]


def test_a_worker_is_counted_live_and_owners_partition_the_buckets() -> None:
    assert owned_buckets("w9", set()) == list(range(ROUTE_BUCKETS))
    assert owned_buckets("w9", ["w9"]) == list(range(ROUTE_BUCKETS))
    mine, theirs = set(owned_buckets("w9", {"w0"})), set(owned_buckets("w0", {"w9"}))
    assert mine and theirs and not mine & theirs
    assert mine | theirs == set(range(ROUTE_BUCKETS))
    # the live set as each worker sees it, with or without itself: the same owners
    live = [f"worker-{i}" for i in range(7)]
    owners: dict[int, str] = {}
    for w in live:
        own = owned_buckets(w, [x for x in live if x != w])
        assert own == owned_buckets(w, live)
        for b in own:
            assert b not in owners
            owners[b] = w
    assert sorted(owners) == list(range(ROUTE_BUCKETS))
