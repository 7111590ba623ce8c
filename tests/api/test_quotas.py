"""Per-key quotas through the ``openai`` client: files, stored bytes, active batches and queued
requests are refused with a 400 ``quota_exceeded`` naming the limit (another key is not
affected), and uploads expire (``expires_after``, else the retention) and are purged."""

from __future__ import annotations

import io
import json
from pathlib import Path

import openai
import pytest
from services import wait_until
from sqlalchemy import Engine
from test_openai_api import chat_row, jsonl, upload, wait_batch


def _refused(call, setting: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as err:
        call()
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "quota_exceeded", body
    assert f"KVBATCH_API_{setting.upper()}" in body["message"]


def _client(server, make_key, name: str) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=make_key(name), max_retries=0,
                         timeout=30)


def test_files_and_bytes_per_key(start_server, make_key, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server = start_server(max_files_per_key=2, max_stored_bytes_per_key=1000)
    alice, bob = _client(server, make_key, "alice"), _client(server, make_key, "bob")
    first = upload(alice, b"x" * 400)
    upload(alice, b"y" * 400)
    _refused(lambda: upload(alice, b"z"), "max_files_per_key")
    assert upload(bob, b"z")  # bob's own quota
    alice.files.delete(first)
    _refused(lambda: upload(alice, b"w" * 601), "max_stored_bytes_per_key")
    assert len(list((tmp_path / "files").iterdir())) == 2  # the refused uploads are not kept
    assert upload(alice, b"w" * 600)


def test_active_batches_and_queued_requests_per_key(start_server, make_key) -> None:  # type: ignore[no-untyped-def]
    server = start_server(max_active_batches_per_key=2, max_queued_rows_per_key=5)
    client = _client(server, make_key, "team")  # no worker: every request stays queued
    three = upload(client, jsonl([chat_row(f"r{i}") for i in range(3)]))
    first = client.batches.create(input_file_id=three, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert wait_batch(client, first.id, {"in_progress"}).status == "in_progress"
    # three queued and three more: over five, the second batch fails validation
    second = client.batches.create(input_file_id=three, endpoint="/v1/chat/completions",
                                   completion_window="24h")
    done = wait_batch(client, second.id)
    assert done.status == "failed" and done.errors is not None
    [error] = done.errors.data or []
    assert error.code == "quota_exceeded"
    assert error.message == ("quota exceeded: the key has 3 requests queued or running and this "
                             "batch 3, and a key may have at most 5 "
                             "(KVBATCH_API_MAX_QUEUED_ROWS_PER_KEY)")
    two = upload(client, jsonl([chat_row(f"s{i}") for i in range(2)]))
    third = client.batches.create(input_file_id=two, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert wait_batch(client, third.id, {"in_progress"}).status == "in_progress"
    _refused(lambda: client.batches.create(input_file_id=two, endpoint="/v1/chat/completions",
                                           completion_window="24h"),
             "max_active_batches_per_key")
    client.batches.cancel(third.id)
    wait_batch(client, third.id)
    # one batch active, five requests queued: at the limit, a new batch is refused at once
    client.batches.cancel(first.id)
    wait_batch(client, first.id)
    assert client.batches.create(input_file_id=two, endpoint="/v1/chat/completions",
                                 completion_window="24h").status == "validating"


def test_uploads_expire_and_are_purged(openai_client, engine: Engine,  # type: ignore[no-untyped-def]
                                       tmp_path: Path) -> None:
    client = openai_client()
    kept = client.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    assert kept.expires_at == kept.created_at + 30 * 86400  # the default retention
    hour = client.files.create(file=("b.jsonl", io.BytesIO(b"{}\n")), purpose="batch",
                               expires_after={"anchor": "created_at", "seconds": 3600})
    assert hour.expires_at == hour.created_at + 3600
    with pytest.raises(openai.BadRequestError, match="expires_after"):
        client.files.create(file=("c.jsonl", io.BytesIO(b"{}\n")), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 60})
    with engine.begin() as conn:  # an hour later
        conn.exec_driver_sql("UPDATE files SET expires_at = expires_at - interval '2 hours' "
                             "WHERE id = %(f)s", {"f": hour.id})
    wait_until(lambda: not (tmp_path / "files" / hour.id).exists() or None, 10, 0.2,
               what="the expired file purged")
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(hour.id)
    assert client.files.retrieve(kept.id).id == kept.id
    assert json.loads(client.files.content(kept.id).text) == {}
