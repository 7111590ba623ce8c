"""Grammar masks in a batch that mixes constrained and unconstrained rows, with a different
format per constrained row, on both mask paths: xgrammar's kernel (``native=False``) and the C
one (``native=True``). Each step, each constrained row keeps exactly the tokens its own
matcher allows and an unconstrained row keeps every logit; at the end each output matches its
own format and each unconstrained output is what its logits give alone.

(``StructuredOutput.apply_masks`` has no Triton path of its own: logits on a GPU go through
xgrammar's kernels, the same call as ``native=False`` here.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.sampler import Sampler, SampleRow
from engine.sampling_params import ResponseFormat
from engine.structured_output import StructuredOutput

CHOICES = ["yes", "no", "maybe"]
OTHER_CHOICES = ["left", "right"]
REGEX = r"[0-9]{3}-[a-z]{2,4}"
SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                           "ok": {"type": "boolean"}},
          "required": ["kind", "ok"], "additionalProperties": False}
# Rows 0, 2, 4, 5 constrained (each its own format), 1 and 3 free.
FORMATS: list[dict | None] = [
    {"type": "choice", "choice": CHOICES},
    None,
    {"type": "regex", "regex": REGEX},
    None,
    {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}},
    {"type": "choice", "choice": OTHER_CHOICES},
]
FREE_TOKENS = 12
MAX_STEPS = 40


def _matches(fmt: dict, text: str) -> bool:
    if fmt["type"] == "choice":
        return text in fmt["choice"]
    if fmt["type"] == "regex":
        return re.fullmatch(fmt["regex"], text) is not None
    value = json.loads(text)
    return set(value) == {"kind", "ok"} and value["kind"] in ("cat", "dog") and isinstance(
        value["ok"], bool)


def _logits(row: int, step: int, vocab: int) -> torch.Tensor:
    # What the model would give row ``row`` at ``step``: fixed, whatever the batch.
    return torch.randn(vocab, generator=torch.Generator().manual_seed(1000 * row + step)) * 3


def _allowed(matcher: xgr.GrammarMatcher, vocab: int) -> torch.Tensor:
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask)
    ids = torch.arange(vocab)
    return ((bitmask[0, ids // 32] >> (ids % 32)) & 1).bool()


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize("native", [False, True], ids=["xgrammar", "native"])
def test_each_row_is_masked_by_its_own_grammar(tokenizer, native: bool) -> None:  # type: ignore[no-untyped-def]
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    structured = StructuredOutput(tokenizer, vocab, frozenset({eos}), native=native)
    sampler = Sampler(seed=0, structured=structured)
    matchers = [structured.matcher(ResponseFormat(**f)) if f else None for f in FORMATS]
    params = [SamplingParams(temperature=0.0, response_format=f) for f in FORMATS]
    outputs: list[list[int]] = [[] for _ in FORMATS]
    done = [False] * len(FORMATS)
    for step in range(MAX_STEPS):
        live = [i for i in range(len(FORMATS)) if not done[i]]
        if not live:
            break
        # Rows leave as they finish, so a row's position in the batch moves.
        raw = torch.stack([_logits(i, step, vocab) for i in live])
        allowed = {j: _allowed(matchers[i], vocab) for j, i in enumerate(live)
                   if matchers[i] is not None}
        rows = [SampleRow(params[i], [1, 2, 3], outputs[i], None, (), grammar=matchers[i])
                for i in live]
        logits = raw.clone()
        sampled = sampler(logits, rows)
        for j, i in enumerate(live):
            token = sampled[j].token
            outputs[i].append(token)
            if matchers[i] is None:
                assert torch.equal(logits[j], raw[j]), f"free row {i} was masked at step {step}"
                done[i] = len(outputs[i]) == FREE_TOKENS
                continue
            assert torch.equal(torch.isfinite(logits[j]), allowed[j]), (i, step)
            assert torch.equal(logits[j][allowed[j]], raw[j][allowed[j]])
            assert matchers[i].accept_token(token), (i, step, token)
            done[i] = matchers[i].is_terminated()
    assert all(done), "a constrained row did not finish"
    for i, fmt in enumerate(FORMATS):
        if fmt is None:  # greedy on its own logits, as alone
            alone = [Sampler(seed=0)(_logits(i, s, vocab)[None], [SampleRow(
                params[i], [1, 2, 3], outputs[i][:s], None, ())])[0].token
                for s in range(FREE_TOKENS)]
            assert outputs[i] == alone
        else:
            assert outputs[i][-1] == eos  # the grammar ended the row
            text = tokenizer.decode(outputs[i], skip_special_tokens=True)
            assert _matches(fmt, text), (i, text)


@pytest.mark.parametrize("backend", ["torch", "cpu"])  # cpu: the C mask kernel
def test_engine_batch_of_constrained_and_free_requests(tiny_model: Path, backend: str) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=128,
                                    attention_backend=backend))
    prompts = ["Pick one:", "The answer is", "Say something.", "x" * 40, "{", "Go"]
    params = [SamplingParams(temperature=0.0, max_tokens=FREE_TOKENS if f is None else 48,
                             ignore_eos=f is None, response_format=f) for f in FORMATS]
    outs = engine.generate(prompts, params)
    for i, (fmt, out) in enumerate(zip(FORMATS, outs, strict=True)):
        if fmt is None:
            (alone,) = engine.generate([prompts[i]], params[i])
            assert out.token_ids == alone.token_ids and len(out.token_ids) == FREE_TOKENS
            assert not _matches_any(out.text)  # a free row is not held to a format
        else:
            assert out.finish_reason == "stop" and _matches(fmt, out.text), (i, out.text)


def _matches_any(text: str) -> bool:
    return text in CHOICES + OTHER_CHOICES or re.fullmatch(REGEX, text) is not None
