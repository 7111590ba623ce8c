"""The engine: requests in, one pipeline step at a time, outputs out."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import asdict

import torch
from tqdm import tqdm

from engine.config import EngineConfig
from engine.cuda_graphs import captures_decode_graphs
from engine.isolation import FaultIsolator
from engine.kv_cache import KVCacheManager, cdiv
from engine.lora import LoRAManager
from engine.lora_config import parse_lora_flags
from engine.memory import GiB, kv_budget, swap_bytes
from engine.model_runner import ModelRunner
from engine.models import loader
from engine.models.llama import LlamaForCausalLM
from engine.outputs import EngineStats, FinishReason, RequestMetrics, RequestOutput
from engine.pooler import PoolingConfig
from engine.pooling_params import PoolingParams
from engine.processor import Processor
from engine.prompts import Prompt
from engine.runtime import (
    RuntimeInfo,
    keep_freed_memory,
    resolve_block_size,
    resolve_device,
    resolve_dtype,
    shared_host_cpus,
)
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Request, Sequence
from engine.structured_output import CompileBudget, StructuredOutput
from kernels import get_ops, resolve_backend

log = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.05  # a step with nothing to run but grammars compiling waits this long

Params = SamplingParams | PoolingParams  # a request generates, or embeds its prompt



class LLMEngine:
    """Paged-KV engine with continuous batching, chunked prefill and prefix caching.

    Each :meth:`step` is ``schedule -> run -> update``. :meth:`generate` runs a list of
    prompts to completion; :meth:`add_request` / :meth:`step` / :meth:`abort_request` are the
    streaming core a worker drives.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.cpu_threads is not None:  # process-wide, as torch's own setting is
            torch.set_num_threads(config.cpu_threads)
        device = resolve_device(config)
        block_size = resolve_block_size(config, device)
        dtype = resolve_dtype(config, device)
        gguf = loader.gguf_path(config.model)  # a llama.cpp file, or None: a directory
        model_dir = gguf.parent if gguf else loader.resolve_model_dir(config.model)
        hf_config = loader.load_config(model_dir, gguf)
        self.tokenizer = loader.load_tokenizer(model_dir, gguf)
        max_model_len = _max_model_len(config, hf_config)

        # One backend object for the model's layers and the runner.
        if config.batch_invariant and device.type == "cpu" and dtype == torch.float16:
            raise ValueError("batch_invariant on the CPU takes float32 or bfloat16, not float16")
        backend = get_ops(resolve_backend(config.attention_backend, device),
                          config.batch_invariant)
        torch.manual_seed(config.seed)
        int8 = config.quantization == "int8"
        model = LlamaForCausalLM.empty(
            hf_config, backend, max_model_len, device, dtype, config.quantization,
            **({"int8_group": loader.gguf_int8_group(gguf)} if gguf and int8 else {}))
        model.load_weights(loader.iter_gguf(gguf, hf_config, int8) if gguf  # a tensor at a time
                           else loader.iter_safetensors(  # a shard at a time, each tensor
                               model_dir, into=model.weight_destination))  # in its place
        model.eval()
        if config.pack_cpu_weights:
            model.pack_weights()
        self.lora = LoRAManager(parse_lora_flags(config.lora), model,
                                config.lora_memory_bytes) if config.lora else None

        per_block = (
            2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim
            * dtype.itemsize
        )
        num_blocks = config.num_kv_blocks or max(
            1, kv_budget(config, model, backend, block_size) // per_block
        )
        if num_blocks * block_size < max_model_len:
            log.warning(
                "KV pool holds %d tokens: max_model_len lowered from %d",
                num_blocks * block_size,
                max_model_len,
            )
            max_model_len = num_blocks * block_size
        block_shape = (block_size, model.num_kv_heads, model.head_dim)
        # One block more than the pool hands out: the padding block of graph-replayed decodes.
        kv_caches = torch.zeros(
            (model.num_layers, 2, num_blocks + 1, *block_shape), dtype=dtype, device=device
        )
        num_swap_blocks = swap_bytes(config, device) // per_block
        host_kv_caches = None
        if num_swap_blocks:
            host_kv_caches = torch.empty(
                (model.num_layers, 2, num_swap_blocks, *block_shape), dtype=dtype,
                pin_memory=device.type == "cuda",
            )
        log.info(
            "KV pool: %d blocks of %d tokens (%.2f GiB, %d sequences of max_model_len %d); "
            "swap pool: %d blocks (%.2f GiB)", num_blocks, block_size,
            num_blocks * per_block / GiB, num_blocks * block_size // max_model_len,
            max_model_len, num_swap_blocks, num_swap_blocks * per_block / GiB,
        )
        self.info = RuntimeInfo(
            device=device,
            dtype=dtype,
            attention_backend=backend.name,
            block_size=block_size,
            num_kv_blocks=num_blocks,
            num_swap_blocks=num_swap_blocks,
            kv_bytes_per_block=per_block,
            max_model_len=max_model_len,
            vocab_size=hf_config.vocab_size,
            eos_token_ids=loader.eos_token_ids(model_dir, hf_config, self.tokenizer),
        )
        self.kv = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching,
                                 num_swap_blocks)
        self.processor = Processor(self.tokenizer, self.info)
        self.scheduler = Scheduler(config, self.kv, self.processor.stop_reason)
        self.structured = StructuredOutput(
            self.tokenizer, self.info.vocab_size, self.info.eos_token_ids, native=backend.fused,
            budget=CompileBudget(config.grammar_compile_timeout_s,
                                 config.grammar_compile_memory_bytes))
        self.pooling = PoolingConfig.of(model_dir, hf_config)
        self.runner = ModelRunner(
            model, backend, kv_caches, block_size, self.info.eos_token_ids, config.seed,
            self.structured, host_kv_caches, self.pooling, self.lora,
        )
        self.runner.warm_up()
        if device.type == "cpu":  # after the weights and the KV pool: each step's activations
            keep_freed_memory()
        if captures_decode_graphs(device, config.enforce_eager, backend.name):
            self.runner.enable_decode_graphs(config.max_num_seqs,
                                             cdiv(max_model_len, block_size), capture=True)
        self.isolator = FaultIsolator(self.runner)
        # What times a step's forward and sampling for its requests' gpu_s (a seam: a test
        # gives a clock that ticks a known amount a call).
        self.step_clock: Callable[[], float] = time.monotonic
        self._aborted: list[RequestOutput] = []
        self._compiling: list[Sequence] = []  # waiting for their grammars
        self._arrivals = itertools.count()
        self._lora_waiting: list[Request] = []  # registered, waiting for their adapter to load
        self._lora_pins: dict[str, str] = {}  # request id -> the adapter it holds

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: Params | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> None:
        """Queue a request: a generation, or with ``PoolingParams`` an embedding.

        An embedding request is prefilled only, in the same steps as generations (chunked
        like them), and finishes when its last prompt token is computed: its output's
        ``embedding`` is the prompt's final hidden states pooled as the model's configuration
        says (``PoolingConfig``: last token by default), L2-normalized; no KV is kept after.

        Args:
            request_id: unique among unfinished requests.
            prompt: text, token ids, or chat messages (``[{"role": ..., "content": ...}]``,
                rendered with the tokenizer's chat template).
            params: sampling parameters (defaults: ``SamplingParams()``), or pooling
                parameters for an embedding.
            priority: lower values are scheduled first and preempted last.
            cache_salt: requests share cached prefix blocks only with the same salt.
            lora: the LoRA adapter to run with (``EngineConfig.lora``); None: the base model.
                Requests of different adapters and the base share steps; their cached
                prefix blocks are their adapter's own. While the adapter cannot be loaded
                (``lora_memory_bytes`` held by adapters of running requests) the request
                waits.

        Raises:
            ValueError: a duplicate id, an empty prompt, token ids outside the vocabulary,
                a prompt that leaves no room for one token within ``max_model_len``, more
                parallel samples (``n``) than ``max_num_seqs``, or sampling values this
                model cannot take (``stop_token_ids`` or ``logit_bias`` ids outside its
                vocabulary, ``top_k`` or ``logprobs`` larger than it). A
                ``response_format`` compiles beside the steps (the request waits for it);
                one that does not compile within the budget fails the request alone, its
                output's ``error`` naming why (``GrammarError``). ``dimensions`` on a model
                that does not allow truncation to them. A LoRA adapter this engine does not
                serve.
        """
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora is not None:
            if self.lora is None:
                raise ValueError(f"unknown LoRA adapter {lora!r}: this engine serves none")
            self.lora.check(lora)
        pooling = params if isinstance(params, PoolingParams) else None
        if pooling is not None:
            self.pooling.check(pooling)
            params = SamplingParams()
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams or PoolingParams, got "
                             f"{type(params).__name__}")
        if params.n > self.config.max_num_seqs:
            # Its samples could never run at once: it would wait forever.
            raise ValueError(
                f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}"
            )
        self.processor.check_sampling(params)
        token_ids = self.processor.tokenize(prompt)
        compiled = None
        if params.response_format is not None and params.response_format.constrained:
            compiled = self.structured.compile(params.response_format)
        now = time.monotonic()
        metrics = RequestMetrics(arrival_time=now, num_prompt_tokens=len(token_ids))
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            metrics=metrics,
            priority=priority,
            arrival_order=next(self._arrivals),
            cache_salt=cache_salt,
            lora=lora,
            pending_grammar=compiled,
            pooling=pooling,
            reads_cached_prefix=pooling is None or not self.pooling.needs_every_row,
        )
        request = Request(request_id, token_ids, params, metrics, [seq])
        if lora is not None and not self._acquire_lora(request_id, lora):
            self.scheduler.requests[request_id] = request  # queued once its adapter loads
            self._lora_waiting.append(request)
        else:
            self.scheduler.add_request(request)
        if compiled is not None:
            self._compiling.append(seq)

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks; the next :meth:`step` reports it (``abort``)."""
        req = self.scheduler.requests.pop(request_id, None)
        if req is None:
            return
        live = [s for s in req.seqs if not s.is_finished]
        self.scheduler.finish(live, FinishReason.ABORT)
        self._aborted.append(self._output(req, finished=True))

    @property
    def shared_host_cpus(self) -> int:
        """The host's CPUs where this engine's threads may be split with other workers' on
        the host, else 0 (``engine.runtime.shared_host_cpus``)."""
        return shared_host_cpus(self.config, self.info.device)

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer renders chat messages (a job's plain ``prompt`` then becomes
        one user message)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of a token (its text may hold part of a character); thread-safe."""
        return self.structured.token_bytes(token_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.requests) or bool(self._aborted)

    def num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; return the requests that progressed or finished."""
        self._queue_lora_waiting()
        outputs = self._step()
        for out in outputs:  # a finished request lets go of its adapter
            name = self._lora_pins.pop(out.request_id, None) if out.finished else None
            if name is not None and self.lora is not None:
                self.lora.release(name)
        return outputs

    def _acquire_lora(self, request_id: str, name: str) -> bool:
        assert self.lora is not None
        if not self.lora.acquire(name):
            return False
        self._lora_pins[request_id] = name
        return True

    def _queue_lora_waiting(self) -> None:
        # Requests whose adapter could not load go to the scheduler once it can (aborted
        # ones are dropped), in arrival order.
        waiting, self._lora_waiting = self._lora_waiting, []
        for req in waiting:
            if req.request_id not in self.scheduler.requests:
                continue
            seq = req.seqs[0]
            if seq.lora is not None and self._acquire_lora(req.request_id, seq.lora):
                self.scheduler.add(seq)
            else:
                self._lora_waiting.append(req)

    def _step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        outputs += self._take_grammars()
        if not self.scheduler.has_unfinished():
            if self._lora_waiting:  # cannot happen: only running requests pin adapters
                raise RuntimeError("requests wait for LoRA adapters none runs with")
            return outputs
        batch = self.scheduler.schedule()
        if batch.is_empty:
            if self._compiling:  # nothing runs until a grammar is ready: wait for one
                wait([s.pending_grammar for s in self._compiling if s.pending_grammar],
                     timeout=GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)
            return outputs
        started = self.step_clock()
        result, faults = self.isolator.run(batch)
        self._charge(batch, self.step_clock() - started)
        if faults:
            batch = batch.without(set(faults))
            outputs += [self._fail(request_id, f"failed in the engine step: {error}")
                        for request_id, error in faults.items()]
        update = self.scheduler.update(batch, result)
        # Outputs decode text: what raises there fails its request alone too.
        failed = dict(update.failed)
        for request_id in dict.fromkeys(s.request_id for s in update.progressed):
            if request_id in failed:
                continue
            req = self.scheduler.requests[request_id]
            finished = req.finished
            try:
                outputs.append(self._output(req, finished))
            except Exception as exc:
                failed[request_id] = f"{type(exc).__name__}: {exc}"
                continue
            if finished:
                del self.scheduler.requests[request_id]
        outputs += [self._fail(request_id, f"failed in the engine step: {error}")
                    for request_id, error in failed.items()]
        return outputs

    def _charge(self, batch: SchedulerOutput, step_s: float) -> None:
        """Split a step's time equally among the requests in it (``RequestMetrics.gpu_s``;
        a request's samples are one request): the shares add up to the step's time."""
        request_ids = dict.fromkeys(s.seq.request_id for s in batch.seqs)
        for request_id in request_ids:
            req = self.scheduler.requests.get(request_id)
            if req is not None:
                req.metrics.gpu_s += step_s / len(request_ids)

    def _take_grammars(self) -> list[RequestOutput]:
        """Hand the compiled grammars to their sequences (the scheduler admits them now);
        a request whose format did not compile fails alone."""
        import xgrammar as xgr

        outputs = []
        done = [s for s in self._compiling if s.pending_grammar and s.pending_grammar.done()]
        for seq in done:
            self._compiling.remove(seq)
            future, seq.pending_grammar = seq.pending_grammar, None
            assert future is not None
            if seq.is_finished:  # aborted while it compiled
                continue
            error = future.exception()
            if error is None:
                seq.grammar = xgr.GrammarMatcher(future.result())
            else:
                outputs.append(self._fail(seq.request_id, str(error)))
        return outputs

    def _fail(self, request_id: str, error: str) -> RequestOutput:
        """End a request with ``error``: its blocks are freed, and those only it held leave
        the prefix cache (the forward that should have filled them may not have)."""
        req = self.scheduler.requests.pop(request_id)
        live = [s for s in req.seqs if not s.is_finished]
        for seq in live:
            self.kv.forget(seq)
        self.scheduler.finish(live, FinishReason.ERROR)
        try:
            out = self._output(req, finished=True)
        except Exception:  # its text cannot be decoded either: the error alone
            return Processor.error_output(request_id, error)
        out.error = error
        return out

    def generate(
        self,
        prompts: Seq[Prompt],
        params: Params | Seq[Params] | None = None,
        *,
        use_tqdm: bool = False,
        lora: str | Seq[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; one output per prompt, in input order.

        Args:
            prompts: texts, token-id lists or chat message lists.
            params: one ``SamplingParams`` (or ``PoolingParams``: embeddings) for all
                prompts, or one per prompt (generations and embeddings may mix).
            use_tqdm: show a progress bar.
            lora: the LoRA adapter of every prompt, or one per prompt (None: the base
                model), mixed in the same steps.

        A prompt that is invalid gets an output with ``finish_reason == "error"`` and its
        ``error``; the other prompts still complete.
        """
        if params is None or isinstance(params, SamplingParams | PoolingParams):
            per_prompt = [params or SamplingParams()] * len(prompts)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise ValueError(
                    f"got {len(per_prompt)} parameters for {len(prompts)} prompts"
                )
        ids = [f"generate-{next(self._arrivals)}" for _ in prompts]
        results: dict[str, RequestOutput] = {}
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA adapters for {len(prompts)} prompts")
        for request_id, prompt, p, adapter in zip(ids, prompts, per_prompt, loras, strict=True):
            try:
                self.add_request(request_id, prompt, p, lora=adapter)
            except ValueError as exc:
                results[request_id] = Processor.error_output(request_id, str(exc))
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm, unit="req")
        bar.update(len(results))
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished and out.request_id in ids:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[i] for i in ids]

    def _output(self, req: Request, finished: bool) -> RequestOutput:
        return self.processor.output(
            req.request_id, req.prompt_token_ids, req.seqs, req.metrics, finished
        )

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            **asdict(self.scheduler.counters),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped),
            num_kv_blocks_total=pool.num_blocks,
            num_kv_blocks_free=pool.num_free_blocks,
            kv_usage=pool.usage(),
            kv_bytes_per_block=self.info.kv_bytes_per_block,
            num_grammar_compiles=self.structured.num_compiles,
            cpu_threads=torch.get_num_threads(),
        )


def _max_model_len(config: EngineConfig, hf_config: object) -> int:
    model_max = int(getattr(hf_config, "max_position_embeddings", 2048))
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True):
        # Full attention equals sliding-window attention up to the window; beyond it the
        # engine would compute something else, so it does not go there.
        model_max = min(model_max, int(window))
    if not config.enable_chunked_prefill:
        # A prompt must then fit in one step's token budget.
        model_max = min(model_max, config.max_num_batched_tokens)
    if config.max_model_len is None:
        return model_max
    if config.max_model_len > model_max:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's limit {model_max}"
        )
    return config.max_model_len

