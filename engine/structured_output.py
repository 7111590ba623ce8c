"""Grammar-constrained decoding: a request's ``response_format`` as a token mask per step.

xgrammar (the default of vLLM and SGLang) compiles a format into a grammar over the model's
vocabulary; each constrained sequence holds a matcher that follows its output. Per step the
sampler asks for the masks of all its constrained rows at once (filled together, in C++
thread), applies them to the logits on their device, and each sequence's matcher accepts
the token it sampled (``Sequence.append``). The masks of a step are filled on a thread of their
own while the model's forward runs.

Formats compile in a process of their own, within a time and memory budget
(``engine.grammar_process``), while the engine steps; a constrained request waits in the
scheduler until its grammar is ready. Compiled grammars are cached by the format's hash
(``ResponseFormat.key``): thousands of jobs that share one schema compile it once per engine.
Preemption keeps a sequence's output and so its matcher; a forked sample (``n > 1``) gets a
copy of its parent's matcher.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from engine.grammar_process import CompileBudget, GrammarCompiler, GrammarError
from engine.sampling_params import ResponseFormat
from kernels import native

if TYPE_CHECKING:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerBase

# Compiled grammars kept per engine; a schema's grammar is a few hundred kB at most.
CACHE_ENTRIES = 512
DEFAULT_BUDGET = CompileBudget(timeout_s=30.0, memory_bytes=2 << 30)
__all__ = ["CompileBudget", "GrammarError", "StructuredOutput"]


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
        budget: what compiling one format may take (``engine.grammar_process``).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                 stop_token_ids: frozenset[int], native: bool = False,
                 budget: CompileBudget = DEFAULT_BUDGET) -> None:
        self._tokenizer = tokenizer
        self._native = native
        self._budget = budget
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._info: xgr.TokenizerInfo | None = None  # built at the first use
        self._info_lock = threading.Lock()
        self._vocab: list[bytes] | None = None
        self._compiler: GrammarCompiler | None = None
        self._batch: xgr.BatchGrammarMatcher | None = None
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._pending: dict[str, Future[xgr.CompiledGrammar]] = {}
        self._lock = threading.RLock()  # a compile may end while compile() holds it
        self.num_compiles = 0

    def compile(self, fmt: ResponseFormat) -> Future[xgr.CompiledGrammar]:
        """``fmt``'s grammar: done at once when cached, else compiled by the grammar process
        (one compile for all requests that ask for the same format meanwhile). The future
        fails with :class:`GrammarError` if the format cannot compile within the budget."""
        key = fmt.key
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                done: Future[xgr.CompiledGrammar] = Future()
                done.set_result(grammar)
                return done
            future = self._pending.get(key)
            if future is None:
                if self._compiler is None:
                    self._compiler = GrammarCompiler(self._tokenizer_info(), self._budget)
                future = self._pending[key] = self._compiler.submit(fmt)
                future.add_done_callback(lambda f: self._compiled(key, f))
            return future

    def matcher(self, fmt: ResponseFormat) -> xgr.GrammarMatcher:
        """A fresh matcher for ``fmt``, waiting for its compile; raises
        :class:`GrammarError` if it cannot compile."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(fmt).result())

    def _compiled(self, key: str, future: Future[xgr.CompiledGrammar]) -> None:
        with self._lock:
            self._pending.pop(key, None)
            if future.exception() is not None:
                return  # not kept: the next request tries again
            self.num_compiles += 1
            self._cache[key] = future.result()
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)

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
