"""``StructuredOutput.token_bytes`` at the edges of the vocabulary: the last id has its bytes,
the first id past it (and a negative one) has none, and no id raises."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from engine.structured_output import StructuredOutput


def test_ids_outside_the_vocabulary_have_no_bytes(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    vocab = len(tokenizer)
    structured = StructuredOutput(tokenizer, vocab, frozenset({tokenizer.eos_token_id}))
    assert structured.token_bytes(vocab - 1) == tokenizer.decode([vocab - 1]).encode()
    assert structured.token_bytes(vocab) == b""
    assert structured.token_bytes(vocab + 1) == b""
    assert structured.token_bytes(-1) == b""
