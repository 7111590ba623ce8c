"""Batches at scale and the bulk CLI: 1,000 rows through submit_batch, resume after a kill,
OpenAI batch files, status/cancel/stats, against real Redis and PostgreSQL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import sqlalchemy as sa
from services import all_roles_store, jsonl
from transformers import AutoTokenizer

from jobs.feed import MIN_WINDOW
from jobs.queue import JobQueue
from jobs.schemas import JobStatus
from jobs.sdk import Client
from worker.cli import main

SQL = all_roles_store()

MODEL = "tiny"
BLOCK = 8  # tokens per KV block of the workers here
SYSTEM = "You are a terse assistant; every job of this batch shares this system prompt. " * 2


def _lines(path: Path) -> list[dict]:
    return jsonl(path.read_text()) if path.exists() else []


def _jobs_of(client: Client, batch_id: str) -> list[tuple[str | None, int]]:
    with client.jobs.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT custom_id, attempts FROM jobs WHERE batch_id = :b"),
                            {"b": batch_id}).all()
    return [(r.custom_id, r.attempts) for r in rows]


def test_thousand_row_batch(client: Client, start_worker) -> None:  # type: ignore[no-untyped-def]
    rows = [{"custom_id": f"row-{i}", "messages": [{"role": "user", "content": f"item {i}"}]}
            for i in range(1000)]
    batch = client.submit_batch(rows, batch_id="big", system_prompt=SYSTEM, max_tokens=3,
                                temperature=0.0)
    assert batch.counts().queued == 1000 and len(batch.job_ids) == 1000
    start_worker()
    seen = []
    for info in batch.results(timeout_s=240):
        seen.append(info)
        if len(seen) == 500:  # live counts mid-way (the rest may have finished meanwhile)
            counts = batch.counts()
            assert counts.total == 1000 and 500 <= counts.done <= 1000
    assert Counter(i.custom_id for i in seen) == Counter(r["custom_id"] for r in rows)
    assert all(i.status is JobStatus.SUCCEEDED for i in seen)
    finished = [i.finished_at for i in seen]
    assert finished == sorted(finished)  # completion order (one worker)
    assert batch.wait(timeout_s=5).succeeded == 1000
    # Resubmitting the batch (custom_id is the key) adds nothing and reruns nothing.
    again = client.submit_batch(rows, batch_id="big", system_prompt=SYSTEM, max_tokens=3)
    assert again.job_ids == batch.job_ids
    jobs = _jobs_of(client, "big")
    assert len(jobs) == 1000 and {attempts for _, attempts in jobs} == {1}
    stats = client.stats(batch_id="big")
    assert stats.jobs == 1000 and stats.by_status == {"succeeded": 1000}
    assert stats.generated_tokens == sum(i.result.usage.completion_tokens for i in seen)
    assert stats.prefix_cache_hit_rate > 0.5  # the shared system prompt is computed once-ish
    assert stats.e2e_s["p50"] <= stats.e2e_s["p99"] and stats.peak_kv_bytes > 0


def test_cli_resume_after_kill(tmp_path: Path, client: Client, start_worker,  # type: ignore[no-untyped-def]
                               cli_env: dict[str, str]) -> None:
    n = 240
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"custom_id": f"c{i}", "prompt": f"p{i}",
                                        "max_tokens": 24, "ignore_eos": True}) + "\n"
                            for i in range(n)))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "worker.cli", "submit", str(data), "-o", str(out),
           "--model", MODEL, "--batch-id", "resume", "--no-progress"]
    start_worker(max_num_seqs=4, waiting_buffer=2)
    log = tmp_path / "first-run.log"
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, env=cli_env, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while (len(out.read_bytes().splitlines()) if out.exists() else 0) < 20:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    first = len(_lines(out))
    assert 20 <= first < n, "killed too late to test resume"

    done = subprocess.run(cmd, env=cli_env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"were already in {out}" in done.stdout and "hit rate" in done.stdout
    lines = _lines(out)
    assert Counter(line["custom_id"] for line in lines) == Counter(f"c{i}" for i in range(n))
    assert all(line["status"] == "succeeded" and line["usage"]["completion_tokens"] == 24
               for line in lines)
    jobs = _jobs_of(client, "resume")
    assert len(jobs) == n and {attempts for _, attempts in jobs} == {1}  # nothing re-run

    # A third run finds everything written: no new job, no new line.
    again = subprocess.run(cmd, env=cli_env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "0 rows written" in again.stdout
    assert len(_lines(out)) == n and len(_jobs_of(client, "resume")) == n


def test_cli_openai_batch_format(tmp_path: Path, client: Client, start_worker,  # type: ignore[no-untyped-def]
                                 cli_args: list[str], capsys: pytest.CaptureFixture[str],
                                 tiny_model: str) -> None:
    chat = [{"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "gpt-4o-mini", "max_tokens": 5,
                      "messages": [{"role": "user", "content": f"question {i}"}]}}
            for i in range(6)]
    completion = [{"custom_id": "cmpl-0", "method": "POST", "url": "/v1/completions",
                   "body": {"model": "x", "prompt": "Once upon", "max_tokens": 4,
                            "temperature": 0, "stop": "\n"}}]
    bad = [{"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "x", "temperature": -1,
                     "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}},
           {"custom_id": "tools", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "x", "tools": [], "messages": [{"role": "user", "content": "a"}]}}]
    data = tmp_path / "batch.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat + completion + bad))
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    submit = ["submit", str(data), "-o", str(out), "-e", str(errors), "--model", MODEL,
              "--batch-id", "oai", "--system-prompt", "Be brief.", "--no-progress", *cli_args]
    # --strict: a sampling value out of range refuses the whole file, naming the row and the
    # field, before anything is stored.
    capsys.readouterr()
    assert main([*submit, "--strict"]) == 2
    assert "batch.jsonl:9: body field(s) 'tools' not supported" in capsys.readouterr().err
    data.write_text("".join(json.dumps(r) + "\n" for r in chat + completion + bad[:1]))
    assert main([*submit, "--strict"]) == 2
    assert "row 7: sampling: Value error, temperature must be >= 0.0" in capsys.readouterr().err
    data.write_text("".join(json.dumps(r) + "\n" for r in chat + completion + bad))
    assert client.jobs.count_by_status() == {}
    # By default the bad rows get OpenAI's request-error lines and the others run.
    start_worker(block_size=BLOCK)
    assert main(submit) == 0
    lines = {line["custom_id"]: line for line in _lines(out)}
    assert sorted(lines) == sorted(r["custom_id"] for r in chat + completion)
    refused = {line["custom_id"]: line for line in _lines(errors)}
    assert sorted(refused) == ["bad", "tools"]
    for custom_id, fragment in (("bad", "temperature must be >= 0.0"), ("tools", "'tools'")):
        response = refused[custom_id]["response"]
        assert response["status_code"] == 400 and refused[custom_id]["error"] is None
        assert fragment in response["body"]["error"]["message"]
        assert response["body"]["error"]["type"] == "invalid_request_error"
    for i in range(6):
        line = lines[f"chat-{i}"]
        assert line["error"] is None and line["id"].startswith("batch_req_")
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and body["object"] == "chat.completion"
        assert body["model"] == MODEL and body["choices"][0]["message"]["role"] == "assistant"
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert 0 < usage["completion_tokens"] <= 5
    cached = sorted(lines[f"chat-{i}"]["response"]["body"]["usage"]["prompt_tokens_details"]
                    ["cached_tokens"] for i in range(6))
    # The chat rows share the system turn and "question ": whichever computes it first, the
    # other five read its full blocks from the cache.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"question {i}"}],
        add_generation_prompt=True, tokenize=False), add_special_tokens=False) for i in (0, 1)]
    shared = next(n for n, (x, y) in enumerate(zip(*prompts, strict=False)) if x != y)
    assert shared >= BLOCK
    assert cached == [0] + [shared // BLOCK * BLOCK] * 5
    body = lines["cmpl-0"]["response"]["body"]
    assert body["object"] == "text_completion" and isinstance(body["choices"][0]["text"], str)
    # The system prompt reached the chat rows (and not the completion row: raw text).
    spec = SQL(client.jobs.engine).specs([client.batch("oai").job_ids["chat-0"]])[0][0]
    assert spec.messages[0].role == "system" and spec.messages[0].content == "Be brief."
    raw = SQL(client.jobs.engine).specs([client.batch("oai").job_ids["cmpl-0"]])[0][0]
    assert raw.raw_prompt == "Once upon" and raw.messages is None
    # A second run has nothing left to do: the refused rows are reported, not retried.
    assert main(submit) == 0 and len(_lines(errors)) == 2

    capsys.readouterr()
    assert main(["status", "oai", *cli_args]) == 0
    text = capsys.readouterr().out
    assert "succeeded" in text and "total" in text and "hit rate" in text
    assert main(["stats", "--batch", "oai", "--since", "1h", *cli_args]) == 0
    assert "7 (7 succeeded)" in capsys.readouterr().out
    assert main(["status", client.batch("oai").job_ids["chat-0"], *cli_args]) == 0
    assert "chat-0" in capsys.readouterr().out


def test_cli_rejects_bad_file_and_cancels(tmp_path: Path, client: Client, cli_args: list[str],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "fine"}\n{"prompt": "x", "max_tokens": "lots"}\n')
    out = tmp_path / "out.jsonl"
    assert main(["submit", str(data), "-o", str(out), "--strict", "--no-progress",
                 *cli_args]) == 2
    assert "max_tokens" in capsys.readouterr().err
    data.write_text('{"prompt": "fine"}\nnot json\n')  # no custom_id to report it under
    assert main(["submit", str(data), "-o", str(out), "--no-progress", *cli_args]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert client.jobs.count_by_status() == {}  # nothing enqueued

    csv_data = tmp_path / "rows.csv"
    csv_data.write_text("custom_id,prompt,max_tokens\na,hello,3\nb,world,\n")
    batch = client.submit_batch([{"custom_id": "x", "prompt": "queued"}] * 1, batch_id="c")
    assert main(["cancel", "c", *cli_args]) == 0
    assert batch.counts().cancelled == 1
    from jobs.bulk import iter_rows

    rows = list(iter_rows(csv_data))
    assert [(r.custom_id, r.prompt, r.sampling) for r in rows] == [
        ("a", "hello", {"max_tokens": "3"}), ("b", "world", {})]
    job = client.submit(prompt="lonely", model="nobody-serves")
    assert main(["cancel", job.id, *cli_args]) == 0
    assert job.status() is JobStatus.CANCELLED
    assert main(["cancel", "no-such-id", *cli_args]) == 1


def test_submit_streams_in_chunks_and_no_wait_then_collects(tmp_path: Path, client: Client,  # type: ignore[no-untyped-def]
                                                            start_worker, cli_args: list[str],
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys) -> None:
    import jobs.bulk

    monkeypatch.setattr(jobs.bulk, "SUBMIT_CHUNK", 7)  # 30 rows: five chunks
    data, out = tmp_path / "data.jsonl", tmp_path / "out.jsonl"
    rows = [{"custom_id": f"r{i}", "prompt": f"item {i}", "max_tokens": 2} for i in range(30)]
    repeated = [*rows[:26], {"custom_id": "r3", "prompt": "again"}]  # in the fourth chunk
    data.write_text("".join(json.dumps(r) + "\n" for r in repeated))
    argv = ["submit", str(data), "-o", str(out), "--model", MODEL, "--no-progress", *cli_args]
    assert main(argv) == 2  # refused before a chunk is stored: custom_id keys the output
    assert "'r3' appears more than once" in capsys.readouterr().err and not out.exists()

    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([*argv, "--no-wait"]) == 0  # no worker yet: stores, does not wait
    assert "30 rows submitted" in capsys.readouterr().out
    batch_id = json.loads((tmp_path / "out.jsonl.batch").read_text())["batch_id"]
    assert sorted(c for c, _ in _jobs_of(client, batch_id)) == sorted(f"r{i}" for i in range(30))
    assert _lines(out) == []

    start_worker()
    assert main(argv) == 0  # the same command collects the results, submitting nothing
    lines = _lines(out)
    assert sorted(x["custom_id"] for x in lines) == sorted(f"r{i}" for i in range(30))
    assert all(x["status"] == "succeeded" for x in lines)
    assert len(_jobs_of(client, batch_id)) == 30


def test_strict_checks_the_whole_file_before_storing(tmp_path: Path, client: Client,
                                                     cli_args: list[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import jobs.bulk

    monkeypatch.setattr(jobs.bulk, "SUBMIT_CHUNK", 5)
    data, out = tmp_path / "data.jsonl", tmp_path / "out.jsonl"
    rows = [{"custom_id": f"r{i}", "prompt": f"item {i}"} for i in range(20)]
    rows[17]["temperature"] = -1  # in the fourth chunk
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["submit", str(data), "-o", str(out), "--model", MODEL, "--no-progress",
                 "--strict", "--batch-id", "strict-stream", *cli_args]) == 2
    assert _jobs_of(client, "strict-stream") == [] and not out.exists()


def test_cancelling_a_queued_batch_empties_its_stream(client: Client, redis_client) -> None:  # type: ignore[no-untyped-def]
    rows = [{"custom_id": f"c{i}", "prompt": f"item {i}"} for i in range(2500)]
    batch = client.submit_batch(rows, batch_id="to-cancel", model=MODEL)  # no worker
    queue = JobQueue(redis_client, MODEL, client.jobs.keys)
    assert queue.length() == MIN_WINDOW  # the rest waits in SQL
    assert batch.cancel() == 2500  # three pages of the (batch_id, custom_id) index
    assert batch.counts().cancelled == 2500
    assert queue.length() == 0  # no worker needed to clear them
    ids = sorted(batch.job_ids.values())
    assert len(set(ids)) == 2500 and all(len(i) == 32 for i in ids)


def test_resume_reads_results_whose_text_holds_line_separators(tmp_path: Path) -> None:
    """A model's text may hold U+2028 or U+0085, which JSON leaves unescaped: a results line
    holding one is still one line (it once made a resumed run refuse its own output file)."""
    from jobs.bulk import OutputFiles

    out = tmp_path / "results.jsonl"
    lines = [{"custom_id": "a", "text": "one\u2028two\x85three"}, {"custom_id": "b", "text": "x"}]
    out.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines)
                   + '{"custom_id": "c", "te')  # and a line cut off by a kill
    files = OutputFiles(out, None)
    files.close()
    assert files.done == {"a", "b"}
    assert jsonl(out.read_text()) == lines  # the cut line is gone, the others intact
