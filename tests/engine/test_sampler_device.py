"""Sampling stays on the logits' device: the only tensors read back to the host during a step
are the sampled ids and the requested logprobs, never a row of logits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams

READS = ("tolist", "cpu", "numpy", "item", "__float__", "__int__")


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, ...]]]:
    """The shapes of the tensors whose values are read to the host (or copied there)."""
    seen: list[tuple[int, ...]] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *args: object, _original=original, **kw: object) -> object:  # type: ignore[no-untyped-def]
            seen.append(tuple(self.shape))
            return _original(self, *args, **kw)

        monkeypatch.setattr(torch.Tensor, name, read)
    yield seen


def test_a_step_reads_back_ids_and_logprobs_never_the_logits(
    tiny_model: Path, host_reads: list[tuple[int, ...]]
) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=64))
    vocab = engine.info.vocab_size
    params = [
        SamplingParams(temperature=0.0, max_tokens=3),  # plain greedy: the argmax path
        SamplingParams(temperature=0.0, max_tokens=3, logprobs=5),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, max_tokens=3,
                       seed=3, logprobs=2),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5,
                       presence_penalty=0.2, logit_bias={5: 3.0}, min_tokens=2, max_tokens=3),
    ]
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", [1 + i, 7, 9, 11], p)
    host_reads.clear()  # what add_request read is not a step's
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert len(outputs) == len(params)
    assert host_reads, "the step read nothing back: the check below would prove nothing"
    big = [shape for shape in host_reads if vocab in shape]
    assert not big, f"a step read vocab-sized tensors back to the host: {big}"
    by_id = {o.request_id: o for o in outputs}
    first = by_id["r1"].outputs[0]
    assert first.logprobs is not None and all(len(lp) >= 5 for lp in first.logprobs)
    assert all(t in lp for t, lp in zip(first.token_ids, first.logprobs, strict=True))


def test_logprobs_are_those_of_the_raw_logits(tiny_model: Path) -> None:
    """The packed copy gives back what ``log_softmax`` of the logits says, per row."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=64))
    out = engine.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=1,
                                                      logprobs=4))[0]
    (lp,) = out.outputs[0].logprobs or []
    ranked = sorted(lp.items(), key=lambda kv: -kv[1])
    assert ranked[0][0] == out.token_ids[0]  # greedy takes the most likely token
    assert len(lp) == 4 and all(v <= 0 for v in lp.values())
    assert abs(sum(torch.tensor(list(lp.values())).exp().tolist())) <= 1.0 + 1e-6
