"""Webhooks that are delivered: HTTPS to a receiver whose certificate names the URL's host, at
the address the host resolved to (not the resolver's loopback default), and HTTPS never falls
back to plain HTTP. The refusals are in ``test_webhook_security.py``."""

from __future__ import annotations

import http.client
import http.server
import ipaddress
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from worker.control import webhook
from worker.control.webhook import post_event

HOST = "hooks.example.test"
ADDRESS = "127.0.0.2"  # loopback, but not where a connection to no address lands
ALLOW = (ipaddress.ip_network("127.0.0.0/8"),)
EVENT = {"type": "batch.completed", "batch_id": "b7"}


class Receiver:
    """An HTTP(S) server on ``ADDRESS`` that answers 200 and records each request's headers."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.headers: list[dict[str, str]] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.headers.append(dict(self.headers))
                self.send_response(200)
                self.end_headers()

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
    (headers,) = hook.headers
    assert headers["Host"] == f"{HOST}:{hook.port}"
    assert headers["X-Kvbatch-Signature"].startswith("t=")
    assert headers["Idempotency-Key"] == "b7"


def test_https_to_a_receiver_without_tls_fails(dns: None, receivers: list[Receiver]) -> None:
    receivers.append(hook := Receiver())
    error = post_event(f"https://{HOST}:{hook.port}/in", EVENT, "s", 5.0, allow=ALLOW)
    assert error is not None and error.startswith("SSL"), error
    assert hook.headers == []


def test_http_is_delivered_to_the_resolved_address(dns: None, receivers: list[Receiver]) -> None:
    receivers.append(hook := Receiver())
    assert post_event(f"http://{HOST}:{hook.port}/in", EVENT, "s", 5.0, allow=ALLOW) is None
    assert [h["Host"] for h in hook.headers] == [f"{HOST}:{hook.port}"]


def test_the_deadline_cut_of_an_already_closed_connection_is_quiet() -> None:
    conn = http.client.HTTPConnection("127.0.0.1", 9)
    conn.sock = socket.socket()
    conn.sock.close()  # shutdown() now raises OSError, as after the answer came in
    cut = threading.Event()
    webhook._cut(conn, cut)
    assert cut.is_set()
