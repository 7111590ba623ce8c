"""Hugging Face transformers as the reference the engine is checked against."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


@cache
def hf_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(
    model_dir: Path, prompt: list[int], max_new_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and per-step log-softmax ``[steps, vocab]`` (one prompt, no padding)."""
    ids = torch.tensor([prompt])
    out = hf_model(model_dir).generate(
        ids,
        # Explicit: without it generate masks every prompt token equal to pad_token_id.
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    return tokens, logprobs
