"""OpenAI batch files that run unchanged: ``response_format`` rows held to their schema,
logprobs in OpenAI's shapes, ``n > 1`` at temperature 0, ``logit_bias``; every output line
parses with the official ``openai`` package's own types. A worker on a tiny random model."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jsonschema
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from services import jsonl

from jobs.sdk import Client
from worker.cli import main

SCHEMA = {
    "type": "object",
    "properties": {"label": {"enum": ["spam", "ham"]},
                   "score": {"type": "integer", "minimum": 0, "maximum": 9},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["label", "score", "tags"],
    "additionalProperties": False,
}


def _chat(custom_id: str, **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "max_tokens": 40,
                     "messages": [{"role": "user", "content": f"classify {custom_id}"}], **body}}


def test_openai_file_with_schema_rows_and_logprobs(tmp_path: Path, client: Client, start_worker,  # type: ignore[no-untyped-def]
                                                   cli_args: list[str]) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA,
                                                  "strict": True}}
    rows = [_chat(f"schema-{i}", temperature=0.9, seed=i, response_format=fmt, max_tokens=80)
            for i in range(8)]  # a byte-level tokenizer: a token per character
    rows += [_chat("logprobs", temperature=0, logprobs=True, top_logprobs=3, max_tokens=6),
             _chat("n3", temperature=0, n=3, max_tokens=5),
             _chat("bias", temperature=0, max_tokens=4, logit_bias={"65": 100}),
             {"custom_id": "cmpl", "method": "POST", "url": "/v1/completions",
              "body": {"model": "x", "prompt": "Once upon", "max_tokens": 5, "logprobs": 2,
                       "temperature": 0}}]
    data = tmp_path / "batch.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    worker = start_worker()
    assert main(["submit", str(data), "-o", str(out), "--model", "tiny", "--no-progress",
                 *cli_args]) == 0
    lines = {x["custom_id"]: x for x in jsonl(out.read_text())}
    assert sorted(lines) == sorted(r["custom_id"] for r in rows)
    # the 8 rows' one schema was compiled once (engine stats reach the metric within ~1 s)
    deadline = time.monotonic() + 10
    while worker.metrics.registry.get_sample_value(
            "kvbatch_grammar_compiles_total", {"model_name": "tiny"}) != 1.0:
        assert time.monotonic() < deadline, "kvbatch_grammar_compiles_total did not reach 1"
        time.sleep(0.1)
    bodies = {k: v["response"]["body"] for k, v in lines.items()}

    for i in range(8):
        chat = ChatCompletion.model_validate(bodies[f"schema-{i}"])
        jsonschema.validate(json.loads(chat.choices[0].message.content or ""), SCHEMA)

    chat = ChatCompletion.model_validate(bodies["logprobs"])
    logprobs = chat.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert "".join(t.token for t in logprobs.content) == chat.choices[0].message.content
    for t in logprobs.content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].logprob >= t.logprob  # greedy: the top token was sampled
        assert t.bytes is not None and bytes(t.bytes).decode(errors="replace") == t.token

    samples = ChatCompletion.model_validate(bodies["n3"]).choices
    assert [c.index for c in samples] == [0, 1, 2]
    assert len({c.message.content for c in samples}) == 1  # greedy: equal samples

    bias = ChatCompletion.model_validate(bodies["bias"])
    content = bias.choices[0].message.content or ""
    assert len(content) == 4 and len(set(content)) == 1  # one byte token, 4 times
    job_id = lines["bias"]["response"]["request_id"]
    assert client.job(job_id).result().token_ids == [65] * 4

    cmpl = Completion.model_validate(bodies["cmpl"])
    lp = cmpl.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.text_offset is not None
    assert "".join(lp.tokens) == cmpl.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    assert all(len(top) == 2 for top in lp.top_logprobs or [])


def test_plain_rows_get_logprobs_and_a_response_format_default(
        tmp_path: Path, client: Client, start_worker, cli_args: list[str]) -> None:  # type: ignore[no-untyped-def]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [
        {"custom_id": "a", "prompt": "pick", "temperature": 0.7, "seed": 1},
        {"custom_id": "b", "raw_prompt": "pick", "logprobs": 1, "temperature": 0,
         "response_format": {"type": "regex", "regex": "[0-9]{4}"}},
    ]))
    fmt = tmp_path / "format.json"
    fmt.write_text(json.dumps({"type": "choice", "choice": ["red", "green", "blue"]}))
    out = tmp_path / "out.jsonl"
    start_worker()
    assert main(["submit", str(data), "-o", str(out), "--model", "tiny", "--no-progress",
                 "--response-format", str(fmt), "--max-tokens", "8", *cli_args]) == 0
    lines = {x["custom_id"]: x for x in jsonl(out.read_text())}
    assert lines["a"]["text"] in ("red", "green", "blue")  # the file's default format
    assert lines["b"]["text"].isdigit() and len(lines["b"]["text"]) == 4  # the row's own
    assert [e["token_id"] for e in lines["b"]["logprobs"]] == client.job(
        lines["b"]["job_id"]).result().token_ids


@pytest.mark.parametrize(("content", "message"), [
    ("{", "not JSON"),
    ('{"type": "regex"}', "needs 'regex'"),
    ('{"type": "json_schema", "json_schema": {"schema": {"type": 5}}}', "not a valid JSON"),
])
def test_a_bad_response_format_file_is_refused(tmp_path: Path, cli_args: list[str],
                                               capsys: pytest.CaptureFixture[str],
                                               content: str, message: str) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "x"}\n')
    fmt = tmp_path / "format.json"
    fmt.write_text(content)
    assert main(["submit", str(data), "-o", str(tmp_path / "out.jsonl"), "--no-progress",
                 "--response-format", str(fmt), *cli_args]) == 2
    assert message in capsys.readouterr().err


def test_reported_rows_keep_their_custom_ids_apart_and_resumes_skip_stored_rows(
        client: Client) -> None:
    from jobs.limits import JobLimits

    rows = [{"custom_id": "a", "prompt": "x"}, {"custom_id": "a", "prompt": "y",
                                                "temperature": -1}]
    for order in (rows, rows[::-1], [rows[1], rows[1]]):
        with pytest.raises(ValueError, match="'a' appears more than once"):
            client.submit_batch(order, batch_id="dups", rejected={})
    assert client.jobs.count_by_status() == {}

    rejected: dict = {}
    batch = client.submit_batch([{"custom_id": "long", "raw_prompt": "z" * 300},
                                 {"custom_id": "ok", "prompt": "hi"}],
                                batch_id="limits", rejected=rejected)
    assert rejected == {} and sorted(batch.job_ids) == ["long", "ok"]
    # Lower limits later: a resume does not report the rows the batch already holds...
    client.jobs.limits = JobLimits(max_prompt_bytes=100)
    again = client.submit_batch([{"custom_id": "long", "raw_prompt": "z" * 300},
                                 {"custom_id": "ok", "prompt": "hi"},
                                 {"custom_id": "new", "raw_prompt": "z" * 300}],
                                batch_id="limits", rejected=rejected)
    # ...but a new raw prompt over the limit is reported, not stored
    assert sorted(again.job_ids) == ["long", "ok"]
    assert list(rejected) == ["new"] and "KVBATCH_MAX_PROMPT_BYTES" in rejected["new"].error
