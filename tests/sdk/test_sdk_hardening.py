"""Hardening at the SDK and command line: batches keep their owner's settings, batch ids are
unguessable, files are checked before they are touched, exports stay in their directory,
secrets are not printed, names cannot drive the terminal."""

from __future__ import annotations

import json
from argparse import Namespace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError
from services import REDIS_URL, all_roles_store
from sqlalchemy import text

from jobs.demo import worker_command
from jobs.schemas import JobSpec, JobStatus
from jobs.sdk import Client
from jobs.settings import mask_url, redact_urls
from worker.cli import main
from worker.control import batches

SQL = all_roles_store()
REPO = Path(__file__).resolve().parents[2]


def test_a_later_submission_cannot_take_over_a_batch(client: Client) -> None:
    deadline = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
    client.submit_batch([{"custom_id": "a", "prompt": "hi"}], batch_id="owned",
                        webhook_url="https://owner.example.com/hook", deadline=deadline)
    for takeover in ({"webhook_url": "https://attacker.example.com/hook"},
                     {"deadline": deadline + timedelta(days=1)}):
        with pytest.raises(ValueError, match="set by its first submission"):
            client.submit_batch([{"custom_id": "b", "prompt": "hi"}], batch_id="owned",
                                **takeover)
    # Resuming with the same settings is fine, and changes nothing.
    client.submit_batch([{"custom_id": "c", "prompt": "hi"}], batch_id="owned",
                        webhook_url="https://owner.example.com/hook", deadline=deadline)
    assert client.jobs.batch_settings("owned") == ("https://owner.example.com/hook", deadline)
    assert sorted(cid for _, cid, _ in client.jobs.batch_jobs("owned")) == ["a", "c"]
    with pytest.raises(ValueError, match="webhook URL contains spaces or control characters"):
        client.submit_batch([{"custom_id": "x", "prompt": "hi"}], batch_id="hooked",
                            webhook_url="gopher://x\nINJECT")
    assert client.jobs.batch_settings("hooked") is None  # nothing stored


def test_default_batch_ids_are_random_and_recorded_for_resume(
        tmp_path: Path, client: Client, cli_args: list[str], start_worker,  # type: ignore[no-untyped-def]
        capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "in.jsonl"
    data.write_text('{"custom_id": "r0", "prompt": "hi", "max_tokens": 2}\n')
    start_worker()
    recorded = []
    for name in ("a.jsonl", "a.jsonl", "b.jsonl"):
        capsys.readouterr()
        assert main(["submit", str(data), "-o", str(tmp_path / name), "--model", "tiny",
                     "--no-progress", *cli_args]) == 0
        batch_id = json.loads((tmp_path / f"{name}.batch").read_text())["batch_id"]
        assert capsys.readouterr().err.startswith(f"batch {batch_id}: 1 rows")
        recorded.append(batch_id)
    assert recorded[0] == recorded[1] != recorded[2]  # resumed; a new output, a new batch
    assert all(b.startswith("ds-") and len(b) == 3 + 32 for b in recorded)  # 128 random bits
    assert [cid for _, cid, _ in client.jobs.batch_jobs(recorded[0])] == ["r0"]  # ran once
    # Another dataset into the same output would take its results for its own: refused.
    other = tmp_path / "other.jsonl"
    other.write_text('{"custom_id": "r0", "prompt": "something else", "max_tokens": 2}\n')
    capsys.readouterr()
    assert main(["submit", str(other), "-o", str(tmp_path / "a.jsonl"), "--model", "tiny",
                 "--no-progress", *cli_args]) == 2
    assert "holds the results of" in capsys.readouterr().err


def test_outputs_without_a_record_resume_or_refuse(
        tmp_path: Path, client: Client, cli_args: list[str], start_worker,  # type: ignore[no-untyped-def]
        capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "in.jsonl"
    data.write_text('{"custom_id": "r0", "prompt": "hi", "max_tokens": 2}\n')
    out = tmp_path / "out.jsonl"
    # Results of another dataset, from a kvbatch that kept no record: refused, untouched.
    out.write_text('{"custom_id": "elsewhere", "text": "x"}\n')
    submit = ["submit", str(data), "-o", str(out), "--model", "tiny", "--no-progress",
              *cli_args]
    assert main(submit) == 2
    assert "holds results of rows this input does not have" in capsys.readouterr().err
    assert out.read_text() == '{"custom_id": "elsewhere", "text": "x"}\n'
    # A record holding the id alone (as kvbatch wrote it before) is resumed.
    out.unlink()
    (tmp_path / "out.jsonl.batch").write_text("ds-legacy\n")
    start_worker()
    assert main(submit) == 0
    assert [cid for _, cid, _ in client.jobs.batch_jobs("ds-legacy")] == ["r0"]


def test_a_refused_submission_leaves_no_file_behind(
        tmp_path: Path, client: Client, cli_args: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "in.jsonl"
    data.write_text('{"prompt": "fine"}\n{"prompt": "x", "temperature": -1}\n')
    assert main(["submit", str(data), "-o", str(tmp_path / "out.jsonl"), "--strict",
                 "--no-progress", *cli_args]) == 2
    assert "temperature must be >= 0.0" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
    assert client.jobs.count_by_status() == {}


def test_an_output_that_is_not_a_results_file_is_left_untouched(
        tmp_path: Path, cli_args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "in.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    for content in (b"my thesis, chapter 1\nno trailing newline", b"precious"):
        precious = tmp_path / "notes.txt"
        precious.write_bytes(content)
        assert main(["submit", str(data), "-o", str(precious), "--no-progress",
                     *cli_args]) == 2
        assert "not a kvbatch results file" in capsys.readouterr().err
        assert precious.read_bytes() == content


def test_exports_stay_in_their_directory(tmp_path: Path, client: Client) -> None:
    export_dir = tmp_path / "exports"
    SQL(client.jobs.engine).insert_jobs([JobSpec(model="tiny", prompt="x", batch_id="ok")])
    reader = SQL(client.jobs.engine)
    with pytest.raises(ValueError, match="outside"):
        batches.export_results(reader, "../../etc/cron.d/evil", str(export_dir))
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    export_dir.mkdir(exist_ok=True)
    (export_dir / "ok.jsonl.tmp").symlink_to(victim)  # planted where the export writes
    with pytest.raises(OSError):
        batches.export_results(reader, "ok", str(export_dir))
    assert victim.read_text() == "keep me"
    (export_dir / "ok.jsonl.tmp").unlink()
    path = batches.export_results(reader, "ok", str(export_dir))
    assert Path(path).parent == export_dir.resolve() and Path(path).read_text().count("\n") == 1


def test_secrets_are_masked_and_urls_redacted(client: Client) -> None:
    assert mask_url("postgresql://kv:hunter2@db:5432/kv") == "postgresql://kv:***@db:5432/kv"
    assert mask_url("redis://:s3cret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert mask_url("sqlite:///kvbatch.db") == "sqlite:///kvbatch.db"
    error = "URLError: <urlopen error https://u:tok@hooks.example.com/x?key=abc refused>"
    assert redact_urls(error) == "URLError: <urlopen error <url> refused>"
    # What the control plane stores for dashboards' readers holds no URL.
    store = SQL(client.jobs.engine)
    store.insert_jobs([JobSpec(model="tiny", prompt="x", batch_id="hooked")])
    store.record_webhook_attempt("hooked", 0.0, error, max_attempts=3, retry_in_s=1.0)
    with client.jobs.engine.connect() as conn:
        stored = conn.execute(text("SELECT webhook_error FROM batches WHERE id = 'hooked'"))
        assert stored.scalar() == "URLError: <urlopen error <url> refused>"
    # The demo's worker gets its URLs through the environment, not its command line (ps).
    cmd, env = worker_command(Namespace(model="m", dtype="float32"), "redis://:pw@r:6379/0",
                              "postgresql://kv:pw@db/kv", "prefix")
    assert not any("pw" in part for part in cmd)
    assert env["KVBATCH_REDIS_URL"] == "redis://:pw@r:6379/0"


def test_metrics_listen_on_loopback_by_default() -> None:
    from prometheus_client import CollectorRegistry

    from worker.main import serve_metrics
    from worker.settings import worker_settings

    server = serve_metrics(worker_settings(model="m", metrics_port=0), CollectorRegistry())
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.shutdown()


def test_model_names_are_restricted_and_terminal_escapes_neutralized(
        client: Client, cli_args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("evil\x1b]0;pwned\x07", "two words", "", "-flag"):
        with pytest.raises(ValidationError, match="model"):
            JobSpec(model=name, prompt="x")
    from worker.settings import worker_settings

    with pytest.raises(ValidationError, match="served-model-name"):
        worker_settings(model="/models/my model", redis_url=REDIS_URL)
    # Whatever reached SQL before (an error text with an escape sequence) is shown escaped.
    spec = JobSpec(model="tiny", prompt="x")
    client.jobs.submit([spec])
    from jobs.schemas import Outcome

    SQL(client.jobs.engine).finish([Outcome(spec.id, JobStatus.FAILED, 0.0,
                                            error="boom \x1b[2J\x1b]0;owned\x07")])
    capsys.readouterr()
    assert main(["status", spec.id, *cli_args]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\x1b[2J" in out
