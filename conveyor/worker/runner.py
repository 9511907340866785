"""Runs one scheduled step on the model: builds the flat batch, the paged-attention metadata and
the sampling inputs, then returns each finishing request's next token."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from conveyor.core.grammar import BatchBitmask, bitmask_width
from conveyor.core.request import Request
from conveyor.core.scheduler import SchedulerOutput
from conveyor.kernels.blocks import QuantizedWeight
from conveyor.kernels.library import cpu_kernels, describe
from conveyor.kernels import huge_pages
from conveyor.model.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from conveyor.model.backend import apply_backend
from conveyor.model.config import ModelConfig
from conveyor.model.families import network
from conveyor.model.flex_attention import FlexPages
from conveyor.model.kv_cache import head_bytes, head_width
from conveyor.model.moe import MoETransformer
from conveyor.model.rope import longrope_switch, model_rope_tables
from conveyor.worker.decode_graphs import DecodeGraphs
from conveyor.worker.sampler import GrammarMask, Sampler, SampleResult, ranked_logprobs
from conveyor.worker.sharding import ffn_granules, kv_heads_per_rank, plan_shards, shard_model
from conveyor.worker.step_plan import StepPlan, StepPlanner
from conveyor.worker.tensor_parallel import TensorParallel

# Prompt logprobs take the logits of this many rows at a time (a row is the vocabulary in
# float32: a whole chunk's at once could take gigabytes).
PROMPT_LOGITS_ROWS = 128


@dataclass
class StepResult:
    samples: dict[str, SampleResult]  # by request id, for the requests that sampled
    # by request id: (the position of its first row, [(next token, logprob, rank), top...] per
    # row) for the requests that asked for their prompt's logprobs
    prompt_logprobs: dict[str, tuple[int, list[list[tuple[int, float, int]]]]]
    # by request id, for embedding requests: this step's share of the pooled vector (float32;
    # the sum of its rows for mean pooling)
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)


def kv_bytes_per_block(config: ModelConfig, block_size: int, kv_dtype: torch.dtype,
                       tensor_parallel_size: int = 1) -> int:
    """A page's bytes in caches of ``kv_dtype`` (``kv_cache.kv_storage``), over all
    tensor-parallel ranks (a replicated KV head counts on each)."""
    kv_heads = sum(kv_heads_per_rank(config, tensor_parallel_size))
    return (2 * config.num_layers * block_size * kv_heads
            * head_bytes(config.head_dim, kv_dtype))


class ModelRunner:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], *,
                 dtype: torch.dtype, device: torch.device, num_blocks: int, block_size: int,
                 max_model_len: int, seed: int,
                 quantized: dict[str, QuantizedWeight] | None = None,
                 tensor_parallel: TensorParallel | None = None,
                 activation_quant: str = "none", batch_invariant: bool = False,
                 kv_dtype: torch.dtype | None = None, attention: str = "TORCH_SDPA",
                 graph_rows: int = 0) -> None:
        """quantized: the GGUF's block-quantized matrices, read by the CPU kernel at small M.
        kv_dtype: the caches' (``kv_cache.kv_storage``; None: the model dtype).
        tensor_parallel: this rank's group; the runner then holds the rank's shard.
        activation_quant: the block linears' inputs as integers (EngineConfig's);
        batch_invariant: each row's result independent of the step's other rows
        (EngineConfig's). Both need the CPU kernels (ValueError where they do not run).
        attention: the backend (``EngineConfig.attention``); graph_rows: decode steps of up to
        this many rows are padded to a ladder of sizes and, on CUDA, replayed from graphs
        (``decode_graphs``; FLEX_ATTENTION only; 0: none)."""
        self.tensor_parallel = tensor_parallel
        head_rows = None
        if tensor_parallel is not None:
            quantized = quantized or {}
            shards = plan_shards(config, tensor_parallel.world_size,
                                 *ffn_granules(config, quantized))
            self.vocab_shares = [len(s.vocab) for s in shards]
            shard = shards[tensor_parallel.rank]
            config, weights, quantized = shard_model(config, weights, quantized, shard)
            head_rows = len(shard.vocab)
        self.config = config
        self.device = device
        kernels = cpu_kernels(device, dtype, config.head_dim, activation_quant, batch_invariant)
        for asked, name in ((activation_quant not in ("auto", "none"),
                             f"activation_quant {activation_quant}"),
                            (batch_invariant, "batch_invariant")):
            if kernels is None and asked:
                raise ValueError(f"{name} needs the CPU kernels, which do not run here: "
                                 f"{describe(device, dtype, config.head_dim, kernels)}")
        self.flex = attention == "FLEX_ATTENTION"
        if self.flex and (kv_dtype not in (None, dtype) or batch_invariant):
            raise ValueError("the FLEX_ATTENTION backend reads the cache in the model dtype and "
                             "sums in its own order: kv_cache_dtype int8 (or float16 of a "
                             "float32 model) and batch_invariant need TORCH_SDPA")
        if graph_rows and not self.flex:
            raise ValueError("decode graphs need FLEX_ATTENTION (its metadata is made on the "
                             "device, in the graph)")
        with torch.device("meta"):
            self.model = network(config)(config, head_rows)
        # (the experts' routing reads its counts back to the host each layer: no graph holds it)
        moe_eager = graph_rows > 0 and isinstance(self.model, MoETransformer)
        if moe_eager:
            graph_rows = 0
        kv_dtype = kv_dtype or dtype
        # graphs' padding rows write to a page past the pool's (decode_graphs)
        self.num_pages = num_blocks + (graph_rows > 0)
        shape = (self.num_pages, block_size, config.num_kv_heads,
                 head_width(config.head_dim, kv_dtype))
        self.kv_caches = [(huge_pages.zeros(shape, kv_dtype, device),
                           huge_pages.zeros(shape, kv_dtype, device))
                          for _ in range(config.num_layers)]
        apply_backend(self.model, weights, quantized or {}, dtype=dtype, device=device,
                      kernels=kernels, kv_caches=self.kv_caches,
                      all_reduce=None if tensor_parallel is None else tensor_parallel.all_reduce,
                      batch_invariant=batch_invariant, decode_stack=not self.flex)
        self.ropes = model_rope_tables(config, max_model_len, dtype, device)
        self.kernel_path = describe(device, dtype, config.head_dim, kernels)
        self.sampler = (Sampler(config.vocab_size, device, seed) if kernels is None else
                        Sampler(config.vocab_size, device, seed, kernels.argmax_rows,
                                kernels.sample_rows))
        self.decode_kernel = (kernels.decode_attention if kernels is not None and not self.flex
                              else None)
        # (the kernel rotates whole heads)
        self.rope_kv_write = (kernels.rope_kv_write if kernels is not None
                              and config.rotary_dim is None else None)
        stack = self.model.decode_stack
        self.planner = StepPlanner(
            block_size, dtype, max_model_len, longrope_switch(config, max_model_len),
            one_decode_group=self.decode_kernel is not None or self.flex,
            stack_rows=None if stack is None else stack.max_rows,
            every_token_a_query=batch_invariant)
        self.block_size = block_size
        self.graphs = None if not graph_rows else DecodeGraphs(
            self._decode_step, graph_rows, -(-max_model_len // block_size),
            scratch_page=num_blocks, block_size=block_size, device=device,
            capture=device.type == "cuda")
        if self.flex:
            self.kernel_path += "; attention by FlexAttention"
        if moe_eager:
            self.kernel_path += ", decode steps eager (a mixture of experts)"
        if self.graphs is not None:
            self.kernel_path += (f", decode steps of up to {graph_rows} rows padded"
                                 + (" and replayed from CUDA graphs" if self.graphs.capture
                                    else ""))
        self._bitmask = BatchBitmask()
        self._bitmask_thread = ThreadPoolExecutor(1, thread_name_prefix="conveyor-bitmask")

    def _tensor(self, data: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def _inputs(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The plan's token ids, positions and attention metadata as tensors (TORCH_SDPA)."""
        groups, offset = [], 0
        for table, context_lens in plan.decode_groups:
            # int32, as the kernel reads them (index_select and the mask take int32 too)
            tables = self._tensor(table, torch.int32)
            lens = self._tensor(context_lens, torch.int32)
            groups.append(DecodeGroup(offset, offset + len(table), tables, lens))
            offset += len(table)
        prefills = []
        for n, ctx, pages in plan.prefills:
            prefills.append(PrefillChunk(offset, offset + n, ctx + n,
                                         None if pages is None else self._tensor(pages)))
            offset += n
        meta = AttentionMetadata(self._tensor(plan.slots), groups, prefills, self.decode_kernel,
                                 self.rope_kv_write)
        return self._tensor(plan.ids), self._tensor(plan.rope_rows), meta

    def _start_grammar_mask(self, sampling: list[Request]
                            ) -> tuple[list[int], torch.Tensor, Future] | None:
        """Start filling the constrained rows' bitmask; it runs while the model does."""
        rows = [i for i, r in enumerate(sampling) if r.constrained]
        if not rows:
            return None
        bitmask = torch.empty(len(rows), bitmask_width(self.config.vocab_size),
                              dtype=torch.int32)
        job = self._bitmask_thread.submit(self._bitmask.fill,
                                          [sampling[i].grammar for i in rows], bitmask)
        return rows, bitmask, job

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """The network over the plan's tokens: their last hidden states. Every tensor-parallel
        rank runs this on the same plan, its layers meeting the others' at the all-reduces."""
        if self.graphs is not None and (hidden := self.graphs.run(plan)) is not None:
            return hidden
        if self.flex:
            positions, owners, tables = plan.sequences(self.block_size)
            return self._flex_step(self._tensor(plan.ids), self._tensor(plan.rope_rows),
                                   self._tensor(plan.slots), self._tensor(positions, torch.int32),
                                   self._tensor(owners, torch.int32),
                                   self._tensor(tables, torch.int32))
        return self._network(*self._inputs(plan))

    def _network(self, ids: torch.Tensor, rope_rows: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        ropes = [(cos[rope_rows].unsqueeze(1), sin[rope_rows].unsqueeze(1))
                 for cos, sin in self.ropes]
        return self.model(ids, ropes, self.kv_caches, meta)

    def _decode_step(self, ids: torch.Tensor, rope_rows: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """A step of single-token queries from tensors alone (``DecodeGraphs``' buffers), each
        query its own sequence: what a CUDA graph captures."""
        owners = torch.arange(len(ids), dtype=torch.int32, device=ids.device)
        return self._flex_step(ids, rope_rows, slots, positions, owners, tables)

    def _flex_step(self, ids: torch.Tensor, rope_rows: torch.Tensor, slots: torch.Tensor,
                   positions: torch.Tensor, owners: torch.Tensor,
                   tables: torch.Tensor) -> torch.Tensor:
        """The network with FlexAttention over the step's flat layout (``StepPlan.sequences``)."""
        flex = FlexPages(positions, owners, tables, self.block_size, self.num_pages)
        return self._network(ids, rope_rows, AttentionMetadata(slots, [], [], flex=flex))

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        """These rows' logits, float32; tensor parallel: each rank's share of the vocabulary,
        gathered whole on rank 0 (None on the others)."""
        logits = self.model.compute_logits(hidden[self._tensor(rows)])
        if self.tensor_parallel is None:
            return logits
        return self.tensor_parallel.gather(logits, self.vocab_shares)

    @torch.inference_mode()
    def follow(self, plan: StepPlan) -> None:
        """A tensor-parallel rank above 0: its share of rank 0's step."""
        hidden = self.forward(plan)
        if plan.logits_rows:
            self.logits(hidden, plan.logits_rows)
        for _ in self._prompt_logits(hidden, plan.prompt_rows):  # rank 0's slices' gathers
            pass

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        self.sampler.forget(out.finished_ids)
        if out.is_empty:
            return StepResult({}, {})
        plan, sampling, spans, pooled = self.planner.plan(out)
        if self.tensor_parallel is not None:
            self.tensor_parallel.send(plan)
        pending = self._start_grammar_mask(sampling)
        hidden = self.forward(plan)
        results = []
        if plan.logits_rows:
            logits = self.logits(hidden, plan.logits_rows)
            grammar = None
            if pending is not None:
                rows, bitmask, job = pending
                job.result()
                grammar = GrammarMask(rows, bitmask.to(self.device))
            results = self.sampler(logits, sampling, grammar)
        return StepResult({r.request_id: res for r, res in zip(sampling, results)},
                          self._prompt_logprobs(hidden, plan.prompt_rows, spans),
                          _pool(hidden, pooled))

    def _prompt_logits(self, hidden: torch.Tensor, rows: list[int]):
        """(slice of ``rows``, their logits) a PROMPT_LOGITS_ROWS at a time, on every
        tensor-parallel rank alike (the logits are rank 0's; None on the others)."""
        for i in range(0, len(rows), PROMPT_LOGITS_ROWS):
            at = slice(i, i + PROMPT_LOGITS_ROWS)
            yield at, self.logits(hidden, rows[at])

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: list[int],
                         spans: list[tuple[Request, int, int]]) -> dict:
        """The prompt rows' logprobs of the prompt's next tokens (StepResult.prompt_logprobs),
        from the model's logits as they are, a slice of rows at a time."""
        targets = [r.all_token_ids[p + 1] for r, first, count in spans
                   for p in range(first, first + count)]
        ks = [r.prompt_logprobs for r, _, count in spans for _ in range(count)]
        entries = []
        for rows_at, logits in self._prompt_logits(hidden, rows):
            entries += ranked_logprobs(torch.log_softmax(logits, dim=-1), targets[rows_at],
                                       ks[rows_at])
        found, j = {}, 0
        for r, first, count in spans:
            found[r.request_id] = (first, entries[j:j + count])
            j += count
        return found


def _pool(hidden: torch.Tensor, spans: list[tuple[Request, int, int, int]]
          ) -> dict[str, torch.Tensor]:
    """Each embedding request's share of its vector from this step's rows (StepResult.pooled):
    mean pooling sums every row, cls takes the prompt's first, last its last."""
    found = {}
    for r, start, n, row in spans:
        if r.pooling == "mean":
            found[r.request_id] = hidden[row:row + n].float().sum(dim=0)
        elif r.pooling == "cls" and start == 0:
            found[r.request_id] = hidden[row].float()
        elif r.pooling == "last" and start + n == r.num_prompt_tokens:
            found[r.request_id] = hidden[row + n - 1].float()
    return found
