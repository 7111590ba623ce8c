"""An OpenAI ``/v1/embeddings`` batch file through the HTTP API and a real worker: output lines
that parse as ``openai.types.CreateEmbeddingResponse``, vectors (float and base64) equal to
the engine's own, a ``dimensions`` the model does not allow refused on its line."""

from __future__ import annotations

import base64
import struct

import pytest
import torch
import torch.nn.functional as F
from openai.types import CreateEmbeddingResponse
from test_openai_api import jsonl, lines_of, upload, wait_batch

from engine import EngineConfig, LLMEngine, PoolingParams

TEXTS = ["the sky is blue", "kv cache", "a longer text about batching prompts " * 4, "x"]


def row(custom_id: str, inputs: str | list[str], **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
            "body": {"model": "tiny", "input": inputs, **body}}


def test_embeddings_batch_file_parses_with_openai_types(openai_client, start_worker,  # type: ignore[no-untyped-def]
                                                        tiny_model: str) -> None:
    client = openai_client()
    start_worker()
    rows = [row("one", TEXTS[0]), row("many", TEXTS),
            row("b64", TEXTS[1:3], encoding_format="base64"),
            row("dims", TEXTS[0], dimensions=8)]
    batch = client.batches.create(input_file_id=upload(client, jsonl(rows)),
                                  endpoint="/v1/embeddings", completion_window="24h")
    done = wait_batch(client, batch.id)
    assert done.status == "completed", done
    assert done.output_file_id is not None
    assert done.error_file_id is not None  # the failed line
    lines = {line["custom_id"]: line for file_id in (done.output_file_id, done.error_file_id)
             for line in lines_of(client, file_id)}
    assert set(lines) == {"one", "many", "b64", "dims"}

    # the worker's engine, run here on the same model and settings
    reference = LLMEngine(EngineConfig(model=tiny_model, device="cpu", num_kv_blocks=1024,
                                       max_num_seqs=64))
    expected = {text: out.embedding
                for text, out in zip(TEXTS, reference.generate(TEXTS, PoolingParams()),
                                     strict=True)}

    def vectors(custom_id: str) -> list[list[float]]:
        body = lines[custom_id]["response"]["body"]
        for d in body["data"]:  # base64 is decoded first, as the openai client does
            if isinstance(d["embedding"], str):
                raw = base64.b64decode(d["embedding"])
                d["embedding"] = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        response = CreateEmbeddingResponse.model_validate(body)
        assert response.object == "list" and response.model == "tiny"
        assert [d.index for d in response.data] == list(range(len(response.data)))
        assert response.usage.prompt_tokens == response.usage.total_tokens > 0
        return [d.embedding for d in response.data]

    def check(custom_id: str, texts: list[str]) -> None:
        got, ref = torch.tensor(vectors(custom_id)), torch.tensor([expected[t] for t in texts])
        assert got.shape == ref.shape
        assert F.cosine_similarity(got, ref, dim=1).min().item() >= 0.9999

    check("one", TEXTS[:1])
    check("many", TEXTS)
    assert {type(d["embedding"]) for d in lines["b64"]["response"]["body"]["data"]} == {str}
    check("b64", TEXTS[1:3])
    dims = lines["dims"]["response"]
    assert dims["status_code"] == 400
    assert "not a Matryoshka model" in dims["body"]["error"]["message"]


@pytest.mark.parametrize(("body", "error"), [
    ({"input": 3}, "'input' must be a string or a list of strings"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions must be a positive integer"),
    ({"input": ["x", ""]}, "input"),
    ({"input": "x", "temperature": 0}, "not supported"),
])
def test_bad_embedding_lines_are_refused_naming_why(openai_client, body: dict,  # type: ignore[no-untyped-def]
                                                     error: str) -> None:
    client = openai_client()
    rows = [row("ok", "fine"), {**row("bad", ""), "body": {"model": "tiny", **body}}]
    batch = client.batches.create(input_file_id=upload(client, jsonl(rows)),
                                  endpoint="/v1/embeddings", completion_window="24h")
    done = wait_batch(client, batch.id)
    assert done.status == "failed", done
    assert done.errors is not None
    messages = [e.message or "" for e in done.errors.data or []]
    assert any(error in m for m in messages), messages
