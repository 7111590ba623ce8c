"""The HTTP API's batch path against ``kvbatch submit`` on the same dataset, in one run: what a
pipeline pays for going through ``kvbatch serve`` (upload, validation, submission, output file
made from SQL) instead of holding Redis and SQL credentials itself.

One worker process on the queue bench's stand-in engine (``bench.queue_path.NullEngine``:
every request gets its tokens at no cost), so that the queue, the API and the database are
what is measured. The same N OpenAI chat rows go through

* ``kvbatch submit`` (``jobs.bulk.run_bulk``): read, submit, follow, write the results file;
* the API with the official ``openai`` client: ``files.create``, ``batches.create``, poll
  ``batches.retrieve`` every 0.5 s until ``completed``, ``files.content`` of the output.

Prints each phase's time and rate and the ratio of the two paths' rows/s. Real services
(``--redis-url``, ``--database-url``), in a schema and key prefix of the run's own.

    python -m bench.api_batches --rows 20000
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.queue_path import MODEL_NAME, REPO_ROOT, scratch_services, worker_process


def _rows(n: int) -> bytes:
    return "".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL_NAME, "max_tokens": 8 + i % 8, "temperature": 0,
                 "messages": [{"role": "system", "content": "You label support tickets."},
                              {"role": "user", "content": f"Ticket {i}: my order is late."}]},
    }) + "\n" for i in range(n)).encode()


def via_submit(services, data: Path, out: Path) -> float:  # type: ignore[no-untyped-def]
    from jobs.bulk import BulkOptions, iter_rows, run_bulk
    from jobs.sdk import Client

    started = time.perf_counter()
    with Client(services.redis_url, services.database_url, key_prefix=services.key_prefix,
                model=MODEL_NAME) as client:
        opts = BulkOptions(input=data, output=out, errors=None, batch_id="bench-submit",
                           model=MODEL_NAME, progress=False)
        tally = run_bulk(client, lambda: iter_rows(data), opts)
    assert tally.written == tally.submitted and tally.failed == 0, tally
    return time.perf_counter() - started


def via_api(services, data: bytes, files_dir: Path, log: Path,  # type: ignore[no-untyped-def]
            port: int) -> dict[str, float]:
    import openai

    from jobs import db
    from jobs.api.keys import KeyStore

    engine = db.make_engine(services.database_url)
    key = KeyStore(engine).create("bench")[1]
    engine.dispose()
    cmd = [sys.executable, "-m", "worker.cli", "serve", "--port", str(port), "--files-dir",
           str(files_dir), "--model", MODEL_NAME, "--redis-url", services.redis_url,
           "--database-url", services.database_url, "--key-prefix", services.key_prefix]
    with log.open("w") as f:
        server = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"kvbatch serve did not start; see {log}") from None
                time.sleep(0.1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=600)
        t0 = time.perf_counter()
        file = client.files.create(file=("rows.jsonl", io.BytesIO(data)), purpose="batch")
        t1 = time.perf_counter()
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(0.5)
            batch = client.batches.retrieve(batch.id)
        t2 = time.perf_counter()
        assert batch.status == "completed" and batch.output_file_id, batch
        output = client.files.content(batch.output_file_id).read()
        t3 = time.perf_counter()
        assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
        return {"upload_s": t1 - t0, "run_s": t2 - t1, "download_s": t3 - t2,
                "total_s": t3 - t0, "output_bytes": len(output),
                "lines": output.count(b"\n"),
                "validate_s": batch.in_progress_at - batch.created_at,
                "finalize_s": batch.completed_at - batch.finalizing_at}
    finally:
        server.terminate()
        server.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--null-tokens", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--database-url",
                        default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--out", default=str(REPO_ROOT / "bench" / "out"))
    args = parser.parse_args()
    args.model, args.dtype = "none", "auto"  # the stand-in engine loads no model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = _rows(args.rows)
    path = out / "api-rows.jsonl"
    path.write_bytes(data)
    with scratch_services(args.redis_url, args.database_url) as services, \
            worker_process(services, args, null=True):
        result = out / "api-submit-results.jsonl"
        result.unlink(missing_ok=True)
        result.with_name(result.name + ".batch").unlink(missing_ok=True)
        submit_s = via_submit(services, path, result)
        api = via_api(services, data, out / "api-files", out / "api-server.log", args.port)
    assert api["lines"] == args.rows
    mib = len(data) / 2**20
    print(f"{args.rows} rows ({mib:.1f} MiB in, {api['output_bytes'] / 2**20:.1f} MiB out), "
          f"one worker on the stand-in engine")
    print(f"kvbatch submit    {submit_s:7.1f} s  {args.rows / submit_s:8.0f} rows/s")
    print(f"HTTP API          {api['total_s']:7.1f} s  {args.rows / api['total_s']:8.0f} rows/s"
          f"   (API / submit: {submit_s / api['total_s']:.2f}x)")
    print(f"  upload          {api['upload_s']:7.2f} s  {mib / api['upload_s']:8.0f} MiB/s")
    print(f"  validating      {api['validate_s']:7.0f} s  (whole seconds, from the batch)")
    print(f"  finalizing      {api['finalize_s']:7.0f} s  (sizing the output from SQL)")
    print(f"  download        {api['download_s']:7.2f} s  "
          f"{api['output_bytes'] / 2**20 / api['download_s']:8.1f} MiB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
