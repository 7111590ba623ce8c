"""Batched sampling: penalties, logit bias, min_tokens, grammar masks, greedy, temperature,
top-k/top-p/min-p, logprobs.

Everything runs on the logits' device; what crosses to the host is the sampled ids and the
requested logprobs (the chosen token's and the top-k), packed in one tensor: one copy and one
sync per step, never the ``[N, vocab]`` logits (128 MB a step for a 128k vocabulary at 256
rows)."""

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
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self.argmax = argmax
        self.structured = structured

    def generator_on(self, device: torch.device) -> torch.Generator:
        """The engine's generator for rows without a seed of their own, on ``device``."""
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device).manual_seed(self.seed)
        return generator

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
        device = logits.device
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

        tokens = torch.empty(len(rows), dtype=torch.long, device=device)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if greedy:
            tokens[greedy] = logits[greedy].argmax(dim=-1)
        random = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random:
            tokens[random] = self._sample_random(logits[random], [rows[i] for i in random])
        return _to_host(tokens, raw_logprobs, rows)

    @staticmethod
    def _raw_logprobs(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor | None:
        if not any(r.params.logprobs is not None for r in rows):
            return None
        return torch.log_softmax(logits, dim=-1)

    def _sample_random(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype,
                             device=device)
        logits = logits / temps[:, None]
        if any(r.params.top_k or r.params.top_p < 1.0 for r in rows):
            logits = _top_k_top_p(logits, rows)
        probs = torch.softmax(logits, dim=-1)
        if any(r.params.min_p > 0 for r in rows):
            min_ps = torch.tensor([r.params.min_p for r in rows], dtype=probs.dtype,
                                  device=device)
            keep = probs >= probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
            probs = torch.where(keep, probs, torch.zeros_like(probs))
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p. E = -log(U) with U
        # uniform: torch's CPU exponential_ is 5x slower than uniform_ and a log. Seeded rows
        # draw their noise from their own generator, so their tokens do not depend on the batch
        # (a request's generator lives on the host: off the CPU its row of noise is drawn there
        # and copied over).
        noise = torch.empty_like(probs)
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1], device=device).uniform_(
                generator=self.generator_on(device)
            )
        for i, r in enumerate(rows):
            if r.generator is not None:
                if r.generator.device == device:
                    noise[i].uniform_(generator=r.generator)
                else:
                    noise[i] = torch.empty(probs.shape[1]).uniform_(generator=r.generator)
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
    output = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(row.prompt_token_ids + row.output_token_ids, dtype=torch.long,
                            device=logits.device).unique()
        values = logits[seen]
        logits[seen] = torch.where(
            values > 0, values / p.repetition_penalty, values * p.repetition_penalty
        )
    if output.numel() and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(output, minlength=vocab).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _top_k_top_p(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    vocab, device = logits.shape[1], logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([r.params.top_k or vocab for r in rows], device=device)
    ranks = torch.arange(vocab, device=device)[None, :]
    drop = ranks >= ks[:, None]
    top_ps = torch.tensor([r.params.top_p for r in rows], dtype=logits.dtype, device=device)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (the top one stays).
    drop |= (probs.cumsum(dim=-1) - probs) >= top_ps[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _to_host(tokens: torch.Tensor, raw_logprobs: torch.Tensor | None,
             rows: list[SampleRow]) -> list[Sampled]:
    """The sampled tokens and requested logprobs, brought to the host in one copy: the tokens,
    then for each row that asked, its token's logprob and its top-k (values, then ids), as
    float64 (exact for both)."""
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if raw_logprobs is None or not want:
        return [Sampled(token, None) for token in tokens.tolist()]
    top = max(rows[i].params.logprobs or 0 for i in want)
    logprobs = raw_logprobs[want]
    chosen = logprobs.gather(1, tokens[want, None])
    values, ids = logprobs.topk(top, dim=-1)
    packed = torch.cat([tokens.double(), chosen.double().flatten(), values.double().flatten(),
                        ids.double().flatten()]).tolist()
    n, w = len(rows), len(want)
    token_list = [int(t) for t in packed[:n]]
    out = [Sampled(token, None) for token in token_list]
    base = n + w
    for j, i in enumerate(want):
        result = {token_list[i]: packed[n + j]}
        row_values = packed[base + j * top: base + (j + 1) * top]
        row_ids = packed[base + w * top + j * top: base + w * top + (j + 1) * top]
        for tid, value in list(zip(row_ids, row_values, strict=True))[:rows[i].params.logprobs]:
            result.setdefault(int(tid), value)
        out[i] = Sampled(token_list[i], result)
    return out
