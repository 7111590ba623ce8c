"""The sampler on logits we write by hand: what each option keeps and draws, what logprobs
report, and that rows with different options in one batch each get their own treatment.
Draws are seeded, so every frequency below is a fixed number, checked against the
distribution it comes from with a margin of several standard deviations."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import Sampled, Sampler, SampleRow
from engine.sampling_params import SamplingParams

VOCAB = 6
DRAWS = 4000  # rows of one call: a frequency's standard deviation is at most 0.008


def row(params: SamplingParams, output: tuple[int, ...] = (), blocked: tuple[int, ...] = (),
        seed: int | None = None) -> SampleRow:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return SampleRow(params=params, prompt_token_ids=[0], output_token_ids=list(output),
                     generator=generator, blocked_token_ids=blocked)


def logits_of(probs: list[float], rows: int = 1) -> torch.Tensor:
    return torch.tensor([math.log(p) if p > 0 else -math.inf for p in probs])[None].repeat(
        rows, 1)


def frequencies(tokens: list[Sampled]) -> list[float]:
    counts = torch.bincount(torch.tensor([s.token for s in tokens]), minlength=VOCAB)
    return (counts / len(tokens)).tolist()


PROBS = [0.4, 0.3, 0.15, 0.1, 0.05, 0.0]


@pytest.mark.parametrize(("options", "expected"), [
    ({}, PROBS),
    # temperature 0.5 squares the probabilities, then renormalizes
    ({"temperature": 0.5}, [p * p / sum(q * q for q in PROBS) for p in PROBS]),
    ({"top_k": 2}, [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0, 0]),
    # top_p keeps the tokens until those above reach it: 0.4 + 0.3 >= 0.7 keeps three
    ({"top_p": 0.71}, [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0, 0]),
    ({"top_p": 0.7}, [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0, 0]),
    ({"top_p": 0.1}, [1, 0, 0, 0, 0, 0]),  # the top token always stays
    # min_p keeps the tokens at least min_p times as likely as the top one (0.25 * 0.4)
    ({"min_p": 0.25}, [0.4 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.1 / 0.95, 0, 0]),
    ({"top_k": 3, "top_p": 0.5}, [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0, 0]),
    # a bias is added to the logit: log 2 doubles token 1's weight (0.3 -> 0.6, of 1.3)
    ({"logit_bias": {1: math.log(2)}}, [0.4 / 1.3, 0.6 / 1.3, 0.15 / 1.3, 0.1 / 1.3,
                                        0.05 / 1.3, 0]),
])
def test_each_option_draws_from_what_it_keeps(options: dict[str, float],
                                              expected: list[float]) -> None:
    params = SamplingParams(temperature=options.pop("temperature", 1.0), **options)
    tokens = Sampler(seed=1)(logits_of(PROBS, DRAWS), [row(params)] * DRAWS)
    got = frequencies(tokens)
    for token, (f, p) in enumerate(zip(got, expected, strict=True)):
        assert abs(f - p) < 0.035, (token, got, expected)
        assert (f == 0) == (p == 0), (token, got, expected)  # nothing outside what it keeps


def test_top_p_stops_where_the_tokens_above_reach_it_exactly() -> None:
    # Four equal tokens (0.25 each, exact in float32): top_p 0.5 keeps two, 0.51 three.
    logits = torch.tensor([[0.0] * 4 + [-math.inf] * 2]).repeat(DRAWS, 1)
    for top_p, kept in ((0.5, 2), (0.51, 3)):
        params = SamplingParams(temperature=1.0, top_p=top_p)
        got = frequencies(Sampler(seed=2)(logits.clone(), [row(params)] * DRAWS))
        assert sum(f > 0 for f in got) == kept, (top_p, got)
        assert all(abs(f - 1 / kept) < 0.035 for f in got if f > 0), (top_p, got)


def test_top_k_holds_whatever_top_p_makes_of_the_rest() -> None:
    # Logits whose three kept probabilities add up to just under 1.0 in float32: top_p=1.0
    # then drops nothing past them by itself, and top-k alone keeps them out.
    logits = torch.tensor([[1.5409960746765137, -0.293428897857666, -2.1787893772125244,
                            0.5684312582015991, -1.0845223665237427, -1.3985954523086548]])
    params = SamplingParams(temperature=1.0, top_k=3)
    got = frequencies(Sampler(seed=3)(logits.repeat(DRAWS, 1), [row(params)] * DRAWS))
    assert {t for t, f in enumerate(got) if f > 0} == {0, 1, 3}, got


def test_rows_of_one_batch_each_get_their_own_options() -> None:
    # Row i's options apply to row i only: greedy, top-k 1, a bias and a blocked EOS side by
    # side, each with a different answer.
    probs = [0.1, 0.2, 0.3, 0.25, 0.15, 0.0]
    rows = [
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=0.7, top_k=1)),
        row(SamplingParams(temperature=0.0, logit_bias={4: 100.0})),
        row(SamplingParams(temperature=0.0, min_tokens=2), output=(1,), blocked=(2,)),
        row(SamplingParams(temperature=0.0, min_tokens=1), output=(1,), blocked=(2,)),
        row(SamplingParams(temperature=0.0, logit_bias={2: -100.0})),
    ]
    tokens = [s.token for s in Sampler(seed=0)(logits_of(probs, len(rows)), rows)]
    assert tokens == [2, 2, 4, 3, 2, 3]


def test_a_seeded_row_draws_the_same_whatever_shares_its_call() -> None:
    params = SamplingParams(temperature=1.0, seed=11)
    alone = [Sampler(seed=0)(logits_of(PROBS), [row(params, seed=11)])[0].token
             for _ in range(1)]
    draws = []
    for others in (0, 3, 17):
        rows = [row(SamplingParams(temperature=1.0))] * others + [row(params, seed=11)]
        draws.append(Sampler(seed=others)(logits_of(PROBS, len(rows)), rows)[-1].token)
    assert draws == alone * 3
    # and the seed matters: sixty seeds do not all draw one token
    seeded = {Sampler(seed=0)(logits_of(PROBS), [row(params, seed=s)])[0].token
              for s in range(60)}
    assert len(seeded) > 2


def test_unseeded_rows_follow_the_engine_seed() -> None:
    rows = [row(SamplingParams(temperature=1.0))] * 32
    first = [s.token for s in Sampler(seed=5)(logits_of(PROBS, 32), rows)]
    assert first == [s.token for s in Sampler(seed=5)(logits_of(PROBS, 32), rows)]
    assert first != [s.token for s in Sampler(seed=6)(logits_of(PROBS, 32), rows)]
    sampler = Sampler(seed=5)  # one sampler's later calls draw new noise
    sampler(logits_of(PROBS, 32), rows)
    assert first != [s.token for s in sampler(logits_of(PROBS, 32), rows)]


def test_logprobs_are_of_the_raw_logits_with_the_chosen_token_and_the_top_k() -> None:
    probs = [0.1, 0.2, 0.3, 0.25, 0.15, 0.0]
    raw = torch.log(torch.tensor(probs))
    rows = [
        row(SamplingParams(temperature=0.0, logprobs=2, logit_bias={0: 100.0})),
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=0.0, logprobs=0, logit_bias={4: 100.0})),
        row(SamplingParams(temperature=0.0, logprobs=4)),
    ]
    out = Sampler(seed=0)(logits_of(probs, len(rows)), rows)
    assert [s.token for s in out] == [0, 2, 4, 2]
    assert out[1].logprobs is None
    # The chosen token's logprob before the bias, then the top ones: those of the model.
    assert out[0].logprobs == pytest.approx({0: raw[0].item(), 2: raw[2].item(),
                                             3: raw[3].item()})
    assert out[2].logprobs == pytest.approx({4: raw[4].item()})
    assert out[3].logprobs == pytest.approx({2: raw[2].item(), 3: raw[3].item(),
                                             1: raw[1].item(), 4: raw[4].item()})
    assert list(out[3].logprobs) == [2, 3, 1, 4]  # the chosen first, then by rank


def test_a_plain_greedy_batch_takes_the_given_argmax() -> None:
    seen = []

    def argmax(logits: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(logits.shape))
        return logits.float().argmax(dim=-1)

    sampler = Sampler(seed=0, argmax=argmax)
    logits = logits_of(PROBS, 3).to(torch.bfloat16)
    assert [s.token for s in sampler(logits, [row(SamplingParams(temperature=0.0))] * 3)] \
        == [0, 0, 0]
    assert seen == [(3, VOCAB)]
    # A row under min_tokens with a blocked token edits the logits: not the plain path.
    blocked = row(SamplingParams(temperature=0.0, min_tokens=1), blocked=(0,))
    assert [s.token for s in sampler(logits_of(PROBS, 1), [blocked])] == [1]
    assert seen == [(3, VOCAB)]
