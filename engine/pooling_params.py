"""Per-request pooling parameters: a prompt-only request whose final hidden states become one
embedding. Torch-free; the job schema uses it as a field type (``JobSpec.embedding``), as it
does ``SamplingParams``, so a value is checked where the job is submitted."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

from engine.sampling_params import _PYDANTIC_CONFIG, MAX_INT32


class PoolingMethod(StrEnum):
    """How a prompt's final hidden states become one vector (the model's choice, read by
    ``engine.pooler.PoolingConfig``)."""

    LAST = "last"  # the last token's (decoder LMs: the only one that has seen the whole prompt)
    MEAN = "mean"  # the mean over the prompt's tokens
    CLS = "cls"  # the first token's


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request: the prompt is prefilled only (no token is sampled, no KV kept
    after), its pooled hidden state L2-normalized.

    Args:
        dimensions: keep the first ``dimensions`` values and normalize again (Matryoshka
            truncation); only for models trained for it, else the engine refuses the request.
    """

    __pydantic_config__: ClassVar[dict[str, Any]] = _PYDANTIC_CONFIG

    dimensions: int | None = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int)
                              or not 1 <= d <= MAX_INT32):
            raise ValueError("dimensions must be a positive integer")
