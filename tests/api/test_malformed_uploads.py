"""Malformed request bodies sent as raw HTTP to a real ``kvbatch serve``: each is a 400 (or a 408
for a body that stops coming) naming what is wrong, nothing is stored, and the server keeps
serving."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from api_server import ApiServer

BOUNDARY = b"kvbatch-test"
ROW = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


def form(filename: bytes = b"in.jsonl", boundary: bytes = BOUNDARY, close: bool = True) -> bytes:
    parts = (b'Content-Disposition: form-data; name="purpose"\r\n\r\nbatch',
             b'Content-Disposition: form-data; name="file"; filename="' + filename
             + b'"\r\nContent-Type: application/jsonl\r\n\r\n' + ROW)
    body = b"".join(b"--" + boundary + b"\r\n" + part + b"\r\n" for part in parts)
    return body + (b"--" + boundary + b"--\r\n" if close else b"")


def post(server: ApiServer, key: str, body: bytes,
         boundary: bytes = BOUNDARY) -> tuple[int, dict]:  # type: ignore[type-arg]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/files", body=body, headers={
        "Authorization": f"Bearer {key}",
        "Content-Type": "multipart/form-data; boundary=" + boundary.decode()})
    response = conn.getresponse()
    status, payload = response.status, json.loads(response.read())
    conn.close()
    return status, payload


def stored(server: ApiServer, key: str) -> list[str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/v1/files", headers={"Authorization": f"Bearer {key}"})
    ids = [f["id"] for f in json.loads(conn.getresponse().read())["data"]]
    conn.close()
    return ids


@pytest.mark.parametrize(("body", "boundary", "message"), [
    (form(close=False), BOUNDARY, "ends before its closing boundary"),
    (form()[:-30], BOUNDARY, "ends before its closing boundary"),
    (form(boundary=b"b" * 257), b"b" * 257, "Boundary length 257 exceeds"),
    (form(filename=b"in\x00.jsonl"), BOUNDARY, "control characters"),
    (form(filename=b"in\x1b[2J.jsonl"), BOUNDARY, "control characters"),
], ids=["no-closing-boundary", "cut-mid-part", "boundary-over-256", "nul-in-filename",
        "escape-in-filename"])
def test_a_malformed_upload_is_a_400_and_nothing_is_stored(
        server: ApiServer, make_key: Callable[[str], str], tmp_path: Path, body: bytes,
        boundary: bytes, message: str) -> None:
    key = make_key("team")
    status, payload = post(server, key, body, boundary)
    assert status == 400, payload
    assert message in payload["error"]["message"]
    assert stored(server, key) == []
    assert list((tmp_path / "files").iterdir()) == []  # no partial file left
    status, payload = post(server, key, form())  # the same server takes a well-formed one
    assert status == 200 and payload["bytes"] == len(ROW) and payload["filename"] == "in.jsonl"


@pytest.mark.parametrize("path", ["/v1/files", "/v1/batches"])
def test_a_body_that_stops_coming_gets_a_408_after_the_read_timeout(
        start_server: Callable[..., ApiServer], make_key: Callable[[str], str],
        path: str) -> None:
    server = start_server(body_read_timeout_s=1)
    key = make_key("team")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                     f"Content-Type: multipart/form-data; boundary={BOUNDARY.decode()}\r\n"
                     "Content-Length: 10000\r\n\r\n".encode() + form()[:50])
        started = time.monotonic()
        reply = _response(sock)  # the socket's 30 s timeout only catches a hang
        waited_s = time.monotonic() - started
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"stopped coming for 1 s" in reply
    assert waited_s > 0.9  # it waited for the body before giving up on it
    assert stored(server, key) == []


def _response(sock: socket.socket) -> bytes:
    """One whole HTTP response: its head, then as many body bytes as it declares (a reply can
    come in several segments)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length and (chunk := sock.recv(65536)):
        body += chunk
    return head + b"\r\n\r\n" + body
