"""Engine behaviour through its public API: prefix caching, parallel sampling, seeds,
stop conditions, sampling options, bad input and aborts, on a tiny random model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import hf_model

from engine import EngineConfig, LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture()
def engine(tiny_model: Path) -> LLMEngine:
    # 16-token blocks (the CUDA default; the CPU's is 8): the layouts below are written for them.
    return LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=128, block_size=16))


def test_shared_system_prompt_is_computed_once_in_one_generate_call(engine: LLMEngine) -> None:
    system = "You are a careful assistant. Answer briefly and cite sources. " * 3
    prompts = [
        [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}]
        for i in range(6)
    ]
    outs = engine.generate(prompts, GREEDY)
    ids = [o.prompt_token_ids for o in outs]
    shared = next(i for i in range(len(ids[0])) if len({p[i] for p in ids}) > 1)
    shared_full_blocks = shared // 16 * 16
    assert shared_full_blocks >= 160
    assert [o.metrics.num_cached_tokens for o in outs] == [0] + [shared_full_blocks] * 5
    stats = engine.stats()
    assert stats.num_prompt_tokens == sum(map(len, ids)) - 5 * shared_full_blocks
    assert stats.prefix_cache_hits == 5 * shared_full_blocks
    # Same tokens as without any caching.
    plain = LLMEngine(
        EngineConfig(model=engine.config.model, num_kv_blocks=128, enable_prefix_caching=False)
    )
    assert [o.token_ids for o in plain.generate(prompts, GREEDY)] == [o.token_ids for o in outs]


def test_parallel_samples_share_prompt_blocks_then_copy_on_write(engine: LLMEngine) -> None:
    prompt = list(range(20, 60))  # 40 tokens: two full blocks and a partial one
    engine.add_request("n3", prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8))
    engine.step()  # prefill + first sample of all three, then fork
    seqs = engine.scheduler.running
    assert len(seqs) == 3
    tables = [s.block_table for s in seqs]
    assert tables[0] == tables[1] == tables[2]
    assert [engine.kv.pool.ref_counts[b] for b in tables[0]] == [3, 3, 3]
    engine.step()  # each sample writes its first token into the shared partial block
    tables = [s.block_table for s in seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # full blocks still shared
    assert len({t[2] for t in tables}) == 3  # partial block copied on write
    assert [engine.kv.pool.ref_counts[b] for b in tables[0][:2]] == [3, 3]
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    (out,) = outs
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_seeded_sampling_is_reproducible_across_engines_and_batches(tiny_model: Path) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16,
                            ignore_eos=True)
    prompt = list(range(10, 30))
    first = LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=64, seed=1))
    second = LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=64, seed=2))
    alone = first.generate([prompt], params)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=16)] * 3
    batched = second.generate([list(range(5, 9)), prompt, [3] * 30, [4] * 7],
                              [others[0], params, *others[1:]])[1].token_ids
    assert alone == batched
    other_seed = first.generate([prompt], SamplingParams(
        temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_repetition_penalty_matches_transformers(engine: LLMEngine, tiny_model: Path) -> None:
    prompt = [105, 105, 70, 241, 3, 9, 105]
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12,
                            repetition_penalty=1.5)
    ours = engine.generate([prompt], params)[0].token_ids
    ref = hf_model(tiny_model).generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=12, min_new_tokens=12, do_sample=False,
        repetition_penalty=1.5, pad_token_id=0,
    )[0, len(prompt):].tolist()
    assert ours == ref
    assert ours != engine.generate([prompt], GREEDY)[0].token_ids


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=1e-6, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.5, min_p=1.0, max_tokens=12, ignore_eos=True),
    ],
    ids=["top_k=1", "top_p~0", "min_p=1"],
)
def test_truncated_sampling_degenerates_to_greedy(engine: LLMEngine,
                                                  params: SamplingParams) -> None:
    prompts = [list(range(3, 3 + n)) for n in (4, 19, 33)]
    greedy = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    assert [o.token_ids for o in engine.generate(prompts, params)] == greedy


def test_stop_strings_tokens_and_min_tokens(engine: LLMEngine) -> None:
    prompt = list(range(40, 60))
    full = engine.generate([prompt], GREEDY)[0]
    stop_token = full.token_ids[3]
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12,
                                                   ignore_eos=True, stop_token_ids=[stop_token]))[0]
    first = full.token_ids.index(stop_token)
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[: first + 1]

    # min_tokens masks the stop token for the first tokens; the output then differs from
    # greedy exactly where greedy would have emitted it.
    out = engine.generate([prompt], SamplingParams(
        temperature=0.0, max_tokens=12, min_tokens=first + 1, ignore_eos=True,
        stop_token_ids=[stop_token]))[0]
    assert stop_token not in out.token_ids[: first + 1]

    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12,
                                                   ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]


@pytest.mark.parametrize("span", [(0, 2), (1, 11)], ids=["at-the-start", "ten-chars"])
def test_a_stop_string_ends_the_output_at_the_token_that_completes_it(
    engine: LLMEngine, span: tuple[int, int]
) -> None:
    # A stop string in the first tokens, and one longer than the tokens it spans would
    # suggest, are both seen in the step whose token completes them: the look-back window
    # covers every stop string whatever its position and length.
    prompt = list(range(40, 60))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = engine.generate([prompt], params)[0]
    stop = full.text[span[0] : span[1]]
    assert len(stop) == span[1] - span[0]
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24,
                                                   ignore_eos=True, stop=[stop]))[0]
    decode = engine.tokenizer.decode
    end = next(i for i in range(1, len(full.token_ids) + 1)
               if stop in decode(full.token_ids[:i], skip_special_tokens=True))
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[:end]
    assert out.text == full.text[: full.text.index(stop)]


def test_logprobs_include_sampled_and_top_tokens(engine: LLMEngine) -> None:
    out = engine.generate([list(range(5, 25))], SamplingParams(temperature=0.0, max_tokens=5,
                                                               ignore_eos=True, logprobs=3))[0]
    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == 5
    for token, lp in zip(out.token_ids, lps, strict=True):
        assert token in lp and len(lp) == 3  # greedy token is the top one
        assert max(lp.values()) == lp[token] <= 0.0


def test_bad_prompts_fail_alone(engine: LLMEngine) -> None:
    too_long = [5] * engine.info.max_model_len
    outs = engine.generate(["", [], too_long, [10**6], "fine prompt", [{"role": "user"}]],
                           GREEDY)
    assert [o.finish_reason for o in outs] == ["error", "error", "error", "error", "length",
                                               "error"]
    assert "empty" in (outs[0].error or "")
    assert "max_model_len" in (outs[2].error or "")
    assert "vocabulary" in (outs[3].error or "")
    assert "role" in (outs[5].error or "")
    assert len(outs[4].token_ids) == 12 and outs[4].error is None
    for bad in outs[:4] + outs[5:]:  # one empty sample, index 0, no prompt, no time spent
        assert bad.prompt_token_ids == [] and bad.token_ids == [] and bad.text == ""
        assert [s.index for s in bad.outputs] == [0]
        m = bad.metrics
        assert isinstance(m.arrival_time, float) and m.finish_time == m.arrival_time


def test_more_samples_than_seats_is_refused(tiny_model: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=64, max_num_seqs=2))
    (out,) = engine.generate([[1, 2, 3]], SamplingParams(n=3, temperature=1.0, max_tokens=2))
    assert out.finish_reason == "error" and "max_num_seqs" in (out.error or "")


def test_auto_dtype_follows_the_cpu_and_bad_dtypes_are_refused(tiny_model: Path) -> None:
    from engine.runtime import cpu_has_native_bf16

    engine = LLMEngine(EngineConfig(model=str(tiny_model), dtype="auto", num_kv_blocks=16))
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert engine.info.dtype == expected
    assert engine.runner.kv_caches.dtype == expected
    assert engine.runner.model.embed_tokens.weight.dtype == expected
    (out,) = engine.generate([[1, 2, 3]], GREEDY)
    assert len(out.token_ids) == GREEDY.max_tokens
    with pytest.raises(ValueError, match=r"dtype must be one of .* or 'auto', got 'fp8'"):
        EngineConfig(dtype="fp8")


def test_abort_frees_blocks_and_reports(engine: LLMEngine) -> None:
    engine.add_request("a", list(range(50)), GREEDY)
    engine.add_request("b", list(range(60, 70)), GREEDY)
    engine.step()
    assert engine.kv.pool.num_free_blocks < engine.kv.pool.num_blocks
    engine.abort_request("a")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].finished and outs["a"].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [1], GREEDY)
        engine.add_request("dup", [1], GREEDY)


def test_metrics_are_filled(engine: LLMEngine) -> None:
    out = engine.generate([list(range(3, 40))], GREEDY)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
    assert m.num_prompt_tokens == 37 and m.num_generated_tokens == 12
    assert m.peak_kv_blocks == 3  # KV for 37 + 11 tokens (the last one is never fed back)
    assert m.peak_kv_bytes == m.peak_kv_blocks * engine.info.kv_bytes_per_block


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty"),
        ({"logprobs": 100}, "logprobs"),
        ({"seed": -3}, "seed"),
        ({"logit_bias": {"7": 250}}, "logit_bias"),
        ({"max_tokens": "7"}, "max_tokens"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
