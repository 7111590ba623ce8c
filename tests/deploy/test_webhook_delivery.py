"""Webhooks that are delivered: the signed JSON body and its headers, HTTPS to a receiver whose
certificate names the URL's host, at the address the host resolved to (not the resolver's
loopback default); HTTPS never falls back to plain HTTP; an endless answer is read only so far;
connecting counts against the deadline. The refusals are in ``test_webhook_security.py``."""

from __future__ import annotations

import contextlib
import email.message
import hashlib
import hmac
import http.client
import http.server
import ipaddress
import json
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from worker.control import webhook
from worker.control.webhook import MAX_RESPONSE_BYTES, post_event

HOST = "hooks.example.test"
ADDRESS = "127.0.0.2"  # loopback, but not where a connection to no address lands
ALLOW = (ipaddress.ip_network("127.0.0.0/8"),)
EVENT = {"type": "batch.completed", "batch_id": "b7"}


Answer = Callable[[http.server.BaseHTTPRequestHandler], None]


def ok(handler: http.server.BaseHTTPRequestHandler) -> None:
    handler.send_response(200)
    handler.end_headers()


class Receiver:
    """An HTTP(S) server on ``ADDRESS`` that records each request's headers and body."""

    def __init__(self, tls: ssl.SSLContext | None = None, answer: Answer = ok) -> None:
        self.requests: list[tuple[email.message.Message, bytes]] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.requests.append((self.headers, body))
                answer(self)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((ADDRESS, 0), Handler)
        self.server.daemon_threads = True
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for ``HOST`` and its key."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", f"/CN={HOST}", "-addext", f"subjectAltName=DNS:{HOST}",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True)
    return cert, key


@pytest.fixture
def dns(monkeypatch: pytest.MonkeyPatch) -> None:
    """``HOST`` resolves to ``ADDRESS``."""
    real = socket.getaddrinfo

    def lookup(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host == HOST:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ADDRESS, port))]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", lookup)


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    made: list[Receiver] = []
    yield made
    for r in made:
        r.close()


def test_https_is_delivered_to_the_resolved_address_under_the_urls_name(
        certificate: tuple[Path, Path], dns: None, receivers: list[Receiver],
        monkeypatch: pytest.MonkeyPatch) -> None:
    cert, key = certificate
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    receivers.append(hook := Receiver(server_tls))
    # The sender trusts the test certificate, and checks it as it checks any other.
    default_context = ssl.create_default_context
    monkeypatch.setattr(webhook.ssl, "create_default_context",
                        lambda: default_context(cafile=str(cert)))
    error = post_event(f"https://{HOST}:{hook.port}/in", EVENT, "s", 5.0, allow=ALLOW)
    assert error is None
    ((headers, _),) = hook.requests
    assert headers["Host"] == f"{HOST}:{hook.port}"


def test_https_to_a_receiver_without_tls_fails(dns: None, receivers: list[Receiver]) -> None:
    receivers.append(hook := Receiver())
    error = post_event(f"https://{HOST}:{hook.port}/in", EVENT, "s", 5.0, allow=ALLOW)
    assert error is not None and error.startswith("SSL"), error
    assert hook.requests == []


def test_the_event_is_posted_as_signed_json_with_its_headers(
        dns: None, receivers: list[Receiver]) -> None:
    receivers.append(hook := Receiver())
    before = int(time.time())
    assert post_event(f"http://{HOST}:{hook.port}/in", EVENT, "s3cret", 5.0, allow=ALLOW) is None
    ((headers, body),) = hook.requests
    assert body == json.dumps(EVENT, sort_keys=True).encode()
    assert headers["Host"] == f"{HOST}:{hook.port}"  # the URL's host, at the resolved address
    assert headers["Content-Type"] == "application/json"
    assert headers["User-Agent"] == "kvbatch-control"
    assert headers["X-Kvbatch-Event"] == "batch.completed"
    assert headers["Idempotency-Key"] == "b7"
    timestamp, mac = headers["X-Kvbatch-Signature"].removeprefix("t=").split(",v1=")
    assert before <= int(timestamp) <= time.time()
    assert mac == hmac.new(b"s3cret", f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def test_an_event_without_type_or_batch_is_sent_with_those_headers_empty(
        dns: None, receivers: list[Receiver]) -> None:
    receivers.append(hook := Receiver())
    assert post_event(f"http://{HOST}:{hook.port}/in", {}, "s", 5.0, allow=ALLOW) is None
    ((headers, body),) = hook.requests
    assert body == b"{}"
    assert (headers["X-Kvbatch-Event"], headers["Idempotency-Key"]) == ("", "")


@pytest.mark.parametrize(("status", "error"), [
    (200, None), (204, None), (299, None),
    (300, "HTTP 300 (redirects are not followed)"), (399, "HTTP 399 (redirects are not followed)"),
    (400, "HTTP 400"), (401, "HTTP 401"), (500, "HTTP 500"),
])
def test_only_a_2xx_answer_delivers(
        status: int, error: str | None, dns: None, receivers: list[Receiver]) -> None:
    def answer(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(status)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    receivers.append(hook := Receiver(answer=answer))
    assert post_event(f"http://{HOST}:{hook.port}/in", EVENT, "s", 5.0, allow=ALLOW) == error


@pytest.mark.parametrize(("raised", "error"), [
    (ConnectionResetError(), "ConnectionResetError"),  # no message: the type alone
    (OSError("no route"), "OSError: no route"),
])
def test_a_failed_attempt_is_named_by_its_exception(
        raised: Exception, error: str, dns: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any) -> int:
        raise raised

    monkeypatch.setattr(webhook, "_post", fail)
    assert post_event(f"http://{HOST}/in", EVENT, "s", 1.0, allow=ALLOW) == error


def test_an_unsigned_event_is_refused_naming_both_settings() -> None:
    assert post_event("http://hooks.example.test/in", EVENT, None, 1.0) == (
        "refused: webhooks are signed; set KVBATCH_WEBHOOK_SECRET (or "
        "KVBATCH_WEBHOOK_ALLOW_UNSIGNED=true)")


def test_an_endless_answer_is_read_only_up_to_its_cap(
        dns: None, receivers: list[Receiver]) -> None:
    release = threading.Event()

    def endless(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(100 * MAX_RESPONSE_BYTES))
        handler.end_headers()
        with contextlib.suppress(OSError):
            handler.wfile.write(b"x" * (2 * MAX_RESPONSE_BYTES))
            handler.wfile.flush()
            release.wait(10)  # the rest never comes

    receivers.append(hook := Receiver(answer=endless))
    started = time.monotonic()
    try:
        error = post_event(f"http://{HOST}:{hook.port}/in", EVENT, "s", 5.0, allow=ALLOW)
    finally:
        release.set()
    assert error is None and time.monotonic() - started < 4.0


def test_connecting_is_bounded_by_the_deadline() -> None:
    """A receiver whose accept queue is full never completes the handshake; the connection
    attempt gives up at the deadline (the watchdog has no socket to cut yet)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    queued = []
    try:
        for _ in range(4):  # fill the accept queue: later handshakes go unanswered
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", port))
            queued.append(s)
        time.sleep(0.2)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            webhook._connect("127.0.0.1", port, started + 0.5).close()
        assert time.monotonic() - started < 3.0
    finally:
        for s in queued:
            s.close()
        server.close()


def test_no_connection_is_tried_past_the_deadline() -> None:
    with pytest.raises(TimeoutError, match=r"^no time left to connect$"):
        webhook._connect("127.0.0.1", 9, time.monotonic() - 0.01)
    with pytest.raises(TimeoutError, match=r"^the deadline passed while connecting$"):
        webhook._check_time(time.monotonic() - 0.01)
    webhook._check_time(time.monotonic() + 60)  # time left: no error


def test_the_deadline_cut_of_an_already_closed_connection_is_quiet() -> None:
    conn = http.client.HTTPConnection("127.0.0.1", 9)
    conn.sock = socket.socket()
    conn.sock.close()  # shutdown() now raises OSError, as after the answer came in
    cut = threading.Event()
    webhook._cut(conn, cut)
    assert cut.is_set()
