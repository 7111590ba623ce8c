"""Batch webhooks: one signed JSON POST per attempt, to an address that is not inward.

* **Where.** The URL was checked at submission (``jobs.schemas.check_webhook_url``) and is
  checked again here; its host is resolved once and every address must be global (not
  loopback, private, link-local, multicast, reserved or unspecified) unless it lies in
  ``webhook_allow_networks``. The connection goes to that resolved address (the ``Host``
  header and TLS name stay the URL's), so DNS cannot change the answer in between.
* **How long.** ``timeout_s`` bounds the whole attempt, DNS resolution to last byte: a
  resolver that hangs, or a receiver that trickles its answer, is cut off then (the lookup
  runs in a daemon thread that is left behind: ``getaddrinfo`` cannot be interrupted).
  Redirects are not followed (a 3xx is a failed attempt).
* **Who.** With a secret, ``X-Kvbatch-Signature: t=<unix time>,v1=<hex HMAC-SHA256 of
  "<t>.<body>">``: the receiver recomputes it and refuses old timestamps, so a captured event
  cannot be replayed later. Without a secret nothing is sent unless unsigned webhooks are
  allowed.

Delivery is at least once (a retry follows a timeout that may have reached the receiver), so
every request carries ``Idempotency-Key: <batch id>``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import http.client
import ipaddress
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from jobs.schemas import check_webhook_url

MAX_BACKOFF_S = 3600.0
MAX_RESPONSE_BYTES = 64 * 1024

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class WebhookRefused(ValueError):
    """The URL, or an address its host resolves to, is not one webhooks may reach."""


def post_event(url: str, event: dict[str, Any], secret: str | None, timeout_s: float,
               allow: Sequence[IPNetwork] = (), allow_unsigned: bool = False,
               lookup: Callable[..., list[Any]] | None = None) -> str | None:
    """POST ``event`` as JSON to ``url``; None on a 2xx answer, else why the attempt failed.
    ``timeout_s`` bounds the whole attempt, resolving ``url``'s host with ``lookup`` (as
    :func:`resolve`) included."""
    if not secret and not allow_unsigned:
        return ("refused: webhooks are signed; set KVBATCH_WEBHOOK_SECRET (or "
                "KVBATCH_WEBHOOK_ALLOW_UNSIGNED=true)")
    deadline = time.monotonic() + timeout_s
    body = json.dumps(event, sort_keys=True).encode()
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "kvbatch-control",
        "X-Kvbatch-Event": str(event.get("type", "")),
        "Idempotency-Key": str(event.get("batch_id", "")),
    }
    if secret:
        headers["X-Kvbatch-Signature"] = sign(secret, body, int(time.time()))
    try:
        target = _resolve_by(url, allow, lookup, deadline)
        status = _post(target, body, headers, deadline)
    except WebhookRefused as exc:
        return f"refused: {exc}"
    except Exception as exc:  # refused, reset, TLS, cut off at the deadline: a failed attempt
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if 300 <= status < 400:
        return f"HTTP {status} (redirects are not followed)"
    return None if 200 <= status < 300 else f"HTTP {status}"


def sign(secret: str, body: bytes, timestamp: int) -> str:
    """The ``X-Kvbatch-Signature`` value of ``body`` sent at ``timestamp``."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"t={timestamp},v1={mac.hexdigest()}"


class Target:
    """Where one attempt connects: the URL's parts and the one address it was resolved to."""

    def __init__(self, scheme: str, host: str, port: int, path: str, address: str) -> None:
        self.scheme, self.host, self.port, self.path, self.address = (
            scheme, host, port, path, address)


def resolve(url: str, allow: Sequence[IPNetwork] = (),
            lookup: Callable[..., list[Any]] | None = None) -> Target:
    """Check ``url`` and resolve its host; every address must be reachable by webhooks.
    ``lookup``: the resolver, called as ``socket.getaddrinfo`` (the default) is."""
    try:
        check_webhook_url(url)
    except ValueError as exc:
        raise WebhookRefused(str(exc)) from None
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = (lookup or socket.getaddrinfo)(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise WebhookRefused(f"cannot resolve {host!r}: {exc.strerror}") from None
    addresses = [str(info[4][0]) for info in infos]
    for address in addresses:
        if not _reachable(ipaddress.ip_address(address.split("%")[0]), allow):
            raise WebhookRefused(f"{host!r} resolves to {address}, which webhooks may not "
                                 "reach (add its network to KVBATCH_WEBHOOK_ALLOW_NETWORKS)")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(parts.scheme, host, port, path, addresses[0])


def _resolve_by(url: str, allow: Sequence[IPNetwork], lookup: Callable[..., list[Any]] | None,
                deadline: float) -> Target:
    answer: list[Target | Exception] = []

    def run() -> None:
        try:
            answer.append(resolve(url, allow, lookup))
        except Exception as exc:  # raised here, in the attempt's thread
            answer.append(exc)

    thread = threading.Thread(target=run, name="webhook-resolve", daemon=True)
    thread.start()
    thread.join(max(deadline - time.monotonic(), 0.0))
    if not answer:
        raise TimeoutError(f"{urlsplit(url).hostname!r} was not resolved by the deadline")
    if isinstance(answer[0], Exception):
        raise answer[0]
    return answer[0]


# Not reachable by webhooks, whatever ``is_global`` says on this Python (3.11 calls NAT64,
# 6to4 and site-local addresses global).
_DENIED = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.0.2.0/24", "192.168.0.0/16", "198.18.0.0/15", "198.51.100.0/24",
    "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4",
    "::/127", "64:ff9b:1::/48", "100::/64", "2001:db8::/32", "fc00::/7", "fe80::/10",
    "fec0::/10", "ff00::/8",
))
# IPv6 prefixes whose last 32 bits are an IPv4 address the packet reaches: NAT64, IPv4-compatible,
# SIIT's IPv4-translated.
_CARRY_IPV4 = tuple(ipaddress.ip_network(n) for n in ("64:ff9b::/96", "::/96", "::ffff:0:0:0/96"))


def _reachable(ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
               allow: Sequence[IPNetwork]) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # the IPv4 socket it is
    if any(ip in net for net in allow if net.version == ip.version):
        return True
    if not ip.is_global or ip.is_multicast or any(ip in net for net in _DENIED
                                                  if net.version == ip.version):
        return False
    # An IPv6 address that carries an IPv4 one reaches that one: it must be reachable too.
    return all(_reachable(v4, allow) for v4 in _embedded_ipv4(ip))


def _embedded_ipv4(ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
                   ) -> list[ipaddress.IPv4Address]:
    if isinstance(ip, ipaddress.IPv4Address):
        return []
    found = [v4 for v4 in (ip.ipv4_mapped, ip.sixtofour) if v4 is not None]
    if ip.teredo is not None:
        found += list(ip.teredo)
    if any(ip in net for net in _CARRY_IPV4):
        found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return found


def _post(target: Target, body: bytes, headers: dict[str, str], deadline: float) -> int:
    conn: http.client.HTTPConnection
    if target.scheme == "https":
        conn = _PinnedHTTPS(target, deadline)
    else:
        conn = _PinnedHTTP(target, deadline)
    # The deadline of the whole attempt: socket timeouts bound each read, not their sum.
    cut = threading.Event()
    watchdog = threading.Timer(max(deadline - time.monotonic(), 0.0), _cut, args=(conn, cut))
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.request("POST", target.path, body=body, headers=headers)
        response = conn.getresponse()
        response.read(MAX_RESPONSE_BYTES)
        return response.status
    except Exception as exc:  # whatever the cut-off read raised (reset, a half status line)
        if cut.is_set():
            raise TimeoutError("no complete answer by the deadline") from exc
        raise
    finally:
        watchdog.cancel()
        conn.close()


def _cut(conn: http.client.HTTPConnection, cut: threading.Event) -> None:
    cut.set()
    sock = conn.sock
    if sock is not None:
        with contextlib.suppress(OSError):  # already closed
            sock.shutdown(socket.SHUT_RDWR)


def _connect(address: str, port: int, deadline: float) -> socket.socket:
    # Connecting counts against the attempt's deadline too: the watchdog only cuts a socket
    # that exists.
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("no time left to connect")
    return socket.create_connection((address, port), remaining)


def _check_time(deadline: float) -> None:
    if time.monotonic() >= deadline:
        raise TimeoutError("the deadline passed while connecting")


class _PinnedHTTP(http.client.HTTPConnection):
    """HTTP to the resolved address; ``Host`` stays the URL's host."""

    def __init__(self, target: Target, deadline: float) -> None:
        super().__init__(target.host, target.port, timeout=max(deadline - time.monotonic(), 0.1))
        self._address, self._deadline = target.address, deadline

    def connect(self) -> None:
        self.sock = _connect(self._address, self.port, self._deadline)
        _check_time(self._deadline)  # the watchdog may have fired before there was a socket


class _PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to the resolved address; the certificate is checked against the URL's host."""

    def __init__(self, target: Target, deadline: float) -> None:
        super().__init__(target.host, target.port, timeout=max(deadline - time.monotonic(), 0.1),
                         context=ssl.create_default_context())
        self._address, self._deadline = target.address, deadline

    def connect(self) -> None:
        sock = _connect(self._address, self.port, self._deadline)
        # The TLS socket is in place before the handshake, so that the watchdog can cut that
        # too (wrap_socket takes over the plain socket's descriptor).
        tls = self._context.wrap_socket(sock, server_hostname=self.host,  # type: ignore[attr-defined]
                                        do_handshake_on_connect=False)
        self.sock = tls
        _check_time(self._deadline)
        tls.settimeout(max(self._deadline - time.monotonic(), 0.01))
        tls.do_handshake()


def backoff_s(attempts: int, first_s: float) -> float:
    """Delay before attempt ``attempts + 1``: ``first_s`` doubling, capped at an hour."""
    return min(first_s * 2 ** max(attempts - 1, 0), MAX_BACKOFF_S)
