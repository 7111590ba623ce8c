"""Grammar-constrained decoding: a request's ``response_format`` as a token mask per step.

xgrammar (the default of vLLM and SGLang) compiles a format into a grammar over the model's
vocabulary; each constrained sequence holds a matcher that follows its output. Per step the
sampler asks for the masks of all its constrained rows at once (filled together, in C++
thread), applies them to the logits on their device, and each sequence's matcher accepts
the token it sampled (``Sequence.append``). The masks of a step are filled on a thread of their
own while the model's forward runs.

Compiled grammars are cached by the format's hash (``ResponseFormat.key``): thousands of jobs
that share one schema compile it once per engine. Preemption keeps a sequence's output and so
its matcher; a forked sample (``n > 1``) gets a copy of its parent's matcher.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from engine.sampling_params import ResponseFormat
from kernels import native

if TYPE_CHECKING:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerBase

# Compiled grammars kept per engine; a schema's grammar is a few hundred kB at most.
CACHE_ENTRIES = 512
# xgrammar prefixes its errors with a time and a source location: "[12:00:00] path.cc:81: ".
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """A response format the grammar library refuses (an unsupported schema, a bad regex)."""


class StructuredOutput:
    """Compiles response formats for one model's vocabulary and fills their token masks.

    Args:
        tokenizer: the model's tokenizer.
        vocab_size: rows of the model's logits (may exceed the tokenizer's own vocabulary).
        stop_token_ids: the tokens that end a sequence whose grammar is complete.
        native: mask float32 CPU logits with the C kernel (``kernels.native.mask_rows_``, the
            engine's fused CPU ops are built); else xgrammar's own kernels apply the masks
            where the logits are (its CUDA/Triton ones for logits on a GPU; today the runner
            samples on the host).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                 stop_token_ids: frozenset[int], native: bool = False) -> None:
        self._tokenizer = tokenizer
        self._native = native
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._info: xgr.TokenizerInfo | None = None  # built at the first use
        self._info_lock = threading.Lock()
        self._vocab: list[bytes] | None = None
        self._compiler: xgr.GrammarCompiler | None = None
        self._batch: xgr.BatchGrammarMatcher | None = None
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0

    def matcher(self, fmt: ResponseFormat) -> xgr.GrammarMatcher:
        """A fresh matcher for ``fmt``; raises :class:`GrammarError` if it cannot compile."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self._compiled(fmt))

    def _compiled(self, fmt: ResponseFormat) -> xgr.CompiledGrammar:
        key = fmt.key
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
            try:
                grammar = self._compile(fmt)
            except RuntimeError as exc:
                raise GrammarError(f"response_format ({fmt.type}): "
                                   f"{_LOCATION.sub('', str(exc)).strip()}") from None
            self.num_compiles += 1
            self._cache[key] = grammar
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return grammar

    def _compile(self, fmt: ResponseFormat) -> xgr.CompiledGrammar:
        compiler = self._get_compiler()
        if fmt.type == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if fmt.type == "json_schema":
            assert fmt.json_schema is not None  # checked by ResponseFormat
            return compiler.compile_json_schema(json.dumps(fmt.json_schema.schema),
                                                any_whitespace=False)
        if fmt.type == "regex":
            assert fmt.regex is not None
            return compiler.compile_regex(fmt.regex)
        if fmt.type == "choice":
            assert fmt.choice is not None
            # EBNF string literals take JSON's escapes.
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in fmt.choice)
            return compiler.compile_grammar(f"root ::= {alternatives}")
        if fmt.type == "grammar":
            assert fmt.grammar is not None
            return compiler.compile_grammar(fmt.grammar)
        raise GrammarError(f"response_format of type {fmt.type!r} has no grammar")

    def _get_compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            import xgrammar as xgr

            self._compiler = xgr.GrammarCompiler(self._tokenizer_info(), max_threads=2)
        return self._compiler

    def _tokenizer_info(self) -> xgr.TokenizerInfo:
        with self._info_lock:
            if self._info is None:
                import xgrammar as xgr

                self._info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_token_ids)
            return self._info

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a byte-level BPE token may hold part of a UTF-8
        character); empty for ids past the tokenizer's own vocabulary."""
        if self._vocab is None:
            info = self._tokenizer_info()
            with self._info_lock:  # xgrammar builds the list anew at each read: once here
                if self._vocab is None:
                    self._vocab = list(info.decoded_vocab)
        vocab = self._vocab
        return vocab[token_id] if 0 <= token_id < len(vocab) else b""

    def fill_masks(self, matchers: list[xgr.GrammarMatcher]) -> Future[torch.Tensor]:
        """Start filling the next-token bitmasks of ``matchers`` (row ``i`` for
        ``matchers[i]``), in one batch call on the grammar thread, so that they are ready
        when the step's logits are: xgrammar releases the GIL, and the model's forward runs
        meanwhile (as vLLM fills them while the GPU runs). The matchers must not accept a
        token until the result is read."""
        return self._filler.submit(self._fill, list(matchers))

    def _fill(self, matchers: list[xgr.GrammarMatcher]) -> torch.Tensor:
        import xgrammar as xgr

        if self._batch is None:
            # One thread: a pool of its own contends with the model's OpenMP threads, which
            # spin between matmuls (measured: 13 ms a step with 2 threads, 0.05 ms with 1).
            self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        return bitmask

    def apply_masks(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
        """Mask, in place, the tokens ``bitmask[i]`` forbids in ``logits[rows[i]]``, on the
        logits' device."""
        if self._native and logits.device.type == "cpu" and logits.dtype == torch.float32:
            native.mask_rows_(logits, bitmask, torch.tensor(rows))
            return
        import xgrammar as xgr

        full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=bitmask.dtype)
        full[rows] = bitmask  # rows without a constraint keep every token (all bits set)
        xgr.apply_token_bitmask_inplace(logits, full.to(logits.device, non_blocking=True),
                                        vocab_size=self.vocab_size)
