"""Webhooks cannot be aimed inward, held open, redirected or replayed; URLs are checked when a
batch is submitted and again when its event is sent."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import http.server
import ipaddress
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from jobs.schemas import check_webhook_url
from worker.control.webhook import post_event, resolve, sign

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)
EVENT = {"type": "batch.completed", "batch_id": "b1"}


class Receiver:
    """A local HTTP server whose handler is given per test; it records every request."""

    def __init__(self, handle: Any) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                receiver.requests.append(("POST", self.path, dict(self.headers)))
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                handle(self)

            def do_GET(self) -> None:
                receiver.requests.append(("GET", self.path, dict(self.headers)))
                handle(self)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Any]:
    made: list[Receiver] = []

    def make(handle: Any) -> Receiver:
        made.append(Receiver(handle))
        return made[-1]

    yield make
    for r in made:
        r.close()


def ok(handler: http.server.BaseHTTPRequestHandler) -> None:
    handler.send_response(200)
    handler.end_headers()


@pytest.mark.parametrize("url", [
    "http://169.254.169.254/latest/meta-data/",  # cloud metadata
    "http://[::1]:6379/",  # loopback, IPv6
    "http://10.0.0.5/hook",  # private
    "http://0.0.0.0:8080/",  # unspecified
    "http://[::ffff:127.0.0.1]/",  # loopback behind an IPv4-mapped address
    "http://localhost:9/hook",  # a name that resolves to loopback
    "http://224.0.0.1/",  # multicast
])
def test_inward_addresses_are_refused_before_any_connection(url: str) -> None:
    error = post_event(url, EVENT, "s", timeout_s=2.0)
    assert error is not None and error.startswith("refused:") and "may not reach" in error


def test_loopback_is_refused_unless_allowed(receiver) -> None:  # type: ignore[no-untyped-def]
    hook = receiver(ok)
    assert "may not reach" in (post_event(hook.url, EVENT, "s", 2.0) or "")
    assert hook.requests == []
    assert post_event(hook.url, EVENT, "s", 2.0, allow=LOOPBACK) is None
    assert len(hook.requests) == 1


@pytest.mark.parametrize("url", ["gopher://x\nINJECT", "file:///etc/passwd",
                                 "http://user:pw@example.com/", "http:///nohost",
                                 "http://exa mple.com/", "https://example.com:99999/"])
def test_bad_urls_are_refused_at_submission_and_at_send(url: str) -> None:
    with pytest.raises(ValueError):
        check_webhook_url(url)
    assert (post_event(url, EVENT, "s", 2.0, allow=LOOPBACK) or "").startswith("refused:")


def test_redirects_are_not_followed(receiver) -> None:  # type: ignore[no-untyped-def]
    def redirect(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(302)
        handler.send_header("Location", "/internal-admin")
        handler.end_headers()

    hook = receiver(redirect)
    error = post_event(hook.url, EVENT, "s", 2.0, allow=LOOPBACK)
    assert error == "HTTP 302 (redirects are not followed)"
    assert [(m, p) for m, p, _ in hook.requests] == [("POST", "/hook")]


def test_a_trickling_receiver_is_cut_off_at_the_deadline(receiver) -> None:  # type: ignore[no-untyped-def]
    """Socket timeouts bound each read; one byte every 0.2 s never trips them. The attempt
    has one deadline for everything."""
    def trickle(handler: http.server.BaseHTTPRequestHandler) -> None:
        with contextlib.suppress(OSError):  # the client hangs up at its deadline
            for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 200:
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
                time.sleep(0.2)

    hook = receiver(trickle)
    error = post_event(hook.url, EVENT, "s", timeout_s=1.0, allow=LOOPBACK)
    assert error == "TimeoutError: no complete answer by the deadline"


def test_the_connection_goes_to_the_address_that_was_checked(
        receiver, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The host is resolved once, checked, and the POST connects to that address: a second
    DNS answer (rebinding) cannot move it inward. The Host header keeps the URL's name."""
    hook = receiver(ok)
    port = hook.server.server_address[1]
    real = socket.getaddrinfo
    asked: list[str] = []

    def dns(host, *args, **kwargs):  # type: ignore[no-untyped-def]
        if host == "hooks.example.test":
            asked.append(host)  # the first answer is checked; a second would be 10.0.0.5
            host = "127.0.0.1" if len(asked) == 1 else "10.0.0.5"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", dns)
    url = f"http://hooks.example.test:{port}/hook"
    assert post_event(url, EVENT, "s", 2.0, allow=LOOPBACK) is None
    assert asked == ["hooks.example.test"]  # resolved once: connect used the address
    assert hook.requests[0][2]["Host"] == f"hooks.example.test:{port}"
    with pytest.raises(ValueError, match="cannot resolve"):
        resolve("http://hooks.example.invalid/hook")


def test_a_trickled_tls_handshake_is_cut_off_at_the_deadline() -> None:
    """An HTTPS receiver that sends its handshake a byte at a time: every read gets a byte
    before the socket timeout, but the attempt's deadline covers the handshake too."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = server.accept()
        with conn, contextlib.suppress(OSError):
            conn.recv(4096)  # the ClientHello
            for byte in b"\x16\x03\x03\x40\x00" + b"\x02" * 200:  # a 16 KiB record, slowly
                if stop.is_set():
                    return
                conn.sendall(bytes([byte]))
                time.sleep(0.2)

    threading.Thread(target=trickle, daemon=True).start()
    url = f"https://127.0.0.1:{server.getsockname()[1]}/hook"
    try:
        error = post_event(url, EVENT, "s", 1.0, allow=LOOPBACK)
        # Cut at the deadline (by the watchdog, or by ssl's own handshake timeout, which the
        # deadline sets), not after the 40 s the trickle would take.
        assert error is not None and error.startswith("TimeoutError"), error
    finally:
        stop.set()
        server.close()


@pytest.mark.parametrize("address", [
    "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
    "64:ff9b::a00:5",  # NAT64 of 10.0.0.5
    "2002:7f00:1::1",  # 6to4 of 127.0.0.1
    "::7f00:1",  # IPv4-compatible 127.0.0.1
    "fec0::1",  # site-local
    "192.0.0.8",  # IETF protocol assignments
    "100.64.0.1",  # carrier-grade NAT
    "64:ff9b:1:a00:0:100:808:808",  # local-use NAT64 (RFC 8215)
    "::ffff:0:a00:1",  # SIIT's IPv4-translated 10.0.0.1
])
def test_addresses_that_carry_or_hide_inward_ones_are_refused(
        address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real = socket.getaddrinfo
    family = socket.AF_INET6 if ":" in address else socket.AF_INET

    def dns(host, port, *args, **kwargs):  # type: ignore[no-untyped-def]
        if host == "tricky.example.test":
            return [(family, socket.SOCK_STREAM, 6, "", (address, port))]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", dns)
    error = post_event("https://tricky.example.test/hook", EVENT, "s", 1.0)
    assert error is not None and f"resolves to {address}" in error


def test_events_are_signed_with_a_timestamp_and_unsigned_ones_are_not_sent(receiver) -> None:  # type: ignore[no-untyped-def]
    hook = receiver(ok)
    refused = post_event(hook.url, EVENT, None, 2.0, allow=LOOPBACK)
    assert refused is not None and "KVBATCH_WEBHOOK_SECRET" in refused and hook.requests == []
    assert post_event(hook.url, EVENT, "k3y", 2.0, allow=LOOPBACK) is None
    header = hook.requests[0][2]["X-Kvbatch-Signature"]
    stamp = int(header.split(",")[0].removeprefix("t="))
    assert abs(stamp - time.time()) < 60
    body = b'{"batch_id": "b1", "type": "batch.completed"}'
    expected = hmac.new(b"k3y", f"{stamp}.".encode() + body, hashlib.sha256).hexdigest()
    assert header == f"t={stamp},v1={expected}" == sign("k3y", body, stamp)
