"""Pooling: a prompt's final hidden states (after the last norm, before the LM head) into one
L2-normalized embedding, a chunk at a time.

Each chunk of a pooling sequence contributes a *partial* (float32 ``[hidden]``) and the pooled
vector is the sum of its partials: the last row of the final chunk (``last``), the first row
of the chunk that starts at position 0 (``cls``), or each chunk's rows summed and divided by
the prompt length (``mean``). So no state crosses steps but that sum, which the scheduler's
update keeps on the sequence.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from engine.pooling_params import PoolingMethod, PoolingParams

# sentence-transformers' pooling flags (the Pooling module's config.json) and ours
_ST_MODES = {
    "pooling_mode_lasttoken": PoolingMethod.LAST,
    "pooling_mode_mean_tokens": PoolingMethod.MEAN,
    "pooling_mode_cls_token": PoolingMethod.CLS,
}


@dataclass(frozen=True)
class PoolingConfig:
    """How this model pools and which truncated ``dimensions`` it allows.

    ``matryoshka_dimensions``: None when the model was not trained for truncation (any
    ``dimensions`` is refused); empty when any width up to ``hidden_size`` is allowed.
    """

    method: PoolingMethod
    hidden_size: int
    matryoshka_dimensions: frozenset[int] | None = None

    @classmethod
    def of(cls, model_dir: Path, hf_config: PretrainedConfig) -> PoolingConfig:
        """Read from the model directory: sentence-transformers' Pooling module (named by
        ``modules.json``) if there is one, else last-token pooling (as vLLM does for decoder
        LMs); Matryoshka widths from ``config.json``'s ``matryoshka_dimensions`` or
        ``is_matryoshka`` (vLLM's keys).

        Raises:
            ValueError: the Pooling module asks for a mode this engine does not run.
        """
        hidden = int(hf_config.hidden_size)
        dims = getattr(hf_config, "matryoshka_dimensions", None)
        allowed = (frozenset(int(d) for d in dims) if dims
                   else frozenset() if getattr(hf_config, "is_matryoshka", False) else None)
        return cls(_method(model_dir), hidden, allowed)

    def check(self, params: PoolingParams) -> None:
        """Raise ``ValueError`` for ``dimensions`` this model does not allow."""
        d = params.dimensions
        if d is None:
            return
        if self.matryoshka_dimensions is None:
            raise ValueError(f"dimensions={d}: this model's embeddings cannot be truncated "
                             "(it is not a Matryoshka model); omit dimensions")
        allowed = self.matryoshka_dimensions
        if d > self.hidden_size or (allowed and d not in allowed):
            widths = sorted(allowed) if allowed else f"1..{self.hidden_size}"
            raise ValueError(f"dimensions={d} is not one this model allows: {widths}")

    def partial(self, rows: torch.Tensor, start: int, num_tokens: int) -> torch.Tensor | None:
        """One chunk's share of the pooled vector: ``rows`` ``[n, hidden]`` are the hidden
        states of positions ``[start, start + n)`` of a ``num_tokens``-token prompt; None when
        the chunk holds nothing this method pools."""
        if self.method is PoolingMethod.MEAN:
            return rows.float().sum(dim=0) / num_tokens
        if self.method is PoolingMethod.CLS:
            return rows[0].float() if start == 0 else None
        return rows[-1].float() if start + rows.shape[0] == num_tokens else None

    @property
    def needs_every_row(self) -> bool:
        """Whether every prompt row must be computed (no prefix-cache hits): mean and CLS
        pool rows that a cached prefix would skip."""
        return self.method is not PoolingMethod.LAST


def embedding(pooled: torch.Tensor, dimensions: int | None) -> list[float]:
    """The embedding of a pooled vector: its first ``dimensions`` values (all when None),
    L2-normalized."""
    return F.normalize(pooled[:dimensions], dim=0).tolist()


def _method(model_dir: Path) -> PoolingMethod:
    modules = model_dir / "modules.json"
    if not modules.is_file():
        return PoolingMethod.LAST
    for module in json.loads(modules.read_text()):
        if str(module.get("type", "")).endswith("Pooling"):
            flags = json.loads((model_dir / module["path"] / "config.json").read_text())
            modes = sorted(k for k, v in flags.items() if k.startswith("pooling_mode") and v)
            if len(modes) != 1 or modes[0] not in _ST_MODES:
                raise ValueError(f"{model_dir}: pooling {modes} is not one of last token, mean "
                                 "or CLS")
            return _ST_MODES[modes[0]]
    return PoolingMethod.LAST
