"""The Files and Batches API driven by the official ``openai`` client against a real uvicorn
server and a real worker (a tiny random model): the whole round trip, cancel, pagination,
validation errors with line numbers, key isolation, 401 and 413."""

from __future__ import annotations

import io
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from api_server import ApiServer
from openai.types import Batch, Completion
from openai.types.chat import ChatCompletion
from services import jsonl as records
from sqlalchemy import Engine

from jobs.api.keys import KeyStore

FINAL = {"completed", "failed", "expired", "cancelled"}


def chat_row(custom_id: str, model: str = "tiny", **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": 6, "temperature": 0,
                     "messages": [{"role": "user", "content": f"say {custom_id}"}], **body}}


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def upload(client: openai.OpenAI, data: bytes, name: str = "input.jsonl") -> str:
    return client.files.create(file=(name, io.BytesIO(data)), purpose="batch").id


def wait_batch(client: openai.OpenAI, batch_id: str, statuses: set[str] = FINAL,
               timeout_s: float = 120.0) -> Batch:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.2)


def lines_of(client: openai.OpenAI, file_id: str) -> list[dict]:
    return records(client.files.content(file_id).text)


def test_files_to_batch_to_output_with_openai_types(openai_client, start_worker,  # type: ignore[no-untyped-def]
                                                    server: ApiServer) -> None:
    client = openai_client()
    start_worker()
    rows = [chat_row(f"chat-{i}") for i in range(6)]
    rows.append({"custom_id": "cmpl", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "tiny", "max_completion_tokens": 4, "n": 2,
                          "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "hi"}]}})
    data = jsonl(rows)
    file = client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch")
    assert (file.bytes, file.purpose, file.filename) == (len(data), "batch", "input.jsonl")
    assert client.files.content(file.id).read() == data  # stored byte for byte
    assert [m.id for m in client.models.list()] == ["tiny"]

    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"team": "a"})
    assert batch.status == "validating" and batch.metadata == {"team": "a"}
    assert batch.expires_at == batch.created_at + 24 * 3600
    done = wait_batch(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (7, 7, 0)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.error_file_id is None and done.output_file_id
    assert done.model == "tiny"

    out = lines_of(client, done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(r["custom_id"] for r in rows)
    for line in out:
        assert line["error"] is None and line["response"]["status_code"] == 200
        completion = ChatCompletion.model_validate(line["response"]["body"])
        assert completion.object == "chat.completion"
        assert completion.usage is not None and completion.usage.completion_tokens > 0
    n2 = next(x for x in out if x["custom_id"] == "cmpl")
    assert len(n2["response"]["body"]["choices"]) == 2
    output_file = client.files.retrieve(done.output_file_id)
    assert output_file.purpose == "batch_output"
    assert output_file.bytes == len(client.files.content(done.output_file_id).read())
    listed = {f.id for f in client.files.list()}
    assert {file.id, done.output_file_id} <= listed
    log = server.log.read_text()  # neither the key nor a prompt reached the server's log
    assert "GET /v1/batches/" in log  # (it is the log: requests are in it)
    assert client.api_key[len("kvb-") + 12:] not in log and "say chat-0" not in log


def test_completions_endpoint_and_failed_rows_in_the_error_file(openai_client,  # type: ignore[no-untyped-def]
                                                               start_worker) -> None:
    client = openai_client()
    start_worker()
    rows = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "tiny", "prompt": f"Once upon {i}", "max_tokens": 5,
                      "temperature": 0, "logprobs": 2}} for i in range(3)]
    batch = client.batches.create(input_file_id=upload(client, jsonl(rows)),
                                  endpoint="/v1/completions", completion_window="1h")
    done = wait_batch(client, batch.id)
    assert done.status == "completed" and done.output_file_id
    for line in lines_of(client, done.output_file_id):
        completion = Completion.model_validate(line["response"]["body"])
        assert completion.choices[0].logprobs is not None
        assert len(completion.choices[0].logprobs.tokens or []) == 5


def test_cancel_ends_cancelled_with_every_row_accounted(openai_client) -> None:  # type: ignore[no-untyped-def]
    client = openai_client()  # no worker: every row stays queued
    batch = client.batches.create(input_file_id=upload(client, jsonl(
        [chat_row(f"r{i}") for i in range(5)])), endpoint="/v1/chat/completions",
        completion_window="24h")
    wait_batch(client, batch.id, {"in_progress"})
    cancelling = client.batches.cancel(batch.id)
    # finalizing: no row was running, so the batch can end cancelled before the reply
    assert cancelling.status in ("cancelling", "finalizing", "cancelled")
    done = wait_batch(client, batch.id)
    assert done.status == "cancelled" and done.cancelling_at and done.cancelled_at
    assert done.output_file_id is None and done.error_file_id
    errors = lines_of(client, done.error_file_id)
    assert sorted(x["custom_id"] for x in errors) == [f"r{i}" for i in range(5)]
    assert {x["error"]["code"] for x in errors} == {"batch_cancelled"}
    assert done.request_counts is not None and done.request_counts.failed == 5
    with pytest.raises(openai.BadRequestError, match="cannot be cancelled"):
        client.batches.cancel(wait_batch(client, client.batches.create(
            input_file_id=upload(client, b'{"bad json\n'), endpoint="/v1/chat/completions",
            completion_window="24h").id).id)


def test_list_pagination_newest_first(openai_client) -> None:  # type: ignore[no-untyped-def]
    client = openai_client()
    file_id = upload(client, jsonl([chat_row("x")]))
    made = [client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h").id for _ in range(5)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    assert [b.id for b in client.batches.list(limit=2)] == made[::-1]  # auto-paging
    last = client.batches.list(limit=2, after=made[1])
    assert [b.id for b in last.data] == [made[0]] and not last.has_more
    files = client.files.list(limit=1)
    assert [f.id for f in files.data] == [file_id]


def test_malformed_lines_fail_validation_with_their_line_numbers(openai_client) -> None:  # type: ignore[no-untyped-def]
    client = openai_client()
    lines = [json.dumps(chat_row("ok")), "{not json", json.dumps(chat_row("x") | {
        "url": "/v1/completions"}), "", json.dumps(chat_row("ok")),
        json.dumps(chat_row("t", temperature=-1)), json.dumps(chat_row("m", model="nope"))]
    batch = client.batches.create(
        input_file_id=upload(client, ("\n".join(lines) + "\n").encode()),
        endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_batch(client, batch.id)
    assert done.status == "failed" and done.failed_at and done.errors is not None
    by_line = {e.line: e for e in done.errors.data or []}
    assert sorted(by_line) == [2, 3, 5, 6, 7]
    assert by_line[2].code == "invalid_json_line"
    assert by_line[3].param == "url"
    assert by_line[5].code == "duplicate_custom_id"
    assert "temperature" in (by_line[6].message or "")
    assert by_line[7].code == "model_not_found"
    assert done.output_file_id is None and done.request_counts is not None
    assert done.request_counts.total == 0


def test_bad_requests_get_openai_errors(openai_client) -> None:  # type: ignore[no-untyped-def]
    client = openai_client()
    file_id = upload(client, jsonl([chat_row("a")]))
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=file_id, endpoint="/v1/moderations",
                              completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                              completion_window="soon")  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                              completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError, match="request body is at most") as err:
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                              completion_window="24h", metadata={"k": "v" * (2 << 20)})
    assert err.value.status_code == 413


def test_keys_see_only_their_own_objects(openai_client, make_key, engine: Engine,  # type: ignore[no-untyped-def]
                                         server: ApiServer) -> None:
    alice, bob = openai_client(make_key("alice")), openai_client(make_key("bob"))
    file_id = upload(alice, jsonl([chat_row("a")]))
    batch = alice.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                 completion_window="24h")
    for call in (lambda: bob.files.retrieve(file_id), lambda: bob.files.content(file_id),
                 lambda: bob.files.delete(file_id), lambda: bob.batches.retrieve(batch.id),
                 lambda: bob.batches.cancel(batch.id),
                 lambda: bob.batches.create(input_file_id=file_id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert list(bob.files.list()) == [] and list(bob.batches.list()) == []
    assert alice.files.retrieve(file_id).id == file_id  # untouched by bob's attempts
    assert alice.batches.retrieve(batch.id).status != "cancelling"

    for headers in ({}, {"Authorization": "Bearer kvb-000000000000nope"},
                    {"Authorization": "Basic abc"}):
        request = urllib.request.Request(f"{server.url}/v1/files", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=10)
        assert err.value.code == 401
        assert json.loads(err.value.read())["error"]["code"] == "invalid_api_key"
    wrong = openai_client(alice.api_key[:-4] + "abcd")
    with pytest.raises(openai.AuthenticationError):
        wrong.files.list()
    assert KeyStore(engine).revoke("alice")
    with pytest.raises(openai.AuthenticationError):
        alice.files.retrieve(file_id)


def test_oversized_upload_is_refused_and_nothing_kept(start_server, make_key,  # type: ignore[no-untyped-def]
                                                      tmp_path: Path) -> None:
    server = start_server(max_upload_bytes=64 * 1024)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=make_key("big"), max_retries=0)
    row = json.dumps(chat_row("x")) + "\n"
    big = (row * (100 * 1024 // len(row) + 1)).encode()
    with pytest.raises(openai.APIStatusError) as err:
        client.files.create(file=("big.jsonl", io.BytesIO(big)), purpose="batch")
    assert err.value.status_code == 413
    assert list((tmp_path / "files").iterdir()) == []  # no partial file left
    assert list(client.files.list()) == []
    small = client.files.create(file=("s.jsonl", io.BytesIO(row.encode())), purpose="batch")
    assert small.bytes == len(row)


def test_keys_command_prints_a_key_once_and_stores_its_hash(services, engine: Engine,  # type: ignore[no-untyped-def]
                                                           capsys) -> None:
    from worker.cli import main

    url = ["--database-url", services["database_url"]]
    assert main(["keys", "create", "pipeline", *url]) == 0
    key = capsys.readouterr().out.strip().splitlines()[-1]
    store = KeyStore(engine)
    key_id = store.authenticate(key)
    assert key_id is not None
    with engine.connect() as conn:
        stored = conn.exec_driver_sql("SELECT secret_hash FROM api_keys").scalar_one()
    assert key[len("kvb-") + 12:] not in stored and len(stored) == 64
    assert main(["keys", "list", *url]) == 0
    listed = capsys.readouterr().out
    assert "pipeline" in listed and key_id in listed and key not in listed
    assert main(["keys", "revoke", key_id, *url]) == 0
    assert store.authenticate(key) is None
    assert main(["keys", "revoke", key_id, *url]) == 1  # nothing left to revoke


def _peak_rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("VmHWM:")).split()[1])


def test_uploads_stream_to_storage(openai_client, server: ApiServer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    client = openai_client()
    upload(client, jsonl([chat_row("warm")]))  # the upload path's imports are loaded
    assert server.proc is not None
    before = _peak_rss_kib(server.proc.pid)
    row = json.dumps(chat_row("x")) + "\n"
    data = (row * (96 * 2**20 // len(row))).encode()
    file = client.files.create(file=("big.jsonl", io.BytesIO(data)), purpose="batch")
    assert file.bytes == len(data)
    assert (tmp_path / "files" / file.id).stat().st_size == len(data)
    growth_mib = (_peak_rss_kib(server.proc.pid) - before) / 1024
    assert growth_mib < 24, f"the server's peak memory grew {growth_mib:.0f} MiB for a 96 MiB file"


def test_a_body_without_a_declared_length_is_limited_too(server: ApiServer, make_key) -> None:  # type: ignore[no-untyped-def]
    import http.client

    def body():  # type: ignore[no-untyped-def]
        yield b'{"input_file_id": "'
        yield b"x" * (1 << 20)
        yield b'", "endpoint": "/v1/chat/completions", "completion_window": "24h"}'

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/batches", body=body(), encode_chunked=True,
                 headers={"Authorization": f"Bearer {make_key('c')}",
                          "Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    response = conn.getresponse()
    assert response.status == 413
    assert "request body is at most" in json.loads(response.read())["error"]["message"]
    conn.close()


def test_a_model_the_deployment_serves_is_accepted_with_no_worker_up(
        services: dict[str, str], tmp_path: Path, make_key) -> None:  # type: ignore[no-untyped-def]
    """KVBATCH_MODELS, the setting the workers read too, names the models batches may name
    while no worker is up (workers scale from zero); other names still fail validation."""
    server = ApiServer(services, tmp_path / "files", tmp_path / "api.log", models=())
    server.env["KVBATCH_MODELS"] = json.dumps(["tiny", "scaled-to-zero"])
    server.start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=make_key("t"),
                               max_retries=0, timeout=30)
        assert {m.id for m in client.models.list()} >= {"tiny", "scaled-to-zero"}
        accepted = client.batches.create(
            input_file_id=upload(client, jsonl([chat_row("a", model="scaled-to-zero")])),
            endpoint="/v1/chat/completions", completion_window="24h")
        assert wait_batch(client, accepted.id, {"in_progress", *FINAL}).status == "in_progress"
        refused = client.batches.create(
            input_file_id=upload(client, jsonl([chat_row("b", model="elsewhere")])),
            endpoint="/v1/chat/completions", completion_window="24h")
        done = wait_batch(client, refused.id)
        assert done.status == "failed" and done.errors is not None
        assert [e.code for e in done.errors.data or []] == ["model_not_found"]
    finally:
        server.stop()
