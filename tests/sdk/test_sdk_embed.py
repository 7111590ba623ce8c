"""Embedding jobs through the SDK and ``kvbatch submit`` on a real worker: ``client.embed``
returns the engine's vectors in order with per-job stats stored in SQL; ``/v1/embeddings``
rows of a submit file come back in OpenAI's shape beside chat rows; a ``dimensions`` the model
does not allow fails its job naming why."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from services import jsonl

from engine import EngineConfig, LLMEngine, PoolingParams
from jobs import AsyncClient
from jobs.sdk import Client, JobFailed
from worker.cli import main

MODEL = "tiny"
TEXTS = [f"text number {i} " + "about kv caches " * (i % 5) for i in range(10)]


def _engine_vectors(tiny_model: str, texts: list[str]) -> torch.Tensor:
    """The worker's engine (same model and settings), run here."""
    engine = LLMEngine(EngineConfig(model=tiny_model, device="cpu", num_kv_blocks=1024,
                                    max_num_seqs=64))
    return torch.tensor([o.embedding for o in engine.generate(texts, PoolingParams())])


def _assert_same(got: list[list[float]], ref: torch.Tensor) -> None:
    vectors = torch.tensor(got)
    assert vectors.shape == ref.shape
    assert F.cosine_similarity(vectors, ref, dim=1).min().item() >= 0.9999


def test_embed_returns_vectors_in_order_with_stats(client: Client, start_worker,  # type: ignore[no-untyped-def]
                                                   tiny_model: str,
                                                   services: dict[str, str]) -> None:
    start_worker()
    generation = client.submit(raw_prompt="shares the steps", max_tokens=8, temperature=0)
    vectors = client.embed(TEXTS, texts_per_job=3, timeout_s=120)
    _assert_same(vectors, _engine_vectors(tiny_model, TEXTS))
    assert generation.result(timeout_s=60).token_ids
    assert client.embed([]) == []

    rows = [r for r in client.jobs.reader.job_stats_rows() if r["generated_tokens"] == 0]
    assert len(rows) == 4  # 10 texts, 3 a job
    assert sum(r["prompt_tokens"] for r in rows) == sum(
        len(t.encode()) for t in TEXTS)  # the tiny model's tokenizer: one token a byte
    assert all(r["e2e_s"] is not None and r["e2e_s"] >= r["queue_wait_s"] >= 0 for r in rows)
    assert all(r["peak_kv_blocks"] > 0 and r["peak_kv_bytes"] > 0 for r in rows)

    with pytest.raises(JobFailed, match="not a Matryoshka model"):
        client.embed(TEXTS[:2], dimensions=8, timeout_s=60)

    async def embed_async() -> list[list[float]]:
        async with AsyncClient(model=MODEL, **services) as aclient:
            return await aclient.embed(TEXTS[:5], texts_per_job=2, timeout_s=60)

    _assert_same(asyncio.run(embed_async()), torch.tensor(vectors[:5]))


def test_submit_file_with_embedding_rows(tmp_path: Path, client: Client, start_worker,  # type: ignore[no-untyped-def]
                                         cli_args: list[str], tiny_model: str) -> None:
    rows = [{"custom_id": "emb", "method": "POST", "url": "/v1/embeddings",
             "body": {"model": "x", "input": TEXTS[:3]}},
            {"custom_id": "emb-one", "method": "POST", "url": "/v1/embeddings",
             "body": {"model": "x", "input": TEXTS[3], "encoding_format": "float"}},
            {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "x", "max_tokens": 3,
                      "messages": [{"role": "user", "content": "hi"}]}}]
    data, out = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    start_worker()
    assert main(["submit", str(data), "-o", str(out), "--model", MODEL, "--no-progress",
                 *cli_args]) == 0
    lines = {line["custom_id"]: line for line in jsonl(out.read_text())}
    assert lines["chat"]["response"]["body"]["object"] == "chat.completion"
    got = []
    for custom_id in ("emb", "emb-one"):
        body = lines[custom_id]["response"]["body"]
        assert body["object"] == "list" and body["model"] == MODEL
        got += [d["embedding"] for d in body["data"]]
    _assert_same(got, _engine_vectors(tiny_model, TEXTS[:4]))
