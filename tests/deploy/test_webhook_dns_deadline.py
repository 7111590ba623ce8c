"""Resolving a webhook's host is part of its attempt: a resolver that hangs fails the attempt
as a timeout within the attempt's deadline, and the time it takes comes out of that deadline."""

from __future__ import annotations

import ipaddress
import socket
import time
from typing import Any

import pytest

from worker.control import webhook
from worker.control.webhook import Target, post_event

URL = "http://hooks.example.test/in"
EVENT = {"type": "batch.completed", "batch_id": "b7"}
ALLOW = (ipaddress.ip_network("127.0.0.0/8"),)


def slow_lookup(delay_s: float) -> Any:
    def lookup(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        time.sleep(delay_s)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.2", port))]
    return lookup


def test_a_hanging_resolver_fails_the_attempt_as_a_timeout_within_the_deadline() -> None:
    started = time.monotonic()
    error = post_event(URL, EVENT, "s", 0.5, allow=ALLOW, lookup=slow_lookup(5.0))
    assert error == "TimeoutError: 'hooks.example.test' was not resolved by the deadline"
    # Not before the deadline; well before the resolver's 5 s (a ceiling a loaded machine
    # does not reach, only an attempt that waits for the resolver).
    assert 0.45 < time.monotonic() - started < 4.0


def test_the_post_gets_what_resolving_left_of_the_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    posted: list[tuple[str, float]] = []

    def post(target: Target, body: bytes, headers: dict[str, str], deadline: float) -> int:
        posted.append((target.address, deadline - time.monotonic()))
        return 204

    monkeypatch.setattr(webhook, "_post", post)
    assert post_event(URL, EVENT, "s", 2.0, allow=ALLOW, lookup=slow_lookup(0.6)) is None
    [(address, left_s)] = posted
    # What the 0.6 s lookup left (~1.4 s), not the whole 2 s: the clock started before it.
    assert address == "127.0.0.2" and 0 < left_s < 1.45


@pytest.mark.parametrize(("raised", "error"), [
    (socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
     "refused: cannot resolve 'hooks.example.test': Name or service not known"),
    (OSError("resolver gone"), "OSError: resolver gone"),
])
def test_a_resolver_error_inside_the_attempt_is_still_named(raised: Exception,
                                                             error: str) -> None:
    def lookup(*args: Any, **kwargs: Any) -> list[Any]:
        raise raised

    assert post_event(URL, EVENT, "s", 1.0, allow=ALLOW, lookup=lookup) == error
