"""The engine loop: schedule, run the model, advance requests, detokenize, report.

``step()`` is one iteration of continuous batching; whoever drives it (``LLM.generate`` or the
server's engine thread) calls it while there is work.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from conveyor.config import EngineConfig
from conveyor.core.grammar import GrammarCompiler
from conveyor.core.kv_cache_manager import make_kv_cache_manager
from conveyor.core.request import Request
from conveyor.core.scheduler import Scheduler
from conveyor.core.timeline import BatchTimeline, StepRecord
from conveyor.engine import faults
from conveyor.engine.detokenizer import IncrementalDetokenizer
from conveyor.engine.input_processor import (InputProcessor, Prompt, chat_template_from,
                                             check_chat_template)
from conveyor.engine.output_processor import OutputProcessor, RequestState, SampleState
from conveyor.model.config import ModelConfig
from conveyor.model.kv_cache import cache_storage
from conveyor.model.generation_config import sampling_defaults
from conveyor.model.hub import resolve_model
from conveyor.model.loader import load_model, load_tokenizer
from conveyor.model.rope import longrope_switch
from conveyor.outputs import RequestOutput
from conveyor.sampling_params import PoolingParams, SamplingParams
from conveyor.worker.cpu_share import ThreadGovernor, default_threads
from conveyor.worker.rank import run_worker
from conveyor.worker.runner import ModelRunner, kv_bytes_per_block
from conveyor.worker.tensor_parallel import TensorParallel

logger = logging.getLogger("conveyor")

# what an embedding request is scheduled as: its prompt, and room for one token it never samples
_EMBEDDING = SamplingParams(max_tokens=1)
STEP_HISTORY = 20_000  # per-step records kept for /v1/engine/steps (a few MB at most)


@dataclass(frozen=True)
class KVPool:
    num_blocks: int
    bytes: int          # over all tensor-parallel ranks
    max_model_len: int  # the flag's, else the model's own limit clamped to what the pool holds


def size_kv_pool(config: EngineConfig, model: ModelConfig, kv_dtype: torch.dtype,
                 device: torch.device) -> KVPool:
    """The pool's pages: ``--num-kv-blocks``, else as many as the KV memory holds
    (``--kv-cache-memory``, else a share of the free memory) in caches of ``kv_dtype``."""
    per_block = kv_bytes_per_block(model, config.block_size, kv_dtype,
                                   config.tensor_parallel_size)
    num_blocks = config.num_kv_blocks or config.kv_cache_bytes(device) // per_block
    model_len = config.max_model_len
    if model_len is None:
        model_len = min(model.max_position_embeddings, num_blocks * config.block_size)
    return KVPool(num_blocks, num_blocks * per_block, model_len)


def resident_gib() -> tuple[float, float]:
    """This process's resident memory now and at its peak, in GiB (Linux's VmRSS and VmHWM;
    getrusage's peak would carry a parent's over fork and exec)."""
    with open("/proc/self/status") as f:
        kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)
               if k in ("VmRSS", "VmHWM")}
    return kib["VmRSS"] / 2**20, kib["VmHWM"] / 2**20


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        started = time.monotonic()
        # Workers start first, to load their copy while this rank loads its own.
        self.tensor_parallel = (TensorParallel.start(config, run_worker)
                                if config.tensor_parallel_size > 1 else None)
        threads = config.threads or default_threads()
        torch.set_num_threads(threads)
        # (tensor-parallel ranks keep their count: they meet at every all-reduce as well)
        self.governor = (ThreadGovernor(threads)
                         if config.adaptive_threads and config.tensor_parallel_size == 1
                         and config.torch_device().type == "cpu" else None)
        try:
            self._load(config, started)
        except BaseException:
            self.shutdown()
            raise
        self.steps: deque[StepRecord] = deque(maxlen=STEP_HISTORY)
        self.num_steps = 0
        self.timeline = BatchTimeline(config.max_num_seqs)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler, self.timeline)
        faults.install(self)  # (only under CONVEYOR_FAULT_INJECTION, for tests)
        # The model, tokenizer and libraries loaded so far are permanent: moved out of the
        # cycle collector's sight, its collections only walk what the steps create
        # (docs/results/design-notes#gc-freeze), as vLLM's engine does after start-up.
        gc.collect()
        gc.freeze()

    def _load(self, config: EngineConfig, started: float) -> None:
        path = resolve_model(config.model, config.revision)
        loaded = load_model(path, config.quantization)
        # a repo id is the model's name, as vLLM's (its cache folder is a commit hash)
        self.model_name = loaded.name if path == config.model else config.model
        self.model_path = loaded.path
        self.model_config = loaded.config
        self.tokenizer = (loaded.tokenizer if config.tokenizer is None
                          else load_tokenizer(resolve_model(config.tokenizer)))
        if config.chat_template is not None:
            self.tokenizer.chat_template = chat_template_from(config.chat_template)
        check_chat_template(self.tokenizer, loaded.name)
        # what a request leaves unset, from the model (vLLM's --generation-config auto)
        self.sampling_defaults = sampling_defaults(config.generation_config, loaded.path)
        if self.sampling_defaults:
            logger.info("sampling defaults from the model (--generation-config %s): %s",
                        config.generation_config, self.sampling_defaults)
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        # embeddings: the flag's pooling, else the model's, else the last token's (vLLM's)
        self.pooling_type = config.pooling_type or loaded.config.pooling_type or "last"
        self.grammars = GrammarCompiler(self.tokenizer, loaded.config.vocab_size,
                                        self.eos_token_ids)
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(loaded.config.torch_dtype, self.device)
        self.dtype_reason = config.dtype_reason(loaded.config.torch_dtype, self.device)

        self.kv_dtype = cache_storage(config, self.dtype, self.device, loaded.config.head_dim)
        pool = size_kv_pool(config, loaded.config, self.kv_dtype, self.device)
        num_blocks, model_len = pool.num_blocks, pool.max_model_len
        self.max_model_len = model_len
        self._longrope_from = longrope_switch(loaded.config, model_len)
        self.scheduler = Scheduler(
            config.scheduler_config(model_len),
            make_kv_cache_manager(config.kv_layout, num_blocks, config.block_size, model_len,
                                  config.enable_prefix_caching))
        self.inputs = InputProcessor(self.tokenizer, loaded.name, loaded.config.vocab_size,
                                     model_len, self.scheduler.kv.num_tokens_capacity,
                                     self.grammars)
        setup = dict(dtype=self.dtype, num_blocks=num_blocks, max_model_len=model_len,
                     activation_quant=config.activation_quant,
                     batch_invariant=config.batch_invariant, kv_dtype=self.kv_dtype,
                     attention=config.attention(self.device),
                     graph_rows=config.max_num_seqs if config.decode_graphs(self.device) else 0)
        tp = self.tensor_parallel
        if tp is not None:  # the workers build their shards of the same pool
            tp.send(setup)
        self.runner = ModelRunner(loaded.config, loaded.weights, quantized=loaded.quantized,
                                  device=self.device if tp is None else tp.device,
                                  block_size=config.block_size, seed=config.seed,
                                  tensor_parallel=tp, **setup)
        if tp is not None:
            tp.barrier()
        self.kv_cache_bytes = pool.bytes
        self.load_seconds = time.monotonic() - started  # the file, its weights placed, kernels
        logger.info("loaded %s in %.1f s (resident %.2f GiB, peak %.2f GiB; KV pool %.2f GiB of "
                    "%s, resident as it fills); dtype %s (%s); %s", loaded.name,
                    self.load_seconds, *resident_gib(), self.kv_cache_bytes / 2**30,
                    str(self.kv_dtype).removeprefix("torch."),
                    str(self.dtype).removeprefix("torch."), self.dtype_reason,
                    self.runner.kernel_path)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers; the thread count back to the configured one."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()
        if self.governor is not None:
            self.governor.close()

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Prompt,
                    params: SamplingParams | PoolingParams,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Validate and queue a request (``PoolingParams``: an embedding, under task embed);
        raises ValueError (and queues nothing) on bad input."""
        if request_id in self.output_processor.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.check_request(prompt, params)
        pooling = params if isinstance(params, PoolingParams) else None
        if pooling is not None:  # scheduled as a prompt that samples nothing
            params = _EMBEDDING
        arrival = time.monotonic() if arrival_time is None else arrival_time
        state = RequestState(request_id, text, ids, [], pooling=pooling)
        for i in range(params.n):
            sample_params = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            sample_id = request_id if params.n == 1 else f"{i}_{request_id}"
            request = Request(sample_id, ids, sample_params, self.eos_token_ids, arrival, priority)
            if self._longrope_from is not None and len(ids) > self._longrope_from:
                request.cache_salt = b"long rope"  # (its pages rotated unlike a short prompt's)
            if params.structured_outputs is not None:
                request.grammar = self.grammars.matcher(params.structured_outputs)
                request.grammar_after = params.structured_outputs.after_token
            if state.samples and self.config.enable_prefix_caching:
                request.waits_for_prefill_of = state.samples[0].request
            state.samples.append(SampleState(
                request, IncrementalDetokenizer(self.tokenizer, ids, sample_params.stop_strings),
                [] if sample_params.logprobs is not None else None))
        if pooling is not None:
            state.samples[0].request.pooling = self.pooling_type
        if params.prompt_logprobs is not None:
            state.samples[0].request.prompt_logprobs = params.prompt_logprobs
            state.prompt_logprobs = [None] * len(ids)
        self.output_processor.add(state)
        for sample in state.samples:
            self.scheduler.add_request(sample.request)
            self.timeline.arrive(sample.request)

    def check_request(self, prompt: Prompt, params: SamplingParams | PoolingParams
                      ) -> tuple[str | None, list[int]]:
        """The prompt's text and token ids, checked against the engine's limits and task;
        ValueError naming what is wrong."""
        pooling = isinstance(params, PoolingParams)
        if pooling != (self.config.task == "embed"):
            raise ValueError(f"this engine's task is {self.config.task}: "
                             + ("embeddings need an engine started with task embed "
                                "(conveyor serve --task embed)" if pooling else
                                "it embeds, it does not generate text"))
        return self.inputs.check_request(prompt, _EMBEDDING if pooling else params)

    def abort_request(self, request_id: str) -> None:
        state = self.output_processor.abort(request_id, time.monotonic())
        for sample in state.samples if state is not None else ():
            self.scheduler.abort_request(sample.request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.states)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached pages; refused (False) while requests hold pages."""
        return self.scheduler.kv.pool.reset_cache()

    # -- the step ------------------------------------------------------------------------------
    @property
    def last_batch_size(self) -> int:
        return self.steps[-1].num_scheduled if self.steps else 0

    def steps_since(self, step: int) -> list[StepRecord]:
        """Records of steps numbered >= ``step`` that are still kept (safe from other threads)."""
        return [r for r in list(self.steps) if r.step >= step]

    def step(self) -> list[RequestOutput]:
        """One iteration; returns an output for every request that moved."""
        if self.governor is not None:
            self.governor.update()
        start = time.monotonic()
        sched = self.scheduler.schedule(start)
        for victim in sched.preempted:
            logger.info("preempted %s (%d tokens) to free KV pages", victim.request_id,
                        victim.num_tokens)
            self.output_processor.preempted(victim)
        tp = self.tensor_parallel
        before = (0.0, 0.0) if tp is None else (tp.all_reduce_seconds, tp.communication_seconds)
        moe = getattr(getattr(self.runner, "model", None), "moe_stats", None)
        moe_before = None if moe is None else moe.tolist()
        ran = self.runner.execute(sched)
        now = time.monotonic()
        measured = {} if tp is None else dict(
            all_reduce_seconds=tp.all_reduce_seconds - before[0],
            communication_seconds=tp.communication_seconds - before[1])
        if moe is not None:
            (ns, experts), layers = moe.tolist(), self.runner.model.config.num_layers
            measured.update(moe_seconds=(ns - moe_before[0]) / 1e9,
                            moe_experts=(experts - moe_before[1]) / layers)
        self.timeline.record_step(self.num_steps, start, now, sched.scheduled, sched.preempted)
        advanced = self.scheduler.update_from_output(
            sched, {rid: r.token_id for rid, r in ran.samples.items() if r.error is None}, now)

        outputs = self.output_processor.process(sched, ran, advanced, now)
        end = time.monotonic()
        self.steps.append(StepRecord.of(self.num_steps, end, end - start, self.scheduler, sched,
                                        **measured))
        self.num_steps += 1
        return outputs
