"""Generated benchmark workloads (fixed seed): prompt token ids and per-request output lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

WORKLOADS = ("shared-prefix", "mixed", "long-tail")

_WORD_TEXT = (
    "the of and to in is that for it as with was on be by at this from or have an are but not "
    "you all any can had her one our out day get has him his how man new now old see two way "
    "who boy did its let put say she too use data model batch token cache block queue worker "
    "result memory latency prompt system answer question river mountain city window garden "
    "summer winter music paper number group light water history science market energy "
    "problem service research student teacher company program reason moment health "
    "between through during without against because however although therefore quickly "
    "carefully simply clearly exactly usually rarely always never maybe perhaps indeed"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]  # token ids, chat template applied where the workload is chat
    max_tokens: list[int]  # per request; generation ignores EOS so both systems make exactly this

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


def _text(rng: random.Random, tokenizer: PreTrainedTokenizerBase, num_tokens: int) -> str:
    """Random words, about ``num_tokens`` tokens long."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < num_tokens:
        words.extend(rng.choice(_WORDS) for _ in range(max(1, (num_tokens - len(words)) // 2)))
    ids = tokenizer.encode(" ".join(words), add_special_tokens=False)[:num_tokens]
    return tokenizer.decode(ids)


def _chat(tokenizer: PreTrainedTokenizerBase, system: str, user: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": user}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return tokenizer.encode(text, add_special_tokens=False)


def shared_system_workload(name: str, tokenizer: PreTrainedTokenizerBase, num_requests: int,
                           system_tokens: int, user_tokens: tuple[int, int],
                           output_tokens: tuple[int, int], seed: int) -> Workload:
    """Chat requests that share one system prompt of ``system_tokens`` tokens, each with a user
    message and an output length drawn from the given (low, high) ranges."""
    rng = random.Random(f"{name}-{seed}")
    system = _text(rng, tokenizer, system_tokens)
    prompts, max_tokens = [], []
    for _ in range(num_requests):
        prompts.append(_chat(tokenizer, system, _text(rng, tokenizer, rng.randint(*user_tokens))))
        max_tokens.append(rng.randint(*output_tokens))
    return Workload(name, prompts, max_tokens)


def make_workload(
    name: str,
    tokenizer: PreTrainedTokenizerBase,
    num_requests: int,
    max_output: int,
    seed: int,
) -> Workload:
    """Build a workload; output lengths are drawn in [16, 256] and capped at ``max_output``.

    - shared-prefix: chat requests with one ~400-token system prompt, user messages of 20-200
      tokens, outputs of 16-256 tokens.
    - mixed: no shared prefix, prompts of 20-400 tokens, outputs of 16-256 tokens.
    - long-tail: prompts of 20-200 tokens, 90% of outputs 16-48 tokens, 10% 200-256.
    """
    rng = random.Random(f"{name}-{seed}")
    low = min(16, max_output)
    prompts: list[list[int]] = []
    max_tokens: list[int] = []
    if name == "shared-prefix":
        w = shared_system_workload(name, tokenizer, num_requests, 400, (20, 200), (low, 256),
                                   seed)
        prompts, max_tokens = w.prompts, w.max_tokens
    elif name == "mixed":
        for _ in range(num_requests):
            prompts.append(
                tokenizer.encode(_text(rng, tokenizer, rng.randint(20, 400)),
                                 add_special_tokens=False)
            )
            max_tokens.append(rng.randint(low, 256))
    elif name == "long-tail":
        for _ in range(num_requests):
            prompts.append(
                tokenizer.encode(_text(rng, tokenizer, rng.randint(20, 200)),
                                 add_special_tokens=False)
            )
            long = rng.random() < 0.1
            max_tokens.append(rng.randint(200, 256) if long else rng.randint(low, 48))
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
    return Workload(name, prompts, [min(m, max_output) for m in max_tokens])
