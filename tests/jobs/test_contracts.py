"""Each contract that travels is declared once; these tests fail when a field, a status or a
setting is added in one place only."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time

import pytest
import sqlalchemy as sa
from services import all_roles_store
from sqlalchemy import text

from engine.config import EngineConfig
from jobs.models import Base, status_check
from jobs.schemas import (
    BatchStatus,
    JobResult,
    JobSpec,
    JobStats,
    JobStatus,
    Outcome,
    is_bytes,
)
from jobs.tables import JOB_COLUMNS, format_job_rows
from worker.settings import ENGINE_FIELDS, add_settings_arguments, settings_from_args

SQL = all_roles_store()
STATS = list(JobStats.model_fields)


def _distinct_stats() -> JobStats:
    """Every field set, each to a value of its own (none is a default)."""
    values = {}
    for i, (name, field) in enumerate(JobStats.model_fields.items(), start=1):
        if field.annotation is not int:
            values[name] = i + 0.25
        else:  # byte counts past 32 bits: their columns must be 64-bit
            values[name] = (1 << 33) + i if is_bytes(name) else i
    return JobStats(**values)


def test_stats_row_reaches_sql_and_back_field_for_field(sql_engine: sa.Engine) -> None:
    insp = sa.inspect(sql_engine)
    # The migrated table and view carry JobStats' fields, in its order.
    assert [c["name"] for c in insp.get_columns("job_metrics")] == ["job_id", *STATS]
    view = [c["name"] for c in insp.get_columns("job_stats")]
    assert [c for c in view if c in STATS] == STATS
    assert [c.name for c in Base.metadata.tables["job_metrics"].columns] == ["job_id", *STATS]

    store = SQL(sql_engine)
    spec = JobSpec(model="m", prompt="p", custom_id="row-1", batch_id="b")
    store.insert_jobs([spec])
    stats = _distinct_stats()
    store.finish([Outcome(spec.id, JobStatus.SUCCEEDED, time.time(), result=JobResult(),
                          stats=stats)])
    info = store.get(spec.id)
    assert info is not None and info.stats == stats  # written and read back, every field
    (row,) = store.job_stats_rows(batch_id="b")
    assert list(row) == ["job_id", "custom_id", "status", *STATS, "worker_id", "created_at",
                         "finished_at"]
    assert {k: row[k] for k in STATS} == stats.model_dump()
    # The CLI table shows every field under its title.
    assert [k for k, _ in JOB_COLUMNS] == ["custom_id", "status", *STATS]
    table = format_job_rows([row])
    assert all((JobStats.model_fields[k].title or k) in table.splitlines()[0] for k in STATS)


def test_worker_reports_every_stats_field() -> None:
    """The engine's measurements fill every JobStats field: one added to JobStats without a
    source in ``engine_outcome`` fails here."""
    from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from worker.outcome import engine_outcome

    metrics = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5,
                             first_token_time=101.0, finish_time=103.0, num_prompt_tokens=7,
                             num_cached_tokens=3, num_generated_tokens=5, peak_kv_blocks=2,
                             peak_kv_bytes=4096, num_preemptions=1)
    out = RequestOutput("j", [1, 2], [CompletionOutput(0, [5, 6, 7, 8, 9], "hello", "stop")],
                        finished=True, metrics=metrics)
    spec = JobSpec(id="j", model="m", prompt="p", submitted_at=1000.0)
    outcome = engine_outcome(out, spec, admitted_at=1002.0, abort_as=None,
                             token_bytes={})
    assert outcome.stats is not None
    assert outcome.stats.model_fields_set == set(STATS)
    assert outcome.stats.ttft_s == pytest.approx(3.0)  # 2 s before the engine + 1 s in it
    assert outcome.stats.tpot_s == pytest.approx(0.5)


def test_statuses_are_the_databases(pg_engine: sa.Engine) -> None:
    with pg_engine.connect() as conn:
        checks = dict(conn.execute(text(
            "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conname IN ('ck_jobs_status', 'ck_batches_status')")).all())
    for name, statuses in (("ck_jobs_status", JobStatus), ("ck_batches_status", BatchStatus)):
        assert set(re.findall(r"'(\w+)'", checks[name])) == {s.value for s in statuses}
    jobs_check = next(c for c in Base.metadata.tables["jobs"].constraints
                      if c.name == "ck_jobs_status")
    assert str(jobs_check.sqltext) == status_check("status", JobStatus)


def _other_value(field: dataclasses.Field) -> tuple[list[str], object]:  # type: ignore[type-arg]
    """Flag arguments that set ``field`` to a value other than its default, and that value."""
    flag = "--" + field.name.replace("_", "-")
    choices = {"dtype": "bfloat16", "device": "cpu", "attention_backend": "torch",
               "model": "/models/other", "quantization": "int8"}
    if field.name in choices:
        return [flag, choices[field.name]], choices[field.name]
    if isinstance(field.default, tuple):  # a repeatable flag (--lora a=/x --lora b=/y)
        return [flag, "a=/x", flag, "b=/y"], ("a=/x", "b=/y")
    if isinstance(field.default, bool):
        return [flag if not field.default else "--no-" + flag[2:]], not field.default
    if isinstance(field.default, float):
        return [flag, "0.5"], 0.5
    # max_model_len stays within the step budget, as EngineConfig wants without chunked prefill
    value = 1024 if field.default is None else field.default + 3
    return [flag, str(value)], value


def test_a_worker_flag_and_variable_for_every_engine_field(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fields = dataclasses.fields(EngineConfig)
    assert tuple(f.name for f in fields) == ENGINE_FIELDS
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    help_text = " ".join(parser.format_help().split())
    for field in fields:
        args, value = _other_value(field)
        assert value != field.default
        settings = settings_from_args(parser.parse_args(args))
        assert getattr(settings.engine, field.name) == value, field.name
        # The engine's own default and help are what --help shows.
        assert f"{field.metadata['help']} (default: {field.default})" in help_text, field.name
    for field in fields:  # and each from the environment, as KVBATCH_<FIELD>
        args, value = _other_value(field)
        env = ("true" if value is True else "false" if value is False
               else json.dumps(value) if isinstance(value, tuple) else args[-1])
        monkeypatch.setenv(f"KVBATCH_{field.name.upper()}", env)
    engine = settings_from_args(parser.parse_args([])).engine
    assert all(getattr(engine, f.name) == _other_value(f)[1] for f in fields)
    assert settings_from_args(parser.parse_args(["--max-num-seqs", "7"])).engine.max_num_seqs == 7


def test_producer_side_and_command_line_never_load_torch() -> None:
    """``kvbatch submit`` and the SDK run on machines without torch; import-linter checks the
    import graph, this checks what Python actually loads."""
    import subprocess
    import sys

    code = ("import sys, jobs, jobs.sdk, jobs.aio, jobs.commands, jobs.demo, jobs.store, "
            "worker.cli; worker.cli.build_parser(); "
            "print(sorted(m for m in ('torch', 'triton', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
