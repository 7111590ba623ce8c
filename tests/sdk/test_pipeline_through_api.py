"""A dataset pipeline through the HTTP API (a real ``kvbatch serve`` on 127.0.0.1, an API key,
``RemoteClient``) and a real worker on the tiny model: the same output rows as through the
SDK's ``Client``; the rows the key's (another key neither follows nor resumes them, and runs
its own); a driver killed in stage 2 and started again through the API runs no row twice."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from api_server import ApiServer
from pipeline_qa import build

from jobs import RemoteClient
from jobs.api.keys import KeyStore
from jobs.pipeline_run import StageSummary
from jobs.remote import RemoteError
from jobs.sdk import Client
from worker.cli import main

N = 8  # source rows: 3 stages, fan-out and a filter (tests/sdk/pipeline_qa.py)
KILLED_N = 16


@pytest.fixture
def server(services: dict[str, str], tmp_path: Path) -> Iterator[ApiServer]:
    server = ApiServer(services, tmp_path / "files", tmp_path / "api.log")
    yield server.start()
    server.stop()


@pytest.fixture
def make_key(services: dict[str, str]) -> Iterator[Callable[[str], str]]:
    engine = sa.create_engine(services["database_url"])
    yield lambda name: KeyStore(engine).create(name)[1]
    engine.dispose()


def _key_id(key: str) -> str:
    return key[len("kvb-"):len("kvb-") + 12]


def _jobs(client: Client, pipeline: str, owner: str | None = None) -> dict[str, list[sa.Row]]:
    """The jobs of ``pipeline`` by stage (from their batch ids: ``<owner>:`` first for a key's
    batches), each with its batch's tenant."""
    prefix = f"{owner}:" if owner else ""
    with client.jobs.engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT j.id, j.batch_id, j.custom_id, j.attempts, b.owner FROM jobs j "
            "JOIN batches b ON b.id = j.batch_id WHERE j.batch_id LIKE :p"),
            {"p": f"{prefix}{pipeline}.%"}).all()
    by_stage: dict[str, list[sa.Row]] = {}
    for row in rows:
        by_stage.setdefault(row.batch_id[len(prefix):].split(".")[1], []).append(row)
    return by_stage


def _count(client: Client, pipeline: str, owner: str | None = None) -> dict[str, int]:
    return {stage: len(rows) for stage, rows in _jobs(client, pipeline, owner).items()}


def _total(client: Client) -> int:
    with client.jobs.engine.connect() as conn:
        return conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar_one()


def _lines(path: Path) -> list[dict]:
    return sorted((json.loads(x) for x in path.read_text().splitlines()),
                  key=lambda r: json.dumps(r, sort_keys=True))


def _figures(summary: StageSummary) -> tuple[int, ...]:
    """A stage's counts and tokens: the same for the same rows whatever ran them."""
    return (summary.rows_in, summary.rows_out, summary.filtered, summary.failed,
            summary.retried, summary.prompt_tokens, summary.generated_tokens)


def test_a_pipeline_through_the_api_gives_the_rows_of_the_direct_client_as_the_keys_own(  # type: ignore[no-untyped-def]
        client: Client, start_worker, server: ApiServer, make_key: Callable[[str], str],
        tmp_path: Path) -> None:
    # batch-invariant: a job's tokens do not depend on what shares its steps
    start_worker(max_num_seqs=4, waiting_buffer=4, batch_invariant=True)
    direct = build("qa", N).run(client, output=tmp_path / "direct.jsonl", timeout_s=180)
    key = make_key("team-a")
    remote = RemoteClient(server.url, key, model="tiny")
    api = build("qa", N).run(remote, output=tmp_path / "api.jsonl", timeout_s=180)
    # the same rows, lineage keys included (a row's key is its content's, not the tenant's)
    assert _lines(tmp_path / "api.jsonl") == _lines(tmp_path / "direct.jsonl") != []
    assert {s: _figures(v) for s, v in api.summary.items()} == {
        s: _figures(v) for s, v in direct.summary.items()}
    assert not api.failed and api.summary["judge"].filtered > 0
    # its jobs: in batches `<key id>:<stage batch>` of the key's tenant, as many as the direct
    owner = _key_id(key)
    jobs = _jobs(client, "qa", owner)
    assert {s: len(r) for s, r in jobs.items()} == _count(client, "qa") == {
        s: v.rows_in for s, v in direct.summary.items()}
    assert {r.owner for rows in jobs.values() for r in rows} == {owner}
    assert {r.owner for rows in _jobs(client, "qa").values() for r in rows} == {None}
    # cost: each stage's GPU-seconds are those its jobs stored
    for stage, rows in jobs.items():
        stats = [i.stats for i in client.jobs.get_many([r.id for r in rows])]
        assert all(s is not None and s.gpu_s > 0 for s in stats)
        assert api.summary[stage].gpu_s == pytest.approx(sum(s.gpu_s for s in stats))
    # run again through the API: nothing is submitted, the same rows from what is stored
    again = build("qa", N).run(remote, output=tmp_path / "again.jsonl", timeout_s=60)
    assert _count(client, "qa", owner) == {s: len(r) for s, r in jobs.items()}
    assert _lines(tmp_path / "again.jsonl") == _lines(tmp_path / "api.jsonl")
    assert again.summary == api.summary
    # another key: the first key's jobs are not its own to follow, its run is its own
    other_key = make_key("team-b")
    other = RemoteClient(server.url, other_key, model="tiny")
    first_ids = [r.id for r in jobs["questions"]]
    with pytest.raises(KeyError, match=f"{len(first_ids)} jobs are not this key's"):
        next(iter(other.follow_jobs(first_ids, timeout_s=5)))
    assert list(remote.follow_jobs(first_ids, timeout_s=5))  # the first key's are
    build("qa", N).run(other, output=tmp_path / "other.jsonl", timeout_s=180)
    theirs = _jobs(client, "qa", _key_id(other_key))
    assert {s: len(r) for s, r in theirs.items()} == {s: len(r) for s, r in jobs.items()}
    assert not {r.id for rs in theirs.values() for r in rs} & {r.id for rs in jobs.values()
                                                               for r in rs}
    assert {r.owner for rows in theirs.values() for r in rows} == {_key_id(other_key)}
    assert _lines(tmp_path / "other.jsonl") == _lines(tmp_path / "api.jsonl")
    # no key, a wrong key: refused, nothing stored
    before = _total(client)
    for bad in ("kvb-000000000000nope", key[:-1] + ("x" if key[-1] != "x" else "y")):
        with pytest.raises(RemoteError, match="Incorrect API key") as refused:
            build("qa", N).run(RemoteClient(server.url, bad, model="tiny"), timeout_s=10)
        assert refused.value.status == 401
    assert _total(client) == before


def _script(tmp_path: Path, name: str, n: int) -> Path:
    script = tmp_path / "qa.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                      f"from pipeline_qa import build\npipeline = build({name!r}, {n})\n")
    return script


def _finished(client: Client, batch_prefix: str) -> int:
    with client.jobs.engine.connect() as conn:
        return conn.execute(sa.text(
            "SELECT count(*) FROM jobs WHERE batch_id LIKE :b AND finished_at IS NOT NULL"),
            {"b": f"{batch_prefix}%"}).scalar_one()


def test_a_driver_killed_through_the_api_resumes_without_running_a_row_twice(  # type: ignore[no-untyped-def]
        client: Client, start_worker, server: ApiServer, make_key: Callable[[str], str],
        tmp_path: Path, cli_env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    start_worker(max_num_seqs=2, waiting_buffer=2, batch_invariant=True)
    key = make_key("team")
    owner = _key_id(key)
    remote = RemoteClient(server.url, key, model="tiny")
    build("fresh", KILLED_N).run(remote, output=tmp_path / "fresh.jsonl", timeout_s=600)
    want = _count(client, "fresh", owner)
    # `kvbatch pipeline run --api`, its key in the environment, SIGKILLed in stage 2
    run = ["pipeline", "run", str(_script(tmp_path, "killed", KILLED_N)), "-o",
           str(tmp_path / "killed.jsonl"), "--model", "tiny", "--no-progress", "--api",
           server.url]
    env = {k: v for k, v in cli_env.items() if not k.startswith("KVBATCH_") or k in (
        "KVBATCH_TEST_REDIS_URL", "KVBATCH_TEST_PG_URL")}  # the API alone: no Redis, no SQL
    driver = subprocess.Popen([sys.executable, "-m", "worker.cli", *run],
                              env={**env, "KVBATCH_API_KEY": key})
    deadline = time.monotonic() + 600
    while (done := _finished(client, f"{owner}:killed.answers.")) < want["answers"] // 3:
        assert driver.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    killed_at = _count(client, "killed", owner)
    assert 0 < done < want["answers"] and killed_at.get("judge", 0) < want["judge"]
    assert main([*run, "--api-key", key]) == 0
    assert _lines(tmp_path / "killed.jsonl") == _lines(tmp_path / "fresh.jsonl") != []
    # nothing ran twice: the uninterrupted run's jobs by stage, each stage-1 row once
    assert _count(client, "killed", owner) == want
    questions = _jobs(client, "killed", owner)["questions"]
    assert len({r.custom_id for r in questions}) == len(questions) == KILLED_N
    assert {r.attempts for r in questions} == {1}
    table = capsys.readouterr().out.splitlines()  # in: every row, no retry
    assert [line.split()[:2] for line in table[1:]] == [
        [stage, str(want[stage])] for stage in ("questions", "answers", "judge")]
