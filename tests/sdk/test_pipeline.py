"""Dataset pipelines through a real worker on the tiny model: rows fan out, are filtered and
flow between stages without a barrier; a rerun (after a kill too) runs only what is missing;
a row whose output does not parse is retried, then fails alone."""

from __future__ import annotations

import json
import re
import runpy
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import datasets
import jsonschema
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
from datasets import Dataset
from pipeline_qa import KEEP_AT_LEAST, Questions, Score, build
from pydantic import ValidationError
from services import SOAK

from jobs import Pipeline
from jobs.constants import DEFAULT_MODEL
from jobs.pipeline_output import ParquetSink, arrow_table
from jobs.pipeline_run import PipelineResult, StageSummary
from jobs.sdk import Client
from worker.cli import main

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "pipelines.md"
EXAMPLE = REPO / "examples" / "qa_pipeline.py"
N = 8  # source rows, of widths 1, 2, 0, 1, 2, 0, 1, 2


def _jobs(client: Client, pipeline: str) -> dict[str, list[sa.Row]]:
    """The pipeline's jobs by stage (from their batch ids)."""
    with client.jobs.engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT id, batch_id, custom_id, attempts, created_at, started_at, finished_at, "
            "metadata, spec "
            "FROM jobs WHERE batch_id LIKE :p"), {"p": f"{pipeline}.%"}).all()
    by_stage: dict[str, list[sa.Row]] = {}
    for row in rows:
        by_stage.setdefault(row.batch_id.split(".")[1], []).append(row)
    return by_stage


def _sorted(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: json.dumps(r, sort_keys=True))


def _lines(path: Path) -> list[dict]:
    return _sorted([json.loads(x) for x in path.read_text().splitlines()])


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)


def _parquet_rows(path: Path) -> list[dict]:
    """The rows of a Parquet output as ``datasets`` loads them, by key."""
    loaded = Dataset.from_parquet(str(path), cache_dir=str(path.parent / "hf-cache"))
    assert isinstance(loaded, Dataset)
    return sorted(loaded, key=lambda r: r["_key"])


def _texts(client: Client, rows: list[sa.Row]) -> list[str]:
    return [i.result.text for i in client.jobs.get_many([r.id for r in rows]) if i.result]


def test_three_stages_fan_out_filter_and_stream(client: Client, start_worker,  # type: ignore[no-untyped-def]
                                                tmp_path: Path) -> None:
    start_worker(max_num_seqs=1)  # stage 1 runs a row at a time: stage 2 can start early
    pipeline = build("qa", N)
    result = pipeline.run(client, output=tmp_path / "out.jsonl", timeout_s=120)
    jobs = _jobs(client, "qa")
    summary = result.summary
    assert not result.failed and len(jobs["questions"]) == summary["questions"].rows_in == N
    # the rows expected from what stage 1 stored: each question `width` times
    first = pipeline.stages[0]
    source = {first.row_key("", row, 0): row for row in pipeline.rows["questions"]}
    expected = {(source[i.custom_id]["topic"], f"{x} #{k}")
                for i in client.jobs.get_many([r.id for r in jobs["questions"]])
                for x in Questions.model_validate_json(i.result.text).items
                for k in range(source[i.custom_id]["width"])}
    assert summary["answers"].rows_in == len(jobs["answers"]) == len(expected)
    assert any(q.endswith("#1") for _, q in expected)  # a row fanned out in two
    low = sum(Score.model_validate_json(t).score < KEEP_AT_LEAST
              for t in _texts(client, jobs["judge"]))
    kept = {(t, q) for t, q in expected if not q.endswith("#1")}
    assert {(r["topic"], r["question"]) for r in result.rows} <= kept
    assert len(result.rows) == summary["judge"].rows_out == len(kept) - low
    assert summary["judge"].filtered == len(expected) - len(result.rows) > 0
    for row in result.rows:
        assert isinstance(row["answers"], str) and isinstance(row["judge"], Score)
        assert row["judge"].score >= KEEP_AT_LEAST and set(row) == {
            "topic", "question", "answers", "judge"}
    lines = _lines(tmp_path / "out.jsonl")
    assert sorted((x["topic"], x["question"], x["judge"]["score"]) for x in lines) == sorted(
        (r["topic"], r["question"], r["judge"].score) for r in result.rows)
    # lineage in SQL: each judge job's parent is an answers row, each of those a questions row
    keys = {s: {r.metadata["key"]: r.metadata["parent"] for r in rows}
            for s, rows in jobs.items()}
    for line in lines:
        lin = line["_lineage"]
        assert keys["judge"][lin["judge"]] == lin["answers"]
        assert keys["answers"][lin["answers"]] == lin["questions"]
    # cost: a stage's GPU-seconds are those its jobs stored, each job's a share of the steps
    # it ran in, so no more than the time from its first step to its end
    for stage, rows in jobs.items():
        stats = [i.stats for i in client.jobs.get_many([r.id for r in rows])]
        assert all(s is not None and 0 < s.gpu_s < s.e2e_s - s.queue_wait_s for s in stats)
        assert summary[stage].gpu_s == pytest.approx(sum(s.gpu_s for s in stats))
    # That stage 2 starts before stage 1 ends is shown on 30 rows by the killed-driver test:
    # with 8 rows a fast worker may finish stage 1 between two polls of the driver.


def _script(tmp_path: Path, name: str, n: int) -> Path:
    """What `kvbatch pipeline run` takes: a file with a module-level pipeline."""
    script = tmp_path / "qa.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                      f"from pipeline_qa import build\npipeline = build({name!r}, {n})\n")
    return script


def _count(client: Client, pipeline: str) -> dict[str, int]:
    return {stage: len(rows) for stage, rows in _jobs(client, pipeline).items()}


def _other_judge(row: dict) -> str:
    return f"Score this answer 0-9: {row['answers']}"


def test_a_rerun_submits_nothing_and_a_changed_stage_reruns_alone(  # type: ignore[no-untyped-def]
        client: Client, start_worker, tmp_path: Path) -> None:
    start_worker()
    first = build("qa", N).run(client, output=tmp_path / "1.jsonl", timeout_s=120)
    counts = _count(client, "qa")
    again = build("qa", N).run(client, output=tmp_path / "2.parquet", timeout_s=30)
    assert _count(client, "qa") == counts  # nothing submitted again
    # the same rows from the stored results, as Parquet that `datasets` opens, and in memory
    lines = _lines(tmp_path / "1.jsonl")
    assert _sorted(_parquet_rows(tmp_path / "2.parquet")) == lines != []
    assert _sorted(list(again.dataset())) == lines
    assert again.dataset().features["judge"]["score"].dtype == "int64"  # a struct, not text
    assert again.summary == first.summary
    # the lineage columns are the keys of each row's jobs in SQL
    judge = {r.metadata["key"]: r.metadata["parent"] for r in _jobs(client, "qa")["judge"]}
    answers = {r.metadata["key"]: r.metadata["parent"] for r in _jobs(client, "qa")["answers"]}
    for line in lines:
        assert line["_stage"] == "judge" and line["_lineage"]["judge"] == line["_key"]
        assert judge[line["_key"]] == line["_parent"] == line["_lineage"]["answers"]
        assert answers[line["_parent"]] == line["_lineage"]["questions"]
    # a new judge prompt: a new judge batch; the questions and answers are those stored
    changed = build("qa", N, judge=_other_judge)
    changed.run(client, output=tmp_path / "3.jsonl", timeout_s=120)
    jobs = _jobs(client, "qa")
    assert {s: len(r) for s, r in jobs.items() if s != "judge"} == {
        s: n for s, n in counts.items() if s != "judge"}
    judges = {r.batch_id for r in jobs["judge"]}
    assert len(judges) == 2 and changed.stages[2].batch_id in judges
    assert len(jobs["judge"]) == 2 * counts["judge"]
    parents = {b: sorted(r.metadata["parent"] for r in jobs["judge"] if r.batch_id == b)
               for b in judges}  # the new judge ran on the answers rows stored
    assert len(set(map(tuple, parents.values()))) == 1


def _finished(client: Client, pipeline: str, stage: str) -> int:
    with client.jobs.engine.connect() as conn:
        return conn.execute(sa.text(
            "SELECT count(*) FROM jobs WHERE batch_id LIKE :b AND finished_at IS NOT NULL"),
            {"b": f"{pipeline}.{stage}.%"}).scalar_one()


FULL_SIZE = pytest.param(2000, 32, marks=[pytest.mark.slow, pytest.mark.skipif(
    not SOAK, reason="2,000 rows take 200 s: KVBATCH_SOAK=1")])


@pytest.mark.parametrize(("n", "seqs"), [(30, 4), FULL_SIZE])
def test_a_driver_killed_in_stage_2_resumes_to_the_rows_of_an_uninterrupted_run(  # type: ignore[no-untyped-def]
        client: Client, start_worker, tmp_path: Path, cli_env: dict[str, str],
        cli_args: list[str], capsys: pytest.CaptureFixture[str], n: int, seqs: int) -> None:
    """``n`` source rows (2,000 with ``KVBATCH_SOAK=1``: its figures are in bench/RESULTS.md)."""
    # batch-invariant: a job's tokens do not depend on what shares its steps, so two runs give
    # the same outputs at temperature 0 while `seqs` rows run at once
    start_worker(max_num_seqs=seqs, waiting_buffer=seqs, batch_invariant=True)
    clock = time.monotonic()
    build("fresh", n).run(client, output=tmp_path / "fresh.jsonl", timeout_s=1800)
    fresh_s, want = time.monotonic() - clock, _count(client, "fresh")
    # no barrier: stage 2 started long before stage 1 finished
    jobs = _jobs(client, "fresh")
    first_answer = min(r.started_at for r in jobs["answers"])
    last_question = max(r.finished_at for r in jobs["questions"])
    assert first_answer < last_question
    # the same pipeline through `kvbatch pipeline run`, SIGKILLed in the middle of stage 2
    run = ["pipeline", "run", str(_script(tmp_path, "killed", n)), "-o",
           str(tmp_path / "killed.jsonl"), "--model", "tiny", "--no-progress"]
    driver = subprocess.Popen([sys.executable, "-m", "worker.cli", *run], env=cli_env)
    deadline = time.monotonic() + 1800
    while (done := _finished(client, "killed", "answers")) < want["answers"] // 3:
        assert driver.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    killed_at = _count(client, "killed")
    assert 0 < done < want["answers"] and killed_at.get("judge", 0) < want["judge"]
    clock = time.monotonic()
    assert main([*run, *cli_args]) == 0
    resume_s = time.monotonic() - clock
    assert _lines(tmp_path / "killed.jsonl") == _lines(tmp_path / "fresh.jsonl") != []
    # nothing ran twice: every stage has the uninterrupted run's jobs, each delivered once
    assert _count(client, "killed") == want
    questions = _jobs(client, "killed")["questions"]
    assert len({r.custom_id for r in questions}) == n and {r.attempts for r in questions} == {1}
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in table[1:]] == [
        [stage, str(count)] for stage, count in want.items()]  # in: every row, no retry
    # a new judge prompt: the judge stage alone runs again, on the answers stored
    build("killed", n, judge=_other_judge).run(client, output=tmp_path / "judged.jsonl",
                                               timeout_s=1800)
    assert _count(client, "killed") == {**want, "judge": 2 * want["judge"]}
    print(f"\n{n} source rows, jobs by stage {want}; uninterrupted {fresh_s:.1f} s; first "
          f"answers job started {(last_question - first_answer).total_seconds():.1f} s before "
          f"the last questions job finished; killed at {done} answers done, {killed_at}; "
          f"resumed in {resume_s:.1f} s", file=sys.stderr)


def test_a_row_that_does_not_parse_is_retried_then_fails_alone_as_one_whose_keep_raises(  # type: ignore[no-untyped-def]
        client: Client, start_worker, tmp_path: Path) -> None:
    start_worker()

    def parse(row: dict, text: str) -> str:
        if row["i"] == 2:
            raise ValueError("not a number")
        return text.upper()

    p = Pipeline("flaky")
    p.stage("gen", source=[{"i": i} for i in range(5)], prompt=lambda r: f"say {r['i']}",
            parse=parse, retries=2, max_tokens=4, temperature=0.0, seed=11,
            keep=lambda r: 1 / (r["i"] - 4) < 0)  # raises on row 4
    result = p.run(client, output=tmp_path / "out.jsonl", errors=tmp_path / "err.jsonl",
                   timeout_s=60)
    assert sorted(r["i"] for r in result.rows) == [0, 1, 3]
    assert all(r["gen"] == r["gen"].upper() for r in result.rows)
    failures = [json.loads(x) for x in (tmp_path / "err.jsonl").read_text().splitlines()]
    assert sorted((f["row"]["i"], f["error"]) for f in failures) == [
        (2, "parse: not a number"),
        (4, "keep or explode: ZeroDivisionError('division by zero')")]
    summary = result.summary["gen"]
    assert (summary.rows_in, summary.rows_out, summary.failed, summary.retried) == (5, 3, 2, 2)
    jobs = _jobs(client, "flaky")["gen"]
    unparsed = next(f["key"] for f in failures if f["row"]["i"] == 2)
    tries = sorted((r.metadata["attempt"], r.spec["sampling"]["seed"]) for r in jobs
                   if r.metadata["key"] == unparsed)
    assert tries == [(0, 11), (1, 12), (2, 13)] and len(jobs) == 7  # another seed each try


def test_n_samples_make_a_list_and_a_json_schema_a_dict(  # type: ignore[no-untyped-def]
        client: Client, start_worker) -> None:
    start_worker()
    p = Pipeline("many")
    gen = p.stage("gen", source=[{"i": 0}], prompt=lambda r: "hello", n=3, max_tokens=5,
                  temperature=0.0)
    p.stage("check", source=gen, prompt=lambda r: f"is it ok? {r['gen'][0]}", max_tokens=20,
            temperature=0.0, response_format={
                "type": "object", "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"], "additionalProperties": False})
    result = p.run(client, timeout_s=60)
    assert not result.failed
    (row,) = result.rows
    assert isinstance(row["gen"], list) and len(row["gen"]) == 3 and len(set(row["gen"])) == 1
    assert set(row["check"]) == {"ok"} and isinstance(row["check"]["ok"], bool)


def _run_example(services: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                 tmp_path: Path) -> dict:
    """``python examples/qa_pipeline.py`` in ``tmp_path`` on the test's services: its
    globals."""
    for name, value in services.items():
        monkeypatch.setenv(f"KVBATCH_{name.upper()}", value)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.chdir(tmp_path)
    return runpy.run_path(str(EXAMPLE), run_name="__main__")


def test_the_example_runs_as_a_script_and_as_the_command(  # type: ignore[no-untyped-def]
        services: dict[str, str], client: Client, start_worker,
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cli_args: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    assert _python_blocks()[0] == EXAMPLE.read_text()  # the docs show the file as it is
    start_worker(served_model_name=DEFAULT_MODEL)  # the tiny model, under the default name
    scope = _run_example(services, monkeypatch, tmp_path)
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in table] == ["stage", "questions", "answers", "judge"]
    result, summary = scope["result"], scope["result"].summary
    assert summary["questions"].rows_in == 3 and not result.failed
    infos = {stage: client.jobs.get_many([r.id for r in rows])
             for stage, rows in _jobs(client, "qa-v1").items()}
    assert summary["answers"].rows_in == sum(
        len(scope["questions"].value({}, i.result.text).items) for i in infos["questions"])
    assert summary["judge"].rows_in == summary["answers"].rows_out == summary["answers"].rows_in
    # keep: exactly the rows whose judge job scored 4 or more
    scores = {i.metadata["key"]: scope["judge"].value({}, i.result.text).score
              for i in infos["judge"]}
    assert sorted(r["_key"] for r in result.records()) == sorted(
        k for k, score in scores.items() if score >= 4)
    assert summary["judge"].filtered == sum(score < 4 for score in scores.values())
    assert pq.read_table(tmp_path / "qa.parquet").to_pylist() == result.records()
    # the same file through `kvbatch pipeline run`: the same stages, nothing runs again
    counts = _count(client, "qa-v1")
    assert main(["pipeline", "run", str(EXAMPLE), "-o", "again.parquet", "--no-progress",
                 *cli_args]) == 0
    assert _count(client, "qa-v1") == counts
    assert pq.read_table(tmp_path / "again.parquet").num_rows == len(result.rows)


@pytest.mark.slow
def test_the_example_on_the_real_model_keeps_rows_that_validate_and_loads_as_a_dataset(  # type: ignore[no-untyped-def]
        services: dict[str, str], start_worker, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    start_worker(model=DEFAULT_MODEL, served_model_name=DEFAULT_MODEL, num_kv_blocks=512)
    scope = _run_example(services, monkeypatch, tmp_path)
    result, summary = scope["result"], scope["result"].summary
    with capsys.disabled():  # the figures docs/pipelines.md quotes (pytest -s)
        print(f"\n{result.table()}")
    assert summary["questions"].rows_out == 3 and summary["judge"].rows_out == len(result.rows)
    assert result.rows, result.table()
    for row in result.rows:  # every kept row validates against its formats
        assert isinstance(row["judge"], scope["Score"])
        assert scope["Score"].model_validate(row["judge"].model_dump()).score >= 4
        assert 0 < len(row["question"]) <= 60 and row["answers"].strip()
    # the answers share their system prompt: the prefix cache serves part of their prompts
    assert summary["answers"].cached_prompt_tokens > 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[-2:] == ["cache", "hit"]
    assert table[2].split()[-1] == f"{summary['answers'].prefix_cache_hit_rate:.0%}"
    # the docs' loading block opens the Parquet file the example wrote
    (load,) = (b for b in _python_blocks() if "from_parquet" in b)
    exec(load, loaded := {})
    assert sorted(loaded["qa"], key=lambda r: r["_key"]) == sorted(
        result.records(), key=lambda r: r["_key"])


def test_a_record_with_a_raw_control_character_parses_and_is_still_checked() -> None:
    p = Pipeline("records")
    model = p.stage("model", source=[], prompt=str, response_format=Questions)
    schema = p.stage("schema", source=[], prompt=str, response_format={
        "type": "object", "properties": {"items": {"type": "array", "maxItems": 1}}})
    raw = '{"items": ["why\tnot\x18"]}'  # a tab and U+0018 unescaped in the string
    with pytest.raises(ValidationError, match="literal_error"):  # not a question word
        model.value({}, raw)
    assert model.value({}, '{"items": ["how",\t"when"]}').items == ["how", "when"]
    assert schema.value({}, raw) == {"items": ["why\tnot\x18"]}
    with pytest.raises(ValidationError, match="json_invalid"):  # still not JSON
        model.value({}, '{"items": ["how"')
    with pytest.raises(jsonschema.ValidationError, match="is too long"):
        schema.value({}, '{"items": ["a\x01", "b"]}')


def test_the_command_says_in_one_line_what_is_wrong_with_the_file(  # type: ignore[no-untyped-def]
        tmp_path: Path, cli_args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "nothing.py"
    script.write_text("pipelines = []\n")
    missing = tmp_path / "missing.py"
    for path, line in ((missing, f"no pipeline file {missing}"),
                       (script, f"{script} defines no module-level `pipeline` (a jobs.Pipeline)")):
        assert main(["pipeline", "run", str(path), "-o", str(tmp_path / "o.jsonl"),
                     *cli_args]) == 1
        assert capsys.readouterr().err.splitlines() == [f"kvbatch pipeline: {line}"]
    assert not (tmp_path / "o.jsonl").exists()


def test_parquet_columns_are_every_rows_fields_and_a_field_of_two_types_is_named(
        tmp_path: Path) -> None:
    table = arrow_table([{"a": 1, "r": {"x": 1}}, {"b": "t", "r": {"y": 2.5}}])
    assert table.column_names == ["a", "r", "b"]
    assert table.to_pylist() == [{"a": 1, "r": {"x": 1, "y": None}, "b": None},
                                 {"a": None, "r": {"x": None, "y": 2.5}, "b": "t"}]
    with pytest.raises(ValueError, match="field 'a' has values of no one type"):
        arrow_table([{"a": 1}, {"a": "x"}])
    assert arrow_table([]).column_names == ["_stage", "_key", "_parent"]
    stopped = ParquetSink(tmp_path / "out.parquet")
    stopped.write({"a": 1})
    stopped.close(finished=False)  # a run that did not reach its end writes no file
    assert list(tmp_path.iterdir()) == []


def test_a_run_that_does_not_reach_its_end_writes_no_parquet_file(client: Client,
                                                                   tmp_path: Path) -> None:
    p = Pipeline("unfinished")  # no worker runs: its jobs wait
    p.stage("gen", source=[{"i": 0}], prompt=lambda r: "hi", max_tokens=2)
    with pytest.raises(TimeoutError, match="1 jobs not finished"):
        p.run(client, output=tmp_path / "out.parquet", errors=tmp_path / "err.jsonl",
              timeout_s=0.5)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["err.jsonl"]  # JSONL as it went


def test_the_summary_table_shows_each_stage_and_when_it_was_active() -> None:
    at = datetime(2026, 1, 1, 12, tzinfo=UTC)
    result = PipelineResult(summary={
        "gen": StageSummary(rows_in=4, rows_out=3, failed=1, prompt_tokens=80,
                            cached_prompt_tokens=20, generated_tokens=12, gpu_s=1.234,
                            started_at=at + timedelta(seconds=1),
                            finished_at=at + timedelta(seconds=9.25)),
        "judge": StageSummary(rows_in=3, rows_out=1, filtered=2, retried=1, prompt_tokens=30,
                              started_at=at + timedelta(seconds=2.5),
                              finished_at=at + timedelta(seconds=12)),
        "idle": StageSummary()})
    assert [line.split() for line in result.table().splitlines()] == [
        ["stage", "in", "out", "filtered", "failed", "retried", "prompt", "generated",
         "GPU", "s", "active", "s", "cache", "hit"],
        ["gen", "4", "3", "0", "1", "0", "80", "12", "1.23", "0.0-8.2", "25%"],
        ["judge", "3", "1", "2", "0", "1", "30", "0", "0.00", "1.5-11.0", "0%"],
        ["idle", "0", "0", "0", "0", "0", "0", "0", "0.00", "-", "0%"]]


def test_a_bad_stage_is_refused_when_it_is_defined() -> None:
    p = Pipeline("checks")
    first = p.stage("first", source=[], prompt=str)
    with pytest.raises(ValidationError, match="temperature"):
        p.stage("hot", source=first, prompt=str, temperature=-1.0)
    with pytest.raises(ValidationError, match="temprature"):
        p.stage("typo", source=first, prompt=str, temprature=0.5)
    with pytest.raises(ValueError, match="be new"):
        p.stage("first", source=first, prompt=str)
    with pytest.raises(ValueError, match="must match"):  # it would be a lineage column
        p.stage("_key", source=first, prompt=str)
    with pytest.raises(ValueError, match="not a stage of pipeline 'other'"):
        Pipeline("other").stage("second", source=first, prompt=str)
    with pytest.raises(ValueError, match="must match"):
        Pipeline("no spaces")
    assert [s.name for s in p.stages] == ["first"]  # nothing refused was added


def test_an_interrupted_command_says_how_to_resume(  # type: ignore[no-untyped-def]
        client: Client, tmp_path: Path, cli_env: dict[str, str]) -> None:
    script = _script(tmp_path, "stopped", 2)  # no worker runs: it waits on its first stage
    # The driver starts with SIGINT at its default, as a command in a terminal's foreground
    # does: a run launched in the background (`cmd &` in a script) inherits SIGINT ignored,
    # and Python then installs no KeyboardInterrupt for it, so the driver never stopped (its
    # stacks showed the main thread waiting in Client._drive). PYTHONFAULTHANDLER: a driver
    # that does not exit is aborted and prints its threads' stacks.
    driver = subprocess.Popen([sys.executable, "-m", "worker.cli", "pipeline", "run",
                               str(script), "-o", str(tmp_path / "o.jsonl"), "--model", "tiny"],
                              env={**cli_env, "PYTHONFAULTHANDLER": "1"},
                              stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not _jobs(client, "stopped").get("questions"):
        assert driver.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    driver.send_signal(signal.SIGINT)
    try:
        _, err = driver.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        driver.send_signal(signal.SIGABRT)
        _, err = driver.communicate(timeout=30)
        pytest.fail(f"the driver did not exit within 30 s of SIGINT; its stderr:\n{err}")
    assert driver.returncode == 130, err
    assert err.splitlines()[-1] == ("interrupted: the jobs keep running; run the same command "
                                    "again to resume")
    assert _count(client, "stopped") == {"questions": 2}
