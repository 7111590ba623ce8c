"""Embeddings against transformers on the same weights (fp32): the last hidden state pooled the
same way, per the model's configuration; prompt-only requests share steps with generations
without changing them, and keep no KV."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_reference import hf_model

from engine import EngineConfig, LLMEngine, PoolingParams, SamplingParams
from engine.scheduler import SchedulerOutput

BUDGET = 48  # tokens a step: the longer texts take several chunks
MIN_COSINE = 0.9999


def _texts(n: int = 64, seed: int = 3) -> list[str]:
    rng = random.Random(seed)
    words = ["kv", "batch", "embed", "token", "cache", "prefix", "the", "of", "a", "llama"]
    # 1 to ~150 bytes: the byte tokenizer makes each byte a token, several over the budget
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 30))) for _ in range(n)]


def _hf_embeddings(model_dir: Path, engine: LLMEngine, texts: list[str], method: str,
                   dimensions: int | None = None) -> torch.Tensor:
    rows = []
    for text in texts:
        ids = torch.tensor([engine.tokenizer.encode(text)])
        with torch.no_grad():
            hidden = hf_model(model_dir).model(ids).last_hidden_state[0]  # [T, H]
        pooled = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[method]
        rows.append(F.normalize(pooled[:dimensions], dim=0))
    return torch.stack(rows)


def _engine(model_dir: Path, **cfg: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32",  # type: ignore[arg-type]
                                  max_num_batched_tokens=BUDGET, num_kv_blocks=256, **cfg))


def _assert_close(outs: list, ref: torch.Tensor) -> None:
    got = torch.tensor([o.embedding for o in outs])
    assert got.shape == ref.shape
    cos = F.cosine_similarity(got, ref, dim=1)
    assert cos.min().item() >= MIN_COSINE, cos.min()
    assert torch.allclose(got.norm(dim=1), torch.ones(len(outs)), atol=1e-5)


def _with_config(src: Path, dst: Path, pooling: str | None = None, **hf: object) -> Path:
    """A copy of ``src`` with a sentence-transformers Pooling module and config.json keys."""
    shutil.copytree(src, dst)
    if pooling is not None:
        (dst / "modules.json").write_text(json.dumps(
            [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
             {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (dst / "1_Pooling").mkdir()
        (dst / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 60, f"pooling_mode_{pooling}": True}))
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | hf))
    return dst


def test_64_texts_match_transformers_last_token(tiny_model: Path) -> None:
    engine = _engine(tiny_model)
    texts = _texts()
    assert max(len(engine.tokenizer.encode(t)) for t in texts) > 2 * BUDGET  # chunked
    outs = engine.generate(texts, PoolingParams())
    assert all(o.finished and o.error is None and o.outputs[0].token_ids == [] for o in outs)
    _assert_close(outs, _hf_embeddings(tiny_model, engine, texts, "last"))
    # prompt-only: no KV kept, and the metrics of a generation
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    for text, o in zip(texts, outs, strict=True):
        m = o.metrics
        assert m.num_prompt_tokens == len(engine.tokenizer.encode(text))
        assert m.num_generated_tokens == 0
        assert m.peak_kv_blocks == -(-m.num_prompt_tokens // engine.info.block_size)
        assert m.peak_kv_bytes == m.peak_kv_blocks * engine.info.kv_bytes_per_block
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time


@pytest.mark.parametrize("method", ["mean", "cls"])
def test_pooling_from_the_sentence_transformers_config(tiny_model: Path, tmp_path: Path,
                                                       method: str) -> None:
    model_dir = _with_config(tiny_model, tmp_path / method,
                             {"mean": "mean_tokens", "cls": "cls_token"}[method])
    engine = _engine(model_dir)
    texts = _texts(16, seed=5)
    shared = "a system prompt shared by every text, long enough for blocks: " * 2
    outs = engine.generate([shared + t for t in texts], PoolingParams())
    _assert_close(outs, _hf_embeddings(model_dir, engine, [shared + t for t in texts], method))
    # every row pooled: nothing read from the prefix cache
    assert all(o.metrics.num_cached_tokens == 0 for o in outs)


def test_last_token_pooling_reads_the_prefix_cache(tiny_model: Path) -> None:
    engine = _engine(tiny_model)
    shared = "a system prompt shared by every text, long enough for blocks: " * 2
    texts = [shared + t for t in _texts(8, seed=9)]
    first = engine.generate(texts[:1], PoolingParams())
    rest = engine.generate(texts[1:], PoolingParams())
    assert first[0].metrics.num_cached_tokens == 0
    assert all(o.metrics.num_cached_tokens >= 16 for o in rest)
    _assert_close(first + rest, _hf_embeddings(tiny_model, engine, texts, "last"))


def test_embeddings_share_steps_with_generations_which_stay_identical(tiny_model: Path) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = _texts(8, seed=11)
    texts = _texts(24, seed=12)
    alone = _engine(tiny_model).generate(prompts, greedy)

    engine = _engine(tiny_model)
    mixed_steps = 0
    schedule = engine.scheduler.schedule

    def counting() -> SchedulerOutput:
        nonlocal mixed_steps
        out = schedule()
        kinds = {s.seq.pooling is None for s in out.seqs}
        mixed_steps += kinds == {True, False}
        return out

    engine.scheduler.schedule = counting  # type: ignore[method-assign]
    params = [greedy] * len(prompts) + [PoolingParams()] * len(texts)
    outs = engine.generate(prompts + texts, params)
    assert mixed_steps > 0
    assert [o.token_ids for o in outs[: len(prompts)]] == [o.token_ids for o in alone]
    assert all(o.embedding is None for o in outs[: len(prompts)])
    _assert_close(outs[len(prompts):], _hf_embeddings(tiny_model, engine, texts, "last"))
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_dimensions_truncate_only_where_the_model_allows(tiny_model: Path,
                                                         tmp_path: Path) -> None:
    plain = _engine(tiny_model)
    with pytest.raises(ValueError, match="not a Matryoshka model"):
        plain.add_request("r", "text", PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)

    model_dir = _with_config(tiny_model, tmp_path / "mrl", matryoshka_dimensions=[8, 32, 60])
    engine = _engine(model_dir)
    with pytest.raises(ValueError, match=r"dimensions=9 is not one this model allows: \[8, 32"):
        engine.add_request("r", "text", PoolingParams(dimensions=9))
    texts = _texts(6, seed=13)
    outs = engine.generate(texts, PoolingParams(dimensions=8))
    assert all(len(o.embedding) == 8 for o in outs)
    _assert_close(outs, _hf_embeddings(model_dir, engine, texts, "last", dimensions=8))
