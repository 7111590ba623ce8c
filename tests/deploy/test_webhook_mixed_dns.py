"""A webhook host whose DNS answer mixes public and inward addresses is refused, whatever the
order of the answer: the attempt could connect to any of them (a retry, another resolver, a
client that tries the next address), so every one must be reachable. The resolver is given to
``resolve`` as its ``lookup``."""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable
from typing import Any

import pytest

from worker.control.webhook import WebhookRefused, resolve

URL = "https://hooks.example.com/hook"


def _dns(*addresses: str) -> Callable[..., list[Any]]:
    """A resolver that answers ``addresses`` for hooks.example.com, in that order."""

    def lookup(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        assert host == "hooks.example.com" and port == 443
        answer = []
        for address in addresses:
            if ":" in address:
                answer.append((socket.AF_INET6, socket.SOCK_STREAM, 6, "", (address, port, 0, 0)))
            else:
                answer.append((socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port)))
        return answer

    return lookup


@pytest.mark.parametrize("answer, refused", [
    (("93.184.216.34", "10.0.0.5"), "10.0.0.5"),  # public first, private second
    (("10.0.0.5", "93.184.216.34"), "10.0.0.5"),  # private first
    (("1.1.1.1", "8.8.8.8", "127.0.0.1"), "127.0.0.1"),  # loopback last of three
    (("2606:4700:4700::1111", "::1"), "::1"),  # IPv6 loopback behind a public IPv6 one
    (("93.184.216.34", "fd00::5"), "fd00::5"),  # unique-local IPv6 behind a public IPv4
    (("8.8.8.8", "169.254.169.254"), "169.254.169.254"),  # cloud metadata
])
def test_an_answer_with_any_inward_address_is_refused(answer: tuple[str, ...],
                                                      refused: str) -> None:
    with pytest.raises(WebhookRefused, match=re.escape(f"resolves to {refused}, ")):
        resolve(URL, lookup=_dns(*answer))


def test_an_all_public_answer_is_accepted_and_pinned_to_its_first_address() -> None:
    target = resolve(URL, lookup=_dns("93.184.216.34", "2606:4700:4700::1111"))
    assert (target.scheme, target.host, target.port, target.path) == (
        "https", "hooks.example.com", 443, "/hook")
    assert target.address == "93.184.216.34"


def test_an_allowed_network_admits_its_addresses_and_only_those() -> None:
    allow = (ipaddress.ip_network("10.0.0.0/8"),)
    target = resolve(URL, allow, lookup=_dns("93.184.216.34", "10.0.0.5"))
    assert target.address == "93.184.216.34"
    with pytest.raises(WebhookRefused, match=re.escape("resolves to 192.168.1.9, ")):
        resolve(URL, allow, lookup=_dns("10.0.0.5", "93.184.216.34", "192.168.1.9"))
