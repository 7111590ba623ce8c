"""``StructuredOutput`` without an engine: the masks it fills token by token, which stop tokens
end a complete grammar, the compile cache, and the masks applied on both paths (the C kernel
and xgrammar's) to the rows they belong to."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.sampling_params import ResponseFormat
from engine.structured_output import StructuredOutput


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model)


def allowed(structured: StructuredOutput, matcher: object) -> set[int]:
    """The token ids the matcher allows next."""
    bitmask = structured.fill_masks([matcher]).result()  # type: ignore[list-item]
    logits = torch.zeros(1, structured.vocab_size)
    structured.apply_masks(logits, [0], bitmask)
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_a_complete_grammar_allows_only_the_engines_stop_tokens(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    # The model's stop tokens (its generation config) need not be the tokenizer's EOS.
    stop = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert stop != tokenizer.eos_token_id
    structured = StructuredOutput(tokenizer, len(tokenizer), frozenset({stop}))
    matcher = structured.matcher(ResponseFormat(type="choice", choice=["ab", "ac"]))
    a, b = (tokenizer.convert_tokens_to_ids(c) for c in "ab")
    assert allowed(structured, matcher) == {a}
    assert matcher.accept_token(a)
    assert allowed(structured, matcher) == {b, tokenizer.convert_tokens_to_ids("c")}
    assert matcher.accept_token(b)
    assert allowed(structured, matcher) == {stop}


def test_one_compile_per_format_and_a_failed_one_is_tried_again(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    structured = StructuredOutput(tokenizer, len(tokenizer),
                                  frozenset({tokenizer.eos_token_id}))
    fmt = ResponseFormat(type="regex", regex="[0-9]{2}")
    first = structured.compile(fmt).result()
    assert structured.compile(ResponseFormat(type="regex", regex="[0-9]{2}")).result() is first
    assert structured.num_compiles == 1
    structured.compile(ResponseFormat(type="regex", regex="[a-z]")).result()
    assert structured.num_compiles == 2
    bad = ResponseFormat(type="grammar", grammar='root ::= "a" undefined_rule')
    for _ in range(2):  # not cached: each request gets the compiler's own answer
        with pytest.raises(Exception, match="undefined_rule"):
            structured.compile(bad).result()
    assert structured.num_compiles == 2


@pytest.mark.parametrize("use_native", [True, False], ids=["c-kernel", "xgrammar"])
def test_masks_go_to_their_rows_only(tokenizer: PreTrainedTokenizerBase,
                                     use_native: bool) -> None:
    vocab = len(tokenizer) + 5  # logits wider than the tokenizer: the extra ids are banned
    structured = StructuredOutput(tokenizer, vocab, frozenset({tokenizer.eos_token_id}),
                                  native=use_native)
    digits = structured.matcher(ResponseFormat(type="regex", regex="[0-9]"))
    letters = structured.matcher(ResponseFormat(type="regex", regex="[a-c]"))
    bitmask = structured.fill_masks([digits, letters]).result()
    logits = torch.zeros(4, vocab)
    structured.apply_masks(logits, [3, 1], bitmask)  # row 3: digits, row 1: letters
    kept = [set(torch.nonzero(row == 0).flatten().tolist()) for row in logits]
    ids = tokenizer.convert_tokens_to_ids
    assert kept[3] == {ids(c) for c in "0123456789"}
    assert kept[1] == {ids(c) for c in "abc"}
    assert kept[0] == kept[2] == set(range(vocab))  # unconstrained rows keep every token
    assert all(math.isinf(v) and v < 0 for v in logits[3, ids("a")].reshape(1).tolist())
