"""Prefix-affinity routing: jobs that share a prompt prefix go to the same worker's engine.

Each job has a *prefix key*: its leading system messages, or else the first
:data:`PREFIX_KEY_CHARS` characters of its prompt (about one KV block of tokens). The key
picks one of :data:`ROUTE_BUCKETS` streams of the model (a stable hash, so producers and
workers agree without talking). Each bucket belongs to one live worker of the model, chosen
by rendezvous (highest-random-weight) hashing over the live workers: every worker computes
the same owners from the same live set, and when a worker joins or dies only the buckets it
gains or held move. A worker reads its own buckets first; with room left and its buckets
empty, it steals from the others, the fullest first. So a shared system prompt is prefilled
on one engine and stays in its prefix cache, no bucket waits on a dead worker (its lease
lapses, its buckets have new owners at the next pull), and no worker idles while another has
a queue. See "Prefix-affinity routing" in docs/queue.md for the trade-off.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from itertools import takewhile

from jobs.schemas import JobSpec

ROUTE_BUCKETS = 64  # streams per model; a deployment's producers and workers must agree
PREFIX_KEY_CHARS = 64  # characters of a prompt without a system message that make its key


def prefix_key(spec: JobSpec) -> str:
    """What jobs that should share an engine have in common: the system messages a chat
    starts with, or else the opening characters of the prompt."""
    if spec.messages is not None:
        if spec.messages[0].role == "system":
            lead = takewhile(lambda m: m.role == "system", spec.messages)
            return "system:" + json.dumps([m.content for m in lead])
        return "text:" + spec.messages[0].content[:PREFIX_KEY_CHARS]
    text = spec.prompt if spec.prompt is not None else spec.raw_prompt or ""
    return "text:" + text[:PREFIX_KEY_CHARS]


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def bucket_of(spec: JobSpec) -> int:
    """The bucket (stream index) of ``spec``'s prefix key."""
    return _hash(prefix_key(spec)) % ROUTE_BUCKETS


def owned_buckets(worker_id: str, live: Collection[str]) -> list[int]:
    """The buckets ``worker_id`` owns among the ``live`` workers (itself counted live): each
    bucket goes to the worker with the highest hash of (worker, bucket)."""
    workers = set(live) | {worker_id}
    return [b for b in range(ROUTE_BUCKETS)
            if max(workers, key=lambda w: (_hash(f"{w}\0{b}"), w)) == worker_id]
