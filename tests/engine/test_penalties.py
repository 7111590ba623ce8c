"""Repetition, frequency and presence penalties against their definitions, on logits we know.

OpenAI's formula for the last two, on the tokens generated so far::

    logits[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0)

and the CTRL / transformers repetition penalty, on every token seen (prompt and output): a
positive logit is divided by it, a negative one multiplied. The sampler edits float32 logits
in place, so the logits it was given are the distribution it sampled from.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.sampler import Sampler, SampleRow

# Token 4 has the highest logit; the prompt holds 1 and 3, the output 4, 4 and 7.
LOGITS = [2.0, 1.0, 0.5, -1.0, 3.0, 0.0, -0.5, 1.5]
PROMPT = [1, 3]
OUTPUT = [4, 4, 7]


def _row(params: SamplingParams, prompt: list[int] = PROMPT,
         output: list[int] = OUTPUT) -> SampleRow:
    return SampleRow(params, prompt, output, generator=None, blocked_token_ids=())


def _openai(logits: list[float], output: list[int], frequency: float,
            presence: float) -> list[float]:
    counts = Counter(output)
    return [v - frequency * counts[j] - presence * (counts[j] > 0)
            for j, v in enumerate(logits)]


def _repetition(logits: list[float], seen: list[int], penalty: float) -> list[float]:
    return [(v / penalty if v > 0 else v * penalty) if j in seen else v
            for j, v in enumerate(logits)]


@pytest.mark.parametrize("frequency, presence", [
    (0.5, 0.0), (0.0, 0.25), (0.5, 0.25), (2.0, 2.0), (-0.5, 0.0), (0.0, -1.0), (-2.0, 1.5),
])
def test_frequency_and_presence_follow_openais_formula(frequency: float, presence: float) -> None:
    params = SamplingParams(temperature=0.0, frequency_penalty=frequency,
                            presence_penalty=presence)
    logits = torch.tensor([LOGITS])
    (sampled,) = Sampler(seed=0)(logits, [_row(params)])
    expected = _openai(LOGITS, OUTPUT, frequency, presence)
    assert logits[0].tolist() == pytest.approx(expected)
    assert sampled.token == max(range(len(expected)), key=expected.__getitem__)


def test_penalties_change_which_token_is_greedy() -> None:
    # 4 leads by 1.0: two occurrences at 0.5 each, plus presence, push it below token 0 ...
    penalized = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25)
    (token,) = Sampler(seed=0)(torch.tensor([LOGITS]), [_row(penalized)])
    assert token.token == 0
    # ... and a negative penalty keeps it on top by more.
    rewarded = SamplingParams(temperature=0.0, frequency_penalty=-0.5)
    logits = torch.tensor([LOGITS])
    (token,) = Sampler(seed=0)(logits, [_row(rewarded)])
    assert token.token == 4 and logits[0, 4].item() == pytest.approx(4.0)


def test_frequency_and_presence_ignore_the_prompt() -> None:
    # Only the output counts: with no output, nothing moves, whatever the prompt repeats.
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0)
    logits = torch.tensor([LOGITS])
    Sampler(seed=0)(logits, [_row(params, prompt=[4, 4, 4, 0], output=[])])
    assert logits[0].tolist() == LOGITS


@pytest.mark.parametrize("penalty", [2.0, 1.25, 0.5])
def test_repetition_penalty_hits_only_seen_tokens(penalty: float) -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty)
    logits = torch.tensor([LOGITS])
    Sampler(seed=0)(logits, [_row(params)])
    seen = PROMPT + OUTPUT  # 1, 3, 4, 7: positive and negative logits among them
    assert logits[0].tolist() == pytest.approx(_repetition(LOGITS, seen, penalty))
    unseen = [j for j in range(len(LOGITS)) if j not in seen]
    assert logits[0, unseen].tolist() == [LOGITS[j] for j in unseen]


def test_repetition_then_frequency_and_presence() -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5,
                            presence_penalty=0.25)
    logits = torch.tensor([LOGITS])
    Sampler(seed=0)(logits, [_row(params)])
    expected = _openai(_repetition(LOGITS, PROMPT + OUTPUT, 2.0), OUTPUT, 0.5, 0.25)
    assert logits[0].tolist() == pytest.approx(expected)


def test_each_row_gets_its_own_penalties_and_logprobs_stay_raw() -> None:
    # Rows with different penalties, one with none, one sampled: each edited by its own.
    rows = [
        _row(SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=3)),
        _row(SamplingParams(temperature=0.0, logprobs=3), output=[4, 4]),
        _row(SamplingParams(temperature=0.0, presence_penalty=2.0), output=[0, 4]),
        _row(SamplingParams(temperature=1.0, seed=3, repetition_penalty=2.0), output=[5]),
    ]
    logits = torch.tensor([LOGITS] * 4)
    sampled = Sampler(seed=0)(logits, rows)
    expected = [
        _openai(LOGITS, OUTPUT, 1.0, 0.0),
        LOGITS,
        _openai(LOGITS, [0, 4], 0.0, 2.0),
        _repetition(LOGITS, [*PROMPT, 5], 2.0),
    ]
    for i, row in enumerate(expected):
        assert logits[i].tolist() == pytest.approx(row), f"row {i}"
    assert [s.token for s in sampled[:3]] == [0, 4, 7]
    # Logprobs are those of the model's distribution, before any penalty.
    raw = torch.log_softmax(torch.tensor(LOGITS), dim=-1)
    for s in sampled[:2]:
        assert s.logprobs is not None and sorted(s.logprobs) == [0, 4, 7]
        for token, value in s.logprobs.items():
            assert value == pytest.approx(raw[token].item())


def test_frequency_penalty_breaks_a_greedy_loop(tiny_model: Path) -> None:
    """On a random model that repeats itself, a strong frequency penalty spreads the output;
    a penalty of the wrong sign would make one token fill it."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=64))
    prompt = "The answer is"
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (loop,) = engine.generate([prompt], plain)
    assert Counter(loop.token_ids).most_common(1)[0][1] >= 6  # the loop to break
    penalized = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                               frequency_penalty=2.0)
    (out,) = engine.generate([prompt], penalized)
    assert len(out.token_ids) == 24 and Counter(out.token_ids).most_common(1)[0][1] <= 2
