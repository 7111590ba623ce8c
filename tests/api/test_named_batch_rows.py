"""The routes of a key's named batches (``jobs.api.rows``, what ``RemoteClient`` speaks) on a
real ``kvbatch serve``, no worker (the jobs stay queued): rows are stored once by
``custom_id`` in the key's own batch, a row that cannot run is rejected alone, a request the
API cannot take stores nothing, another key's jobs are unknown to a key, and the rows count
against the key's queued-requests quota."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from api_server import ApiServer
from sqlalchemy import Engine

from jobs.api.keys import KeyStore
from jobs.api.rows import tenant_batch_id
from jobs.remote import RemoteClient, RemoteError
from worker.cli import main


def _rows(*custom_ids: str) -> list[dict]:
    return [{"custom_id": c, "prompt": f"say {c}", "metadata": {"row": c}} for c in custom_ids]


def _jobs(engine: Engine) -> list[sa.Row]:
    with engine.connect() as conn:
        return conn.execute(sa.text(
            "SELECT j.id, j.batch_id, j.custom_id, j.priority, j.spec, j.status, b.owner "
            "FROM jobs j JOIN batches b ON b.id = j.batch_id ORDER BY j.custom_id")).all()


def test_rows_are_stored_once_in_the_keys_own_batch(  # type: ignore[no-untyped-def]
        server: ApiServer, make_key: Callable[[str], str], engine: Engine) -> None:
    key, other_key = make_key("a"), make_key("b")
    a, b = (RemoteClient(server.url, k, model="tiny") for k in (key, other_key))
    owner, other_owner = key[4:16], other_key[4:16]
    first = a.submit_rows("p.s.1", _rows("x", "y"), priority=-2, sampling={"max_tokens": 4})
    assert first.rejected == {} and set(first.job_ids) == {"x", "y"}
    # again with one row held: its job is the stored one, the new row is stored
    again = a.submit_rows("p.s.1", _rows("x", "z"), priority=-2, sampling={"max_tokens": 4})
    assert again.job_ids["x"] == first.job_ids["x"] and again.job_ids["z"] not in (
        first.job_ids.values())
    # another key's batch of the same name is another batch
    theirs = b.submit_rows("p.s.1", _rows("x"), sampling={"max_tokens": 4})
    assert theirs.job_ids["x"] != first.job_ids["x"]
    jobs = _jobs(engine)
    assert sorted((j.batch_id, j.custom_id, j.owner, j.priority) for j in jobs) == sorted([
        (f"{owner}:p.s.1", "x", owner, -2), (f"{other_owner}:p.s.1", "x", other_owner, 0),
        (f"{owner}:p.s.1", "y", owner, -2), (f"{owner}:p.s.1", "z", owner, -2)])
    assert {j.id for j in jobs} == {*again.job_ids.values(), first.job_ids["y"],
                                    theirs.job_ids["x"]}
    assert {j.spec["sampling"]["max_tokens"] for j in jobs} == {4}
    assert {j.custom_id: j.spec["metadata"] for j in jobs} == {
        c: {"row": c} for c in ("x", "y", "z")}
    # a key follows its own jobs; another's are unknown to it, whatever their ids
    ids = [first.job_ids["x"], first.job_ids["y"]]
    assert a.wait(ids, 0.2) == ([], [])  # queued: none done within the wait
    assert b.wait([*ids, "no-such-job"], 0.2) == ([], [*ids, "no-such-job"])


def test_a_row_that_cannot_run_is_rejected_alone_and_a_bad_request_stores_nothing(  # type: ignore[no-untyped-def]
        server: ApiServer, make_key: Callable[[str], str], engine: Engine) -> None:
    a = RemoteClient(server.url, make_key("a"), model="tiny")
    rows = [*_rows("ok"), {"custom_id": "hot", "prompt": "x", "temperature": -1.0},
            {"custom_id": "empty"}, {"custom_id": "first", "prompt": "x", "priority": -1001},
            {"custom_id": "edge", "prompt": "x", "priority": -1000},
            {"custom_id": "last", "prompt": "x", "priority": 1001}]
    done = a.submit_rows("p.s.1", rows, sampling={"max_tokens": 4})
    assert set(done.job_ids) == {"ok", "edge"}
    assert set(done.rejected) == {"hot", "empty", "first", "last"}
    assert "temperature" in done.rejected["hot"]
    assert done.rejected["first"] == ("priority -1001 is outside -1000..1000, the priorities a "
                                      "key may ask for")
    assert "priority 1001 is outside" in done.rejected["last"]
    assert [(j.custom_id, j.priority) for j in _jobs(engine)] == [("edge", -1000), ("ok", 0)]
    refusals = [
        (lambda: a.submit_rows("p.s.1", [{"prompt": "no key"}, *_rows("new")]),
         "row 0: a row needs a custom_id"),
        (lambda: a.submit_rows("p.s.1", _rows("new"), model="elsewhere"),
         "model 'elsewhere' is not served here"),
        (lambda: a.submit_rows(".hidden", _rows("new")), "batch name '.hidden' must match"),
        (lambda: a.submit_rows("p.s.1", _rows("new", "new")), "appears more than once"),
        (lambda: a.submit_rows("p.s.1", _rows("new"), priority=5000), "priority")]
    for submit, message in refusals:
        with pytest.raises(RemoteError, match=message) as refused:
            submit()
        assert refused.value.status == 400
    assert [j.custom_id for j in _jobs(engine)] == ["edge", "ok"]


def test_a_long_name_is_stored_under_its_hash() -> None:
    name = "p" * 60 + ".stage.0123456789abcdef"
    stored = tenant_batch_id("0123456789ab", name)
    assert stored == f"0123456789ab::{hashlib.sha256(name.encode()).hexdigest()[:48]}"
    assert len(stored) == 62
    assert tenant_batch_id("0123456789ab", "qa.judge.1") == "0123456789ab:qa.judge.1"


def test_named_batch_rows_count_against_the_queued_requests_quota(  # type: ignore[no-untyped-def]
        start_server, make_key: Callable[[str], str], engine: Engine) -> None:
    server = start_server(max_queued_rows_per_key=3)
    key = make_key("a")
    a = RemoteClient(server.url, key, model="tiny")
    a.submit_rows("p.s.1", _rows("x", "y"))
    with pytest.raises(RemoteError, match="the key has 2 requests queued or running") as refused:
        a.submit_rows("p.s.2", _rows("z", "w"))
    assert "quota exceeded" in refused.value.message
    assert len(_jobs(engine)) == 2
    RemoteClient(server.url, make_key("b"), model="tiny").submit_rows("p.s.2", _rows("z", "w"))
    assert len(_jobs(engine)) == 4  # another key's quota is its own


def test_the_command_says_in_one_line_what_the_api_refused(  # type: ignore[no-untyped-def]
        server: ApiServer, make_key: Callable[[str], str], engine: Engine, tmp_path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "p.py"
    script.write_text("from jobs import Pipeline\npipeline = Pipeline('p')\n"
                      "pipeline.stage('s', source=[{'i': 1}], prompt=str)\n")
    monkeypatch.delenv("KVBATCH_API_KEY", raising=False)
    run = ["pipeline", "run", str(script), "-o", str(tmp_path / "o.jsonl"), "--model", "tiny",
           "--api", server.url]
    revoked = make_key("gone")
    KeyStore(engine).revoke(revoked[4:16])
    for extra, line in (
            ([], "the HTTP API needs a key: --api-key or $KVBATCH_API_KEY (kvbatch keys "
                 "create NAME makes one)"),
            (["--api-key", revoked], "the HTTP API: HTTP 401: Incorrect API key provided "
                                     "(unknown or revoked).")):
        assert main([*run, *extra]) == 1
        assert capsys.readouterr().err.splitlines() == [f"kvbatch pipeline: {line}"]
    assert _jobs(engine) == []
