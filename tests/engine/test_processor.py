"""The processor on its own: prompt validation at its edges, stop conditions token by token, and
the text and figures of an output, with the byte-level tokenizer of the tiny models (one token
per byte, ChatML specials)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.outputs import FinishReason, RequestMetrics
from engine.processor import Processor
from engine.runtime import RuntimeInfo
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus

MAX_MODEL_LEN = 32
KV_BYTES_PER_BLOCK = 640


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def processor(tokenizer: PreTrainedTokenizerBase) -> Processor:
    info = RuntimeInfo(
        device=torch.device("cpu"), dtype=torch.float32, attention_backend="torch",
        block_size=8, num_kv_blocks=16, num_swap_blocks=0,
        kv_bytes_per_block=KV_BYTES_PER_BLOCK, max_model_len=MAX_MODEL_LEN,
        vocab_size=len(tokenizer), eos_token_ids=frozenset({tokenizer.eos_token_id}),
    )
    return Processor(tokenizer, info)


def ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def sequence(prompt: list[int], params: SamplingParams, index: int = 0) -> Sequence:
    return Sequence(request_id="r", prompt_token_ids=prompt, params=params,
                    metrics=RequestMetrics(arrival_time=1.0), index=index)


def stops_after(processor: Processor, seq: Sequence, tokens: list[int]) -> list[str | None]:
    """The stop reason after each token appended in turn (None: it goes on)."""
    reasons = []
    for token in tokens:
        seq.append(token, None)
        reason = processor.stop_reason(seq)
        reasons.append(None if reason is None else reason.value)
    return reasons


def test_prompts_are_checked_at_the_edges_of_vocabulary_and_context(
    processor: Processor, tokenizer: PreTrainedTokenizerBase
) -> None:
    vocab = processor.info.vocab_size
    assert processor.tokenize([0, vocab - 1]) == [0, vocab - 1]
    for bad in ([vocab], [-1], [3, vocab + 7]):
        with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, {vocab}\)"):
            processor.tokenize(bad)
    with pytest.raises(ValueError, match="must be a string"):
        processor.tokenize([1, True])  # a bool is not a token id
    assert processor.tokenize([5] * (MAX_MODEL_LEN - 1)) == [5] * (MAX_MODEL_LEN - 1)
    with pytest.raises(ValueError, match=f"prompt has {MAX_MODEL_LEN} tokens; max_model_len "
                                         f"{MAX_MODEL_LEN} leaves no room"):
        processor.tokenize([5] * MAX_MODEL_LEN)
    assert processor.tokenize("hi") == ids(tokenizer, "hi")
    chat = processor.tokenize([{"role": "user", "content": "hi"}])
    assert tokenizer.decode(chat) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    for bad_prompt, reason in (("", "prompt is empty"), ([], "prompt is empty"),
                               ([{"role": "user"}], "string 'role' and 'content'"),
                               ([{"role": 1, "content": "x"}], "string 'role' and 'content'")):
        with pytest.raises(ValueError, match=reason):
            processor.tokenize(bad_prompt)  # type: ignore[arg-type]


def test_sampling_values_are_checked_against_the_vocabulary(processor: Processor) -> None:
    vocab = 16  # a vocabulary smaller than the 20 logprobs SamplingParams allows
    processor = Processor(processor.tokenizer, dataclasses.replace(processor.info,
                                                                   vocab_size=vocab))
    processor.check_sampling(SamplingParams(stop_token_ids=[vocab - 1], top_k=vocab,
                                            logprobs=vocab, logit_bias={vocab - 1: 1.0}))
    for params, message in (
        (SamplingParams(stop_token_ids=[1, vocab]), rf"stop_token_ids \[{vocab}\] are outside "
                                                    rf"the vocabulary \(size {vocab}\)"),
        (SamplingParams(top_k=vocab + 1), f"top_k={vocab + 1} exceeds the vocabulary size "
                                          f"{vocab}"),
        (SamplingParams(logprobs=vocab + 1), f"logprobs={vocab + 1} exceeds the vocabulary "
                                             f"size {vocab}"),
        (SamplingParams(logit_bias={vocab: 1.0, 2: 1.0}),
         rf"logit_bias token ids \[{vocab}\] are outside the vocabulary \(size {vocab}\)"),
    ):
        with pytest.raises(ValueError, match=message):
            processor.check_sampling(params)


def test_eos_stop_tokens_and_min_tokens(processor: Processor,
                                        tokenizer: PreTrainedTokenizerBase) -> None:
    eos, a, b = tokenizer.eos_token_id, ids(tokenizer, "a")[0], ids(tokenizer, "b")[0]
    prompt = ids(tokenizer, "xy")
    seq = sequence(prompt, SamplingParams(max_tokens=10))
    assert stops_after(processor, seq, [a, eos]) == [None, "stop"]
    seq = sequence(prompt, SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[b]))
    assert stops_after(processor, seq, [eos, a, b]) == [None, None, "stop"]
    # min_tokens holds back EOS and stop tokens until the output has that many tokens.
    seq = sequence(prompt, SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=[b]))
    assert stops_after(processor, seq, [eos, b, eos]) == [None, None, "stop"]
    seq = sequence(prompt, SamplingParams(max_tokens=10, min_tokens=2, stop=["a"]))
    assert stops_after(processor, seq, [a, a]) == [None, "stop"]


def test_length_is_max_tokens_or_the_context_limit(processor: Processor,
                                                   tokenizer: PreTrainedTokenizerBase) -> None:
    a = ids(tokenizer, "a")[0]
    seq = sequence([a] * 4, SamplingParams(max_tokens=3, ignore_eos=True))
    assert stops_after(processor, seq, [a, a, a]) == [None, None, "length"]
    # Its last token is the context's last position: length, whatever max_tokens says.
    seq = sequence([a] * (MAX_MODEL_LEN - 2), SamplingParams(max_tokens=100, ignore_eos=True))
    assert stops_after(processor, seq, [a, a]) == [None, "length"]
    assert seq.num_tokens == MAX_MODEL_LEN


def test_a_grammar_refusal_fails_the_sequence(processor: Processor) -> None:
    seq = sequence([1, 2], SamplingParams(max_tokens=4))
    seq.append(3, None)
    seq.grammar_error = "token 3 is not allowed by the response_format here"
    with pytest.raises(ValueError, match="token 3 is not allowed"):
        processor.stop_reason(seq)


def finished(seq: Sequence, tokens: list[int], reason: FinishReason) -> Sequence:
    for token in tokens:
        seq.append(token, None)
    seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
    return seq


def test_text_is_cut_at_the_first_stop_string_and_specials_are_not_text(
    processor: Processor, tokenizer: PreTrainedTokenizerBase
) -> None:
    params = SamplingParams(max_tokens=20, stop=["zz", "b"])
    # A special token is not text: the cut is found in the text the output shows.
    out_ids = [*ids(tokenizer, "xa"), tokenizer.eos_token_id, *ids(tokenizer, "cbzzb")]
    seq = finished(sequence([1], params), out_ids, FinishReason.STOP)
    out = processor.output("r", [1], [seq], RequestMetrics(arrival_time=1.0), finished=True)
    assert out.outputs[0].text == "xac"
    assert out.outputs[0].token_ids == out_ids
    # The cut is an index into the whole text, past the window the per-step check decodes.
    seq = finished(sequence([1], SamplingParams(max_tokens=40, stop=["b"])),
                   ids(tokenizer, "x" * 30 + "b"), FinishReason.STOP)
    assert processor.output("r", [1], [seq], RequestMetrics(arrival_time=1.0),
                            finished=True).outputs[0].text == "x" * 30
    # Without a stop string, or when the output ended by length, the text is all of it.
    seq = finished(sequence([1], SamplingParams(max_tokens=20, stop=["q"])),
                   ids(tokenizer, "xab"), FinishReason.STOP)
    assert processor.output("r", [1], [seq], RequestMetrics(arrival_time=1.0),
                            finished=True).outputs[0].text == "xab"
    seq = finished(sequence([1], params), ids(tokenizer, "xab"), FinishReason.LENGTH)
    assert processor.output("r", [1], [seq], RequestMetrics(arrival_time=1.0),
                            finished=True).outputs[0].text == "xab"


def test_an_output_lists_samples_in_order_with_its_figures(
    processor: Processor, tokenizer: PreTrainedTokenizerBase
) -> None:
    params = SamplingParams(n=2, max_tokens=5, logprobs=1)
    second = finished(sequence([1], params, index=1), ids(tokenizer, "abc"), FinishReason.LENGTH)
    second.logprobs = [{7: -0.5}]
    running = sequence([1], params, index=0)
    running.append(ids(tokenizer, "d")[0], {8: -0.25})
    metrics = RequestMetrics(arrival_time=1.0, peak_kv_blocks=3)
    out = processor.output("r", [1], [second, running], metrics, finished=False)
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.text for c in out.outputs] == ["", "abc"]  # text once a sample is finished
    assert out.outputs[0].logprobs == [{8: -0.25}] and out.outputs[1].logprobs == [{7: -0.5}]
    assert not out.finished and metrics.finish_time is None
    assert metrics.num_generated_tokens == 0 and metrics.peak_kv_bytes == 0
    finished(running, ids(tokenizer, "e"), FinishReason.STOP)
    out = processor.output("r", [1], [second, running], metrics, finished=True)
    assert [c.text for c in out.outputs] == ["de", "abc"]
    assert [c.finish_reason for c in out.outputs] == [FinishReason.STOP, FinishReason.LENGTH]
    assert out.finished and out.request_id == "r" and out.prompt_token_ids == [1]
    assert metrics.num_generated_tokens == 5
    assert metrics.peak_kv_bytes == 3 * KV_BYTES_PER_BLOCK
    assert metrics.finish_time is not None and metrics.finish_time > metrics.arrival_time
    # Without logprobs asked, a sample has none (not an empty list).
    plain = finished(sequence([1], SamplingParams(max_tokens=2)), [5], FinishReason.LENGTH)
    assert processor.output("r", [1], [plain], RequestMetrics(arrival_time=1.0),
                            finished=True).outputs[0].logprobs is None


def test_refusals_say_exactly_why(processor: Processor) -> None:
    cases = (("", "prompt is empty"), ([], "prompt is empty"),
             ([{"role": "user"}], "each chat message needs string 'role' and 'content'"),
             ([1, None], "prompt must be a string, a list of token ids or chat messages"))
    for bad_prompt, reason in cases:
        with pytest.raises(ValueError) as refused:
            processor.tokenize(bad_prompt)  # type: ignore[arg-type]
        assert str(refused.value) == reason
    vocab = processor.info.vocab_size
    outside = list(range(vocab, vocab + 7))  # seven out: the message names the first five
    with pytest.raises(ValueError) as refused:
        processor.tokenize(outside)
    assert str(refused.value) == f"token ids outside the vocabulary [0, {vocab}): {outside[:5]}"
    for params, field in ((SamplingParams(stop_token_ids=outside), "stop_token_ids"),
                          (SamplingParams(logit_bias=dict.fromkeys(outside, 1.0)),
                           "logit_bias token ids")):
        with pytest.raises(ValueError) as refused:
            processor.check_sampling(params)
        assert str(refused.value).startswith(f"{field} {outside[:5]} are outside")


def test_a_chat_gets_the_templates_special_tokens_only_once(
        processor: Processor, tokenizer: PreTrainedTokenizerBase) -> None:
    """With a tokenizer that adds a BOS to what it encodes (Llama 3's), the chat template's text
    (which starts with the BOS itself) is encoded without adding another."""
    from tokenizers.processors import TemplateProcessing

    bos_tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    bos = bos_tokenizer.convert_tokens_to_ids("<|im_start|>")
    bos_tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    assert bos_tokenizer.encode("hi")[0] == bos  # it does add one to plain text
    bos_processor = Processor(bos_tokenizer, processor.info)
    chat = [{"role": "user", "content": "hi"}]
    text = bos_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert bos_processor.tokenize(chat) == bos_tokenizer.encode(text, add_special_tokens=False)
    assert bos_processor.tokenize(chat).count(bos) == 2  # the template's two turns, no more


def test_a_stop_string_before_min_tokens_does_not_stop_it_later(
        processor: Processor, tokenizer: PreTrainedTokenizerBase) -> None:
    """Stop strings count from ``min_tokens`` on: one generated long before is not looked for
    again (only the newest tokens are decoded each step), a new one stops it."""
    seq = sequence(ids(tokenizer, "p"), SamplingParams(max_tokens=40, min_tokens=20, stop=["b"]))
    reasons = stops_after(processor, seq, ids(tokenizer, "xb" + "x" * 27 + "b"))
    assert reasons == [None] * 29 + ["stop"]
