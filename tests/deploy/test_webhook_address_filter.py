"""The webhook address filter lets outward addresses through, those that carry an IPv4 one
included, and reads the IPv4 address each kind of IPv6 address carries (the refusals are in
``test_webhook_security.py``)."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import pytest

from jobs.schemas import check_webhook_url
from worker.control.webhook import WebhookRefused, _embedded_ipv4, resolve


def answering(*addresses: str) -> Any:
    """A resolver (``socket.getaddrinfo``'s signature) that answers ``addresses``."""

    def lookup(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a, port)) for a in addresses]

    return lookup


@pytest.mark.parametrize("address", [
    "8.8.8.8",
    "2606:4700:4700::1111",  # global IPv6 whose last 32 bits read as 0.0.17.17
    "64:ff9b::808:808",  # NAT64 of 8.8.8.8
    "::ffff:0:808:808",  # SIIT's IPv4-translated 8.8.8.8
    "2002:808:808::1",  # 6to4 of 8.8.8.8
])
def test_outward_addresses_are_reached_at_the_address_resolved(address: str) -> None:
    target = resolve("https://hooks.example.test/in?x=1", lookup=answering(address))
    assert (target.address, target.host, target.port, target.path) == (
        address, "hooks.example.test", 443, "/in?x=1")


@pytest.mark.parametrize("address", [
    "2001:2::1",  # benchmarking: not global, in no denied network, carries no IPv4
    "2001:10::1",  # ORCHID
])
def test_addresses_python_calls_not_global_are_refused(address: str) -> None:
    with pytest.raises(WebhookRefused) as refused:
        resolve("http://hooks.example.test/", lookup=answering(address))
    assert str(refused.value) == (
        f"'hooks.example.test' resolves to {address}, which webhooks may not reach (add its "
        "network to KVBATCH_WEBHOOK_ALLOW_NETWORKS)")


@pytest.mark.parametrize(("url", "scheme", "port", "path"), [
    ("http://hooks.example.test", "http", 80, "/"),
    ("https://hooks.example.test", "https", 443, "/"),
    ("http://hooks.example.test:8080/a/b", "http", 8080, "/a/b"),
    ("https://hooks.example.test/in?k=v&x=1", "https", 443, "/in?k=v&x=1"),
])
def test_the_target_keeps_the_urls_scheme_default_port_and_path(
        url: str, scheme: str, port: int, path: str) -> None:
    asked: list[tuple[str, int]] = []

    def lookup(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        asked.append((host, port))
        return answering("8.8.8.8")(host, port)

    target = resolve(url, lookup=lookup)
    assert (target.scheme, target.host, target.port, target.path) == (
        scheme, "hooks.example.test", port, path)
    assert asked == [("hooks.example.test", port)]


@pytest.mark.parametrize("url", [
    "ftp://hooks.example.test/", "http:///nohost", "http://user:pw@hooks.example.test/"])
def test_a_bad_url_is_refused_for_the_reason_the_submission_check_gives(url: str) -> None:
    with pytest.raises(ValueError) as reason:
        check_webhook_url(url)
    with pytest.raises(WebhookRefused) as refused:
        resolve(url, lookup=answering("8.8.8.8"))
    assert str(refused.value) == str(reason.value)


def test_one_inward_answer_among_outward_ones_refuses_the_host() -> None:
    with pytest.raises(WebhookRefused, match=r"resolves to 10\.0\.0\.1"):
        resolve("http://hooks.example.test/", lookup=answering("8.8.8.8", "10.0.0.1"))


@pytest.mark.parametrize(("address", "carried"), [
    ("8.8.8.8", []),
    ("2606:4700:4700::1111", []),
    ("::ffff:8.8.4.4", ["8.8.4.4"]),  # IPv4-mapped
    ("2002:808:808::1", ["8.8.8.8"]),  # 6to4
    ("64:ff9b::a00:5", ["10.0.0.5"]),  # NAT64
    ("::a00:5", ["10.0.0.5"]),  # IPv4-compatible
    ("::ffff:0:a00:1", ["10.0.0.1"]),  # SIIT
    # Teredo: server 65.54.227.120, client 192.0.2.45 (the obfuscated last 32 bits). Python
    # calls 2001::/32 not global, so the filter refuses these before asking; the branch guards
    # a Python that changes its mind.
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", ["65.54.227.120", "192.0.2.45"]),
])
def test_the_ipv4_addresses_an_address_carries(address: str, carried: list[str]) -> None:
    found = _embedded_ipv4(ipaddress.ip_address(address))
    assert [str(v4) for v4 in found] == carried
