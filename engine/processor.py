"""Text at the edges of the engine: prompts in, stop conditions and outputs out."""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

from transformers import PreTrainedTokenizerBase

from engine.outputs import CompletionOutput, FinishReason, RequestMetrics, RequestOutput
from engine.prompts import Prompt
from engine.runtime import RuntimeInfo
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

# Tokens decoded past the longest stop string when looking for it in new output.
_STOP_WINDOW_EXTRA_TOKENS = 8


class Processor:
    """Turns prompts into validated token ids and finished sequences into ``RequestOutput``s."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, info: RuntimeInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info

    def check_sampling(self, params: SamplingParams) -> None:
        """Raise ``ValueError`` for sampling values this model cannot take: what the sampler
        indexes with must fit its vocabulary (a value that passed the ``SamplingParams`` rules
        but not these would fail its whole step)."""
        vocab = self.info.vocab_size
        outside = sorted(t for t in params.stop_token_ids if t >= vocab)
        if outside:
            raise ValueError(f"stop_token_ids {outside[:5]} are outside the vocabulary "
                             f"(size {vocab})")
        if params.top_k > vocab:
            raise ValueError(f"top_k={params.top_k} exceeds the vocabulary size {vocab}")
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs={params.logprobs} exceeds the vocabulary size {vocab}")
        outside = sorted(t for t in params.logit_bias or {} if t >= vocab)
        if outside:
            raise ValueError(f"logit_bias token ids {outside[:5]} are outside the vocabulary "
                             f"(size {vocab})")

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, validated.

        Raises:
            ValueError: an empty prompt, malformed chat messages, token ids outside the
                vocabulary, or a prompt that leaves no room to generate within
                ``max_model_len``.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            for m in prompt:
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise ValueError("each chat message needs string 'role' and 'content'")
            text = self.tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=False
            )
            token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            token_ids = list(prompt)
            bad = [t for t in token_ids if not 0 <= t < self.info.vocab_size]
            if bad:
                raise ValueError(
                    f"token ids outside the vocabulary [0, {self.info.vocab_size}): {bad[:5]}"
                )
        else:
            raise ValueError("prompt must be a string, a list of token ids or chat messages")
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= self.info.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len {self.info.max_model_len} "
                "leaves no room to generate"
            )
        return token_ids

    def stop_reason(self, seq: Sequence) -> FinishReason | None:
        """Why ``seq`` stops after its newest token (``stop`` / ``length``), or None.

        Raises:
            ValueError: its grammar refused the token it sampled (it fails alone).
        """
        p = seq.params
        if seq.grammar_error is not None:
            raise ValueError(seq.grammar_error)
        if seq.grammar is not None and seq.grammar.is_terminated():
            return FinishReason.STOP  # the grammar is complete and took a stop token
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            last = seq.token_ids[-1]
            if (not p.ignore_eos and last in self.info.eos_token_ids) or (
                last in p.stop_token_ids
            ):
                return FinishReason.STOP
            if p.stop and self._find_stop(seq.output_token_ids, p.stop, tail=True) is not None:
                return FinishReason.STOP
        if n_out >= p.max_tokens or seq.num_tokens >= self.info.max_model_len:
            return FinishReason.LENGTH
        return None

    def _find_stop(self, token_ids: list[int], stops: Seq[str], tail: bool) -> int | None:
        """Index in the decoded text where the first stop string starts, if any."""
        if tail:
            window = max(len(s) for s in stops) + _STOP_WINDOW_EXTRA_TOKENS
            token_ids = token_ids[-window:]
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        return min(hits) if hits else None

    def output(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        seqs: list[Sequence],
        metrics: RequestMetrics,
        finished: bool,
    ) -> RequestOutput:
        """A request's output; finished samples get their text (cut at a stop string)."""
        completions = []
        for seq in sorted(seqs, key=lambda s: s.index):
            out_ids = seq.output_token_ids
            text = ""
            if seq.is_finished:
                text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
                if seq.finish_reason is FinishReason.STOP and seq.params.stop:
                    cut = self._find_stop(out_ids, seq.params.stop, tail=False)
                    text = text if cut is None else text[:cut]
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    token_ids=out_ids,
                    text=text,
                    finish_reason=seq.finish_reason,
                    logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
                    embedding=seq.embedding,
                )
            )
        m = metrics
        if finished:
            m.finish_time = time.monotonic()
            m.num_generated_tokens = sum(len(c.token_ids) for c in completions)
            m.peak_kv_bytes = m.peak_kv_blocks * self.info.kv_bytes_per_block
        return RequestOutput(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=m,
        )

    @staticmethod
    def error_output(request_id: str, error: str) -> RequestOutput:
        """The output of a request that failed before it ran."""
        now = time.monotonic()
        return RequestOutput(
            request_id=request_id,
            prompt_token_ids=[],
            outputs=[CompletionOutput(index=0, token_ids=[], finish_reason=FinishReason.ERROR)],
            finished=True,
            metrics=RequestMetrics(arrival_time=now, finish_time=now),
            error=error,
        )
