"""bench/int8.py on a tiny model: its one-forward log-probs agree with the engine's own greedy
decoding (so its agreement and perplexity figures measure the model, not the helper), and the
report has its lines (timings themselves are not asserted)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(REPO))
    sys.modules.pop("bench.int8", None)
    import bench.int8 as module

    return module


def test_sequence_logprobs_are_the_engines_greedy_decoding(bench, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    engine = LLMEngine(EngineConfig(model=str(tiny_model), dtype="float32"))
    prompt = [5, 17, 33, 2, 9, 41]
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10,
                                                   ignore_eos=True, logprobs=1))[0]
    ids = [*prompt, *out.token_ids]
    got = bench.sequence_logprobs(engine, ids)  # [T - 1, (logprob of the next, argmax)]
    assert got.shape == (len(ids) - 1, 2)
    decoded = got[len(prompt) - 1 :]
    assert decoded[:, 1].long().tolist() == out.token_ids  # argmax at each position
    engine_lp = [step[t] for step, t in zip(out.outputs[0].logprobs, out.token_ids, strict=True)]
    torch.testing.assert_close(decoded[:, 0], torch.tensor(engine_lp), atol=1e-4, rtol=0)
    assert bench.perplexity(engine, ids) == pytest.approx(math.exp(-float(got[:, 0].mean())))


def test_the_report_has_speed_agreement_and_perplexity(bench, tiny_model: Path,  # type: ignore[no-untyped-def]
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    assert bench.main(["--model", str(tiny_model), "--repeats", "1", "--tokens", "3",
                       "--prompts", "2", "--max-tokens", "6", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "int8 / bf16 speed:" in out and "MB read a step" in out
    assert "teacher-forced" in out and "perplexity of int8_ppl.txt" in out
