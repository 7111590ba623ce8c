"""Batched sampling: penalties, logit bias, min_tokens, grammar masks, greedy, temperature,
top-k/top-p/min-p, logprobs."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput

if TYPE_CHECKING:
    import xgrammar as xgr


@dataclass(frozen=True)
class SampleRow:
    """One row of logits to sample from and what it needs to know about its sequence."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # per-request seed; None: the engine's generator
    blocked_token_ids: tuple[int, ...]  # EOS / stop ids masked while under min_tokens
    grammar: xgr.GrammarMatcher | None = None  # a constrained sequence's matcher


@dataclass(frozen=True)
class Sampled:
    token: int
    logprobs: dict[int, float] | None  # sampled token and top-k, from the raw logits


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().argmax(dim=-1)


class Sampler:
    """``argmax`` picks the greedy tokens of a batch in which nothing edits the logits; the
    CPU engine passes the C one (``kernels.native.argmax``), which reads bf16 as it is.
    ``structured`` masks the rows of constrained sequences (their ``grammar``)."""

    def __init__(
        self, seed: int, argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax,
        structured: StructuredOutput | None = None,
    ) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.argmax = argmax
        self.structured = structured

    def start_masks(self, rows: list[SampleRow]) -> Future[torch.Tensor] | None:
        """Start filling the grammar masks of ``rows`` (None when none is constrained): call
        it before the forward, and pass the result to the call that samples them."""
        matchers = [r.grammar for r in rows if r.grammar is not None]
        if not matchers:
            return None
        if self.structured is None:
            raise RuntimeError("a constrained row reached a sampler without structured output")
        return self.structured.fill_masks(matchers)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow],
                 masks: Future[torch.Tensor] | None = None) -> list[Sampled]:
        """Sample one token per row of ``logits`` ([N, vocab], the model's dtype; worked on
        in float32, in place when they are float32). ``masks``: from :meth:`start_masks` on
        the same rows (started here when not given)."""
        if all(_plain_greedy(row) for row in rows):  # nothing edits the logits: one argmax
            return [Sampled(token, None) for token in self.argmax(logits).tolist()]
        logits = logits.float()
        raw_logprobs = self._raw_logprobs(logits, rows)
        for i, row in enumerate(rows):
            p = row.params
            if p.has_penalties:
                _apply_penalties(logits[i], row)
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), device=logits.device)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device)
            # Under a grammar, the grammar says when the output may end.
            if (row.blocked_token_ids and row.grammar is None
                    and len(row.output_token_ids) < p.min_tokens):
                logits[i, list(row.blocked_token_ids)] = float("-inf")
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        masks = masks or self.start_masks(rows)
        if masks is not None and self.structured is not None:
            self.structured.apply_masks(logits, constrained, masks.result())

        tokens = torch.empty(len(rows), dtype=torch.long)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if greedy:
            tokens[greedy] = logits[greedy].argmax(dim=-1)
        random = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random:
            tokens[random] = self._sample_random(logits[random], [rows[i] for i in random])

        token_list = tokens.tolist()
        out = []
        for i, (row, token) in enumerate(zip(rows, token_list, strict=True)):
            lp = None
            if raw_logprobs is not None and row.params.logprobs is not None:
                lp = _logprob_dict(raw_logprobs[i], token, row.params.logprobs)
            out.append(Sampled(token, lp))
        return out

    @staticmethod
    def _raw_logprobs(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor | None:
        if not any(r.params.logprobs is not None for r in rows):
            return None
        return torch.log_softmax(logits, dim=-1)

    def _sample_random(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype)
        logits = logits / temps[:, None]
        if any(r.params.top_k or r.params.top_p < 1.0 for r in rows):
            logits = _top_k_top_p(logits, rows)
        probs = torch.softmax(logits, dim=-1)
        min_ps = torch.tensor([r.params.min_p for r in rows], dtype=probs.dtype)
        if bool((min_ps > 0).any()):
            keep = probs >= probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
            probs = torch.where(keep, probs, torch.zeros_like(probs))
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p. E = -log(U) with U
        # uniform: torch's CPU exponential_ is 5x slower than uniform_ and a log. Seeded rows
        # draw their noise from their own generator, so their tokens do not depend on the batch.
        noise = torch.empty_like(probs)
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1]).uniform_(
                generator=self.generator
            )
        for i, r in enumerate(rows):
            if r.generator is not None:
                noise[i].uniform_(generator=r.generator)
        noise.log_().neg_()
        return (probs / noise).argmax(dim=-1)


def _plain_greedy(row: SampleRow) -> bool:
    """Greedy with nothing that edits the logits or reads their distribution."""
    p = row.params
    under_min_tokens = row.blocked_token_ids and len(row.output_token_ids) < p.min_tokens
    return (p.greedy and not p.edits_logits and row.grammar is None and p.logprobs is None
            and not under_min_tokens)


def _apply_penalties(logits: torch.Tensor, row: SampleRow) -> None:  # logits: [vocab]
    p = row.params
    vocab = logits.shape[0]
    output = torch.tensor(row.output_token_ids, dtype=torch.long)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(row.prompt_token_ids + row.output_token_ids, dtype=torch.long).unique()
        values = logits[seen]
        logits[seen] = torch.where(
            values > 0, values / p.repetition_penalty, values * p.repetition_penalty
        )
    if output.numel() and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(output, minlength=vocab).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _top_k_top_p(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([r.params.top_k or vocab for r in rows])
    ranks = torch.arange(vocab)[None, :]
    drop = ranks >= ks[:, None]
    top_ps = torch.tensor([r.params.top_p for r in rows], dtype=logits.dtype)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (the top one stays).
    drop |= (probs.cumsum(dim=-1) - probs) >= top_ps[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _logprob_dict(logprobs: torch.Tensor, token: int, top: int) -> dict[int, float]:
    result = {token: float(logprobs[token])}
    if top:
        values, ids = logprobs.topk(top)
        for tid, value in zip(ids.tolist(), values.tolist(), strict=True):
            result.setdefault(tid, value)
    return result
