"""``jobs.bulk`` value by value, with no model: rows are stored by ``run_bulk`` (``wait=False``),
their outcomes stored by hand as a worker would, then a second run collects them. Checked: the
tally of each run (written, failed, skipped, submitted, generated tokens), which file each
line lands in and its whole content, output lines in the shape of their own input row in a
file mixing row kinds, resume after a kill cut a line, line numbers in errors, row counts for
progress, and the batch id an output resumes."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from pathlib import Path

import pytest
from services import jsonl

from jobs.bulk import (
    BulkOptions,
    OutputFiles,
    count_rows,
    iter_rows,
    resume_batch_id,
    run_bulk,
)
from jobs.schemas import JobResult, JobStats, JobStatus, Outcome, Usage
from jobs.sdk import Client
from jobs.store import DeliveryStore

MODEL = "tiny"
pytestmark = pytest.mark.timeout(180)  # a follow that never ends fails, not hangs


def _opts(data: Path, out: Path, errors: Path | None, batch_id: str, **kw: object) -> BulkOptions:
    return BulkOptions(input=data, output=out, errors=errors, batch_id=batch_id, model=MODEL,
                       progress=False, **kw)  # type: ignore[arg-type]


def _run(client: Client, opts: BulkOptions):  # type: ignore[no-untyped-def]
    return run_bulk(client, lambda: iter_rows(opts.input, strict=opts.strict), opts)


def _settle(client: Client, outcomes: list[Outcome]) -> None:
    """What a worker does: take the jobs, then store their outcomes."""
    store = DeliveryStore(client.jobs.engine)
    store.begin_deliveries([o.job_id for o in outcomes], "w", 3, time.time())
    store.finish(outcomes)


def _tally(t) -> tuple[int, int, int, int, int]:  # type: ignore[no-untyped-def]
    return (t.written, t.failed, t.skipped, t.submitted, t.generated_tokens)


def test_tallies_files_and_lines_of_a_resumed_run(tmp_path: Path, client: Client) -> None:
    data, out, errors = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    rows = [{"custom_id": f"r{i}", "prompt": f"item {i}", "max_tokens": 4} for i in range(6)]
    rows.insert(3, {"custom_id": "bad", "prompt": "x", "temperature": -1})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    opts = _opts(data, out, errors, "bulk-values")

    # First run: stores the six good rows, reports the bad one, waits for nothing.
    first = _run(client, _opts(data, out, errors, "bulk-values", wait=False))
    assert _tally(first) == (1, 1, 0, 6, 0)
    assert out.read_text() == ""
    (refused,) = jsonl(errors.read_text())
    assert refused["custom_id"] == "bad" and refused["job_id"] is None
    assert refused["status"] == "failed" and refused["text"] is None
    assert refused["error"] == "sampling: Value error, temperature must be >= 0.0, got -1.0"
    ids = client.batch("bulk-values").job_ids
    assert sorted(ids) == [f"r{i}" for i in range(6)]
    assert json.loads((tmp_path / "out.jsonl.batch").read_text()) == {
        "batch_id": "bulk-values", "input": str(data.resolve())}

    # Outcomes, finishing in reverse order: r5 first, r0 last.
    now = time.time()
    statuses = {"r0": JobStatus.SUCCEEDED, "r1": JobStatus.FAILED, "r2": JobStatus.SUCCEEDED,
                "r3": JobStatus.CANCELLED, "r4": JobStatus.SUCCEEDED, "r5": JobStatus.EXPIRED}
    outcomes = []
    for i in range(6):
        cid, status = f"r{i}", statuses[f"r{i}"]
        ok = status is JobStatus.SUCCEEDED
        outcomes.append(Outcome(
            ids[cid], status, now - i,
            error=None if ok else f"{status.value} {cid}",
            result=JobResult(text=f"out {cid}", finish_reason="length",
                             usage=Usage(prompt_tokens=3, completion_tokens=10 * (i + 1)))
            if ok else None,
            stats=JobStats(prompt_tokens=3, generated_tokens=10 * (i + 1)) if ok else None))
    _settle(client, outcomes)

    # Second run: submits nothing new, writes the six outcomes, in the order they finished.
    second = _run(client, opts)
    assert _tally(second) == (6, 3, 1, 6, 10 + 30 + 50)
    assert len(client.batch("bulk-values").job_ids) == 6
    lines = jsonl(out.read_text())
    assert [x["custom_id"] for x in lines] == ["r4", "r2", "r0"]  # finish order, succeeded only
    for line in lines:
        cid = line["custom_id"]
        i = int(cid[1:])
        assert line == {"custom_id": cid, "job_id": ids[cid], "status": "succeeded",
                        "text": f"out {cid}", "finish_reason": "length",
                        "usage": {"prompt_tokens": 3, "cached_prompt_tokens": 0,
                                  "completion_tokens": 10 * (i + 1)},
                        "error": None} | {k: v for k, v in line.items()
                                          if k not in ("custom_id", "job_id", "status", "text",
                                                       "finish_reason", "usage", "error")}
    failed = jsonl(errors.read_text())
    assert [x["custom_id"] for x in failed] == ["bad", "r5", "r3", "r1"]
    for line in failed[1:]:
        cid = line["custom_id"]
        assert line["status"] == statuses[cid].value and line["job_id"] == ids[cid]
        assert line["error"] == f"{statuses[cid].value} {cid}" and line["text"] is None

    # A third run finds every row written: nothing written, everything skipped.
    third = _run(client, opts)
    assert _tally(third) == (0, 0, 7, 0, 0)
    assert len(jsonl(out.read_text())) == 3 and len(jsonl(errors.read_text())) == 4

    # A kill cut the last line of the output and r2's line was lost before it: the next run
    # writes r2 and r0 again, once each, and nothing else.
    text = out.read_text()
    kept = [x for x in jsonl(text) if x["custom_id"] == "r4"]
    out.write_text(json.dumps(kept[0]) + "\n" + '{"custom_id": "r0", "job_id": "')
    fourth = _run(client, opts)
    assert _tally(fourth) == (2, 0, 5, 2, 10 + 30)  # r0 and r2 found stored
    assert [x["custom_id"] for x in jsonl(out.read_text())] == ["r4", "r2", "r0"]
    assert len(jsonl(errors.read_text())) == 4


def test_inline_errors_and_a_refused_run_restores_the_record(tmp_path: Path,
                                                             client: Client) -> None:
    """Without an errors file every line goes to the output. A run refused before it stored
    anything leaves the files it found as they were, the batch record included."""
    data, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    data.write_text('{"custom_id": "a", "prompt": "x"}\n{"custom_id": "b", "prompt": "y"}\n')
    first = _run(client, _opts(data, out, None, "inline", wait=False))
    assert _tally(first) == (0, 0, 0, 2, 0)
    ids = client.batch("inline").job_ids
    _settle(client, [Outcome(ids["a"], JobStatus.SUCCEEDED, time.time(),
                             result=JobResult(text="A")),
                     Outcome(ids["b"], JobStatus.FAILED, time.time() + 1, error="boom")])
    second = _run(client, _opts(data, out, None, "inline"))
    assert _tally(second) == (2, 1, 0, 2, 0)
    assert [(x["custom_id"], x["status"], x["text"], x["error"])
            for x in jsonl(out.read_text())] == [("a", "succeeded", "A", None),
                                                 ("b", "failed", None, "boom")]
    record = (tmp_path / "out.jsonl.batch").read_text()
    before = out.read_bytes()
    # The same output, another batch id, and a row repeated: refused, nothing changed.
    data.write_text('{"custom_id": "a", "prompt": "x"}\n{"custom_id": "a", "prompt": "y"}\n')
    with pytest.raises(ValueError, match="appears more than once"):
        _run(client, _opts(data, out, None, "other-batch"))
    assert (tmp_path / "out.jsonl.batch").read_text() == record and out.read_bytes() == before
    # Refused by the store after the record was written (another webhook than the batch's
    # own): the record written for it is put back as it was.
    client.submit_batch([{"custom_id": "z", "prompt": "hi"}], batch_id="hooked",
                        webhook_url="https://owner.example.com/hook")
    data.write_text('{"custom_id": "a", "prompt": "x"}\n{"custom_id": "b", "prompt": "y"}\n'
                    '{"custom_id": "c", "prompt": "z"}\n')
    with pytest.raises(ValueError, match="set by its first submission"):
        _run(client, _opts(data, out, None, "hooked",
                           webhook_url="https://attacker.example.com/hook"))
    assert (tmp_path / "out.jsonl.batch").read_text() == record and out.read_bytes() == before
    assert sorted(client.batch("hooked").job_ids) == ["z"]
    # A new output refused: neither the output nor a record is left behind.
    fresh = tmp_path / "fresh.jsonl"
    with pytest.raises(ValueError, match="set by its first submission"):
        _run(client, _opts(data, fresh, tmp_path / "fresh-err.jsonl", "hooked",
                           webhook_url="https://attacker.example.com/hook"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl",
                                                          "out.jsonl.batch"]


def test_each_output_line_has_the_shape_of_its_own_row(tmp_path: Path, client: Client) -> None:
    """A file mixing plain rows and OpenAI chat and completion rows: each result line in the
    format of the row it answers, whichever kind came first."""
    data, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [
        {"custom_id": "p0", "prompt": "plain"},
        {"custom_id": "c0", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "x", "messages": [{"role": "user", "content": "hi"}]}},
        {"custom_id": "t0", "method": "POST", "url": "/v1/completions",
         "body": {"model": "x", "prompt": "once"}},
        {"custom_id": "p1", "prompt": "plain again"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _run(client, _opts(data, out, None, "kinds", wait=False))
    ids = client.batch("kinds").job_ids
    now = time.time()
    _settle(client, [Outcome(ids[c], JobStatus.SUCCEEDED, now + n,
                             result=JobResult(text=f"text {c}", finish_reason="stop"))
                     for n, c in enumerate(["p0", "c0", "t0", "p1"])])
    tally = _run(client, _opts(data, out, None, "kinds"))
    assert tally.written == 4 and tally.failed == 0
    lines = {x["custom_id"]: x for x in jsonl(out.read_text())}
    for c in ("p0", "p1"):
        assert lines[c]["text"] == f"text {c}" and lines[c]["status"] == "succeeded"
        assert "response" not in lines[c]
    chat = lines["c0"]["response"]["body"]
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["content"] == "text c0"
    completion = lines["t0"]["response"]["body"]
    assert completion["object"] == "text_completion"
    assert completion["choices"][0]["text"] == "text t0"

    # The same rows with an OpenAI row first: the plain rows are still plain lines.
    data2, out2 = tmp_path / "in2.jsonl", tmp_path / "out2.jsonl"
    data2.write_text("".join(json.dumps(r) + "\n" for r in [rows[1], rows[0]]))
    _run(client, _opts(data2, out2, None, "kinds2", wait=False))
    ids2 = client.batch("kinds2").job_ids
    _settle(client, [Outcome(ids2[c], JobStatus.SUCCEEDED, now + n,
                             result=JobResult(text=f"text {c}", finish_reason="stop"))
                     for n, c in enumerate(["c0", "p0"])])
    _run(client, _opts(data2, out2, None, "kinds2"))
    lines2 = {x["custom_id"]: x for x in jsonl(out2.read_text())}
    assert lines2["p0"]["text"] == "text p0" and "response" not in lines2["p0"]
    assert lines2["c0"]["response"]["body"]["object"] == "chat.completion"


def test_line_numbers_and_row_counts(tmp_path: Path) -> None:
    jl = tmp_path / "rows.jsonl"
    jl.write_text('\n{"custom_id": "a", "prompt": "x"}\n\n  \n{"custom_id": "b", "nope": 1}\n')
    with pytest.raises(ValueError, match=r"rows\.jsonl:5: unknown field"):
        list(iter_rows(jl))
    (a, b) = list(iter_rows(jl, strict=False))
    assert (a.custom_id, a.error) == ("a", None)
    assert b.custom_id == "b" and b.error.startswith("line 5: unknown field")
    assert count_rows(jl) == 2
    csv_file = tmp_path / "rows.csv"
    csv_file.write_text("custom_id,prompt,colour\na,x,\nb,y,red\n")
    with pytest.raises(ValueError, match=r"rows\.csv:3: unknown field"):
        list(iter_rows(csv_file))
    assert count_rows(csv_file) == 2
    assert count_rows(tmp_path / "rows.csv") == 2
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    assert count_rows(empty) == 0
    # Plain rows with no custom_id are numbered by their place among the rows.
    jl.write_text('{"prompt": "x"}\n\n{"prompt": "y"}\n')
    assert [r.custom_id for r in iter_rows(jl)] == ["0", "1"]


def test_which_batch_an_output_resumes(tmp_path: Path) -> None:
    data, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    data.write_text('{"prompt": "x"}\n')
    assert resume_batch_id(data, out, "given") == "given"
    fresh = resume_batch_id(data, out)
    assert fresh.startswith("ds-") and len(fresh) == 35 and fresh != resume_batch_id(data, out)
    out.write_text("")  # an empty output is a new one
    assert resume_batch_id(data, out) != resume_batch_id(data, out)
    out.write_text('{"custom_id": "0"}\n')  # written by a kvbatch that derived the id
    key = f"{data.resolve()}\n{out.resolve()}"
    assert resume_batch_id(data, out) == "ds-" + hashlib.sha256(key.encode()).hexdigest()[:24]
    record = tmp_path / "out.jsonl.batch"
    record.write_text("ds-legacy\n")
    assert resume_batch_id(data, out) == "ds-legacy"
    record.write_text(json.dumps({"batch_id": "ds-rec", "input": str(data.resolve())}))
    assert resume_batch_id(data, out) == "ds-rec"
    # The input named by a relative path is the same input.
    import os
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert resume_batch_id(Path("in.jsonl"), out) == "ds-rec"
    finally:
        os.chdir(cwd)
    record.write_text(json.dumps({"batch_id": "ds-rec", "input": str(tmp_path / "x.jsonl")}))
    with pytest.raises(ValueError, match="holds the results of"):
        resume_batch_id(data, out)
    assert uuid.UUID(fresh[3:]).hex == fresh[3:]


def test_output_files_keep_complete_lines_only(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text('{"custom_id": "a"}\n{"custom_id": "b"}\n  {"custom_id": "c", "te')
    files = OutputFiles(out, None)
    files.close()
    assert files.done == {"a", "b"} and files.created == []
    assert out.read_text() == '{"custom_id": "a"}\n{"custom_id": "b"}\n'
    one = tmp_path / "one.jsonl"
    one.write_text('{"custom_id": "z"}\n')
    files = OutputFiles(one, tmp_path / "new-errors.jsonl")
    files.close()
    assert files.done == {"z"} and files.created == [tmp_path / "new-errors.jsonl"]
    assert one.read_text() == '{"custom_id": "z"}\n'


def test_each_line_is_on_disk_once_written(tmp_path: Path) -> None:
    """Lines are flushed as they are written: what a run killed next had written is in the
    file (and a follower of the file sees results as they come)."""
    from jobs.rows import Row, RowKind

    out = tmp_path / "out.jsonl"
    files = OutputFiles(out, None)
    try:
        files.write_rejected(Row(custom_id="x", kind=RowKind.PLAIN, error="line 1: bad"))
        assert jsonl(out.read_text()) == [{"custom_id": "x", "job_id": None, "status": "failed",
                                           "text": None, "finish_reason": None, "usage": None,
                                           "error": "line 1: bad"}]
        assert files.done == {"x"}
    finally:
        files.close()


def test_an_output_of_another_inputs_rows_is_refused(tmp_path: Path, client: Client) -> None:
    """Results of rows this input does not have would count as done for rows of the same
    ``custom_id``: refused before anything is stored or written."""
    data, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    data.write_text('{"custom_id": "a", "prompt": "x"}\n{"custom_id": "b", "prompt": "y"}\n')
    out.write_text('{"custom_id": "a", "text": "x"}\n{"custom_id": "elsewhere", "text": "z"}\n')
    with pytest.raises(ValueError, match="custom_id 'elsewhere'"):
        _run(client, _opts(data, out, None, "foreign", wait=False))
    assert out.read_text() == ('{"custom_id": "a", "text": "x"}\n'
                               '{"custom_id": "elsewhere", "text": "z"}\n')
    assert client.jobs.count_by_status() == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]
    # Results of some of its own rows: resumed (only b is submitted).
    out.write_text('{"custom_id": "a", "text": "x"}\n')
    tally = _run(client, _opts(data, out, None, "foreign", wait=False))
    assert (tally.skipped, tally.submitted) == (1, 1)
    assert sorted(client.batch("foreign").job_ids) == ["b"]
