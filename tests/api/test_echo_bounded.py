"""What a caller sends comes back in errors cut (``jobs.echo``): a 100,000-character model name,
custom_id, field name, endpoint or purpose is quoted in at most 100 characters, every stored
line error and every HTTP error message is bounded, and so is ``GET /v1/batches?limit=100``."""

from __future__ import annotations

import io
import json
import urllib.request

import openai
import pytest
from api_server import ApiServer
from test_openai_api import chat_row, upload, wait_batch

from jobs.echo import MAX_ECHO_CHARS, MAX_MESSAGE_CHARS, clip, quote, quote_all

LONG = 100_000


def test_quote_and_clip_cut_with_an_ellipsis() -> None:
    assert quote("short") == "'short'" and clip("short") == "short"
    cut = quote("x" * LONG)
    assert len(cut) == MAX_ECHO_CHARS and cut.startswith("'xxx") and cut.endswith("x…'")
    assert len(clip("y" * LONG)) == MAX_MESSAGE_CHARS and clip("y" * LONG).endswith("y…")
    assert quote("a" * MAX_ECHO_CHARS)[-2:] == "…'"  # the quotes count
    assert quote("a" * (MAX_ECHO_CHARS - 2)) == repr("a" * (MAX_ECHO_CHARS - 2))
    assert quote_all(["a", "b"]) == "'a', 'b'"
    assert quote_all(str(i) for i in range(8)) == "'0', '1', '2', '3', '4' and 3 more"


def test_long_values_in_lines_are_quoted_cut(openai_client, server: ApiServer) -> None:  # type: ignore[no-untyped-def]
    client = openai_client()
    long_id = "c" * 255  # the longest a custom_id may be
    lines = [chat_row("a", model="m" * LONG), chat_row(long_id), chat_row(long_id),
             chat_row("b", **{"f" * LONG: 1}), chat_row("c" * LONG)]
    batch = client.batches.create(
        input_file_id=upload(client, "".join(json.dumps(x) + "\n" for x in lines).encode()),
        endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_batch(client, batch.id, timeout_s=30)
    assert done.status == "failed" and done.errors is not None
    by_line = {e.line: e for e in done.errors.data or []}
    assert sorted(by_line) == [1, 3, 4, 5]
    assert by_line[1].code == "model_not_found"
    assert by_line[1].message == f"model {quote('m' * LONG)} is not served here (GET " \
                                 "/v1/models lists those that are)"
    assert by_line[3].code == "duplicate_custom_id"
    assert by_line[3].message == f"custom_id {quote(long_id)} appears on an earlier line"
    assert by_line[4].message == f"body field(s) {quote('f' * LONG)} not supported"
    assert by_line[5].message == "custom_id: String should have at most 255 characters"
    assert all(len(e.message or "") <= MAX_MESSAGE_CHARS for e in by_line.values())

    request = urllib.request.Request(f"{server.url}/v1/batches?limit=100",
                                     headers={"Authorization": f"Bearer {client.api_key}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        listed = answer.read()
    assert len(listed) < 4_000, len(listed)  # three short errors, not 300,000 characters


def test_long_values_in_requests_are_quoted_cut(openai_client) -> None:  # type: ignore[no-untyped-def]
    client = openai_client()
    file_id = upload(client, json.dumps(chat_row("a")).encode() + b"\n")
    with pytest.raises(openai.BadRequestError) as err:
        client.batches.create(input_file_id=file_id, endpoint="/v1/" + "e" * LONG,  # type: ignore[arg-type]
                              completion_window="24h")
    message = err.value.body["message"]  # type: ignore[index]
    assert message.startswith("endpoint '/v1/eee") and "…' is not supported" in message
    assert len(message) < MAX_MESSAGE_CHARS
    with pytest.raises(openai.BadRequestError) as err:
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                              completion_window="w" * LONG)  # type: ignore[arg-type]
    assert len(err.value.body["message"]) < MAX_MESSAGE_CHARS  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="p" * 60_000)  # type: ignore[arg-type]
    assert len(err.value.body["message"]) < MAX_MESSAGE_CHARS  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as err:
        client.batches.retrieve("batch_" + "b" * 8_000)
    assert len(err.value.body["message"]) < MAX_MESSAGE_CHARS  # type: ignore[index]
