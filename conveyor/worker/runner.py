"""Runs one scheduled step on the model: builds the flat batch, the paged-attention metadata and
the sampling inputs, then returns each finishing request's next token."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from conveyor.core.grammar import BatchBitmask, bitmask_width
from conveyor.core.request import Request
from conveyor.core.scheduler import SchedulerOutput, samples
from conveyor.kernels.blocks import QuantizedWeight
from conveyor.kernels.library import cpu_kernels, describe
from conveyor.model import huge_pages
from conveyor.model.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from conveyor.model.backend import apply_backend
from conveyor.model.config import ModelConfig
from conveyor.model.families import network
from conveyor.model.rope import longrope_switch, model_rope_tables
from conveyor.worker.sampler import GrammarMask, Sampler, SampleResult, ranked_logprobs
from conveyor.worker.sharding import ffn_granule, kv_heads_per_rank, plan_shards, shard_model
from conveyor.worker.tensor_parallel import TensorParallel

# A chunk's tokens go through the decode kernel as queries of their own (see ModelRunner.plan)
# while their attention work, the contexts its tokens read, is at most this (in the model's
# dtype). Each query reads its whole context, where SDPA reads a block of queries' context once;
# but the step is then one decode-stack call: faster for short chunks, slower past these bounds
# (docs/results/design-notes#unified-chunks).
UNIFIED_CHUNK_WORK = {torch.bfloat16: 256 * 257 // 2, torch.float32: 512 * 513 // 2}

# A decode group is cut where a context needs this many times the pages of the group's shortest
# (so padding at most doubles a group's attention work), once the group has MIN_DECODE_GROUP.
DECODE_GROUP_GROWTH = 2.0
MIN_DECODE_GROUP = 4

# Prompt logprobs take the logits of this many rows at a time (a row is the vocabulary in
# float32: a whole chunk's at once could take gigabytes).
PROMPT_LOGITS_ROWS = 128


def group_decodes(decodes: list[Request]) -> list[list[Request]]:
    """Single-token queries sorted by context pages, in runs of similar length."""
    groups: list[list[Request]] = []
    for r in sorted(decodes, key=lambda r: len(r.block_ids)):
        if groups:
            group = groups[-1]
            if (len(group) < MIN_DECODE_GROUP
                    or len(r.block_ids) <= DECODE_GROUP_GROWTH * len(group[0].block_ids)):
                group.append(r)
                continue
        groups.append([r])
    return groups


@dataclass
class StepPlan:
    """One step's inputs as plain lists: what rank 0 sends the other tensor-parallel ranks
    (no tensors, no requests), from which each builds the same tensors."""

    ids: list[int] = field(default_factory=list)        # flat token ids, decodes first
    rope_rows: list[int] = field(default_factory=list)  # each token's row of the rope tables
    slots: list[int] = field(default_factory=list)      # where each token's K/V is written
    # single-token query groups: (block tables padded to one width, context lengths)
    decode_groups: list[tuple[list[list[int]], list[int]]] = field(default_factory=list)
    # multi-token chunks: (tokens, tokens already cached, pages of the context or None)
    prefills: list[tuple[int, int, list[int] | None]] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)  # the rows that sample
    prompt_rows: list[int] = field(default_factory=list)  # the rows whose prompt logprobs count


@dataclass
class StepResult:
    samples: dict[str, SampleResult]  # by request id, for the requests that sampled
    # by request id: (the position of its first row, [(next token, logprob, rank), top...] per
    # row) for the requests that asked for their prompt's logprobs
    prompt_logprobs: dict[str, tuple[int, list[list[tuple[int, float, int]]]]]
    # by request id, for embedding requests: this step's share of the pooled vector (float32;
    # the sum of its rows for mean pooling)
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype,
                       tensor_parallel_size: int = 1) -> int:
    """A page's bytes, over all tensor-parallel ranks (a replicated KV head counts on each)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    kv_heads = sum(kv_heads_per_rank(config, tensor_parallel_size))
    return 2 * config.num_layers * block_size * kv_heads * config.head_dim * elem


class ModelRunner:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], *,
                 dtype: torch.dtype, device: torch.device, num_blocks: int, block_size: int,
                 max_model_len: int, seed: int,
                 quantized: dict[str, QuantizedWeight] | None = None,
                 tensor_parallel: TensorParallel | None = None,
                 activation_quant: str = "none") -> None:
        """quantized: the GGUF's block-quantized matrices, read by the CPU kernel at small M.
        tensor_parallel: this rank's group; the runner then holds the rank's shard.
        activation_quant: the block linears' inputs as integers (EngineConfig's); it needs the
        CPU kernels (ValueError where they do not run)."""
        self.tensor_parallel = tensor_parallel
        head_rows = None
        if tensor_parallel is not None:
            quantized = quantized or {}
            shards = plan_shards(config, tensor_parallel.world_size,
                                 ffn_granule(config, quantized))
            self.vocab_shares = [len(s.vocab) for s in shards]
            shard = shards[tensor_parallel.rank]
            config, weights, quantized = shard_model(config, weights, quantized, shard)
            head_rows = len(shard.vocab)
        self.config = config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        kernels = cpu_kernels(device, dtype, config.head_dim, activation_quant)
        if kernels is None and activation_quant != "none":
            raise ValueError(f"activation_quant {activation_quant} needs the CPU kernels, which "
                             f"do not run here: "
                             f"{describe(device, dtype, config.head_dim, kernels)}")
        with torch.device("meta"):
            self.model = network(config)(config, head_rows)
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = [(huge_pages.zeros(shape, dtype, device),
                           huge_pages.zeros(shape, dtype, device))
                          for _ in range(config.num_layers)]
        apply_backend(self.model, weights, quantized or {}, dtype=dtype, device=device,
                      kernels=kernels, kv_caches=self.kv_caches,
                      all_reduce=None if tensor_parallel is None else tensor_parallel.all_reduce)
        self.ropes = model_rope_tables(config, max_model_len, dtype, device)
        self.max_model_len = max_model_len
        self.longrope_from = longrope_switch(config, max_model_len)
        self.kernel_path = describe(device, dtype, config.head_dim, kernels)
        self.sampler = (Sampler(config.vocab_size, device, seed) if kernels is None else
                        Sampler(config.vocab_size, device, seed, kernels.argmax_rows,
                                kernels.sample_rows))
        self.decode_kernel = kernels.decode_attention if kernels is not None else None
        # (the kernel rotates whole heads)
        self.rope_kv_write = (kernels.rope_kv_write if kernels is not None
                              and config.rotary_dim is None else None)
        self._bitmask = BatchBitmask()
        self._bitmask_thread = ThreadPoolExecutor(1, thread_name_prefix="conveyor-bitmask")

    def _tensor(self, data: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def _slots(self, request: Request, start: int, end: int) -> list[int]:
        bs, table = self.block_size, request.block_ids
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def plan(self, out: SchedulerOutput) -> tuple[StepPlan, list[Request], list[tuple], list]:
        """The step as plain lists (what tensor-parallel ranks are sent), decodes first, then
        chunks; the requests that sample, in the order of its logits rows; the (request, first
        position, count) of its prompt rows; and (request, first position, count, first row)
        of its embedding requests' tokens."""
        queries = [r for r, n in out.scheduled if n == 1]
        # The kernel takes each context at its own length, so all decodes form one group.
        decode_groups = (group_decodes(queries) if self.decode_kernel is None
                         else [queries] if queries else [])
        decodes = [(r, 1) for group in decode_groups for r in group]
        chunks = [(r, n) for r, n in out.scheduled if n > 1]
        stack = self.model.decode_stack
        # Where the whole step fits the one-call decode stack and no chunk reads much context,
        # the chunks' tokens join the decodes as queries of their own, each attending to the
        # context up to itself (causal by its context length): one C call for the step instead
        # of the layers one by one (docs/results/design-notes#unified-chunks).
        unified = (stack is not None and chunks
                   and len(decodes) + sum(n for _, n in chunks) <= stack.max_rows
                   and all(n * (2 * r.num_computed_tokens + n + 1) // 2
                           <= UNIFIED_CHUNK_WORK.get(self.dtype, 0) for r, n in chunks))
        plan = StepPlan()
        for r, n in decodes + chunks:
            start = r.num_computed_tokens
            plan.ids += r.all_token_ids[start:start + n]
            plan.rope_rows += self._rope_rows(r, start, n)
            plan.slots += self._slots(r, start, start + n)

        # (request, its query's context length), a row each
        query_groups = [[(r, r.num_computed_tokens + 1) for r in g] for g in decode_groups]
        if unified:  # one group (the kernel's): the decodes, then every chunk token
            query_groups = [[row for g in query_groups for row in g]
                            + [(r, r.num_computed_tokens + i + 1) for r, n in chunks
                               for i in range(n)]]
        for group in query_groups:
            width = max(len(r.block_ids) for r, _ in group)
            plan.decode_groups.append(([r.block_ids + [0] * (width - len(r.block_ids))
                                        for r, _ in group], [n for _, n in group]))
        bs = self.block_size
        for r, n in ([] if unified else chunks):
            ctx = r.num_computed_tokens
            plan.prefills.append((n, ctx, r.block_ids[:-(-(ctx + n) // bs)] if ctx else None))

        # A request samples when this step brings its computed tokens level with its tokens.
        # A prompt position's row gives the next prompt token's logprob.
        sampling, spans, pooled, end = [], [], [], 0
        for r, n in decodes + chunks:
            start = r.num_computed_tokens
            count = min(start + n, r.num_prompt_tokens - 1) - start
            if r.prompt_logprobs is not None and count > 0:
                plan.prompt_rows += range(end, end + count)
                spans.append((r, start, count))
            if r.pooling is not None:
                pooled.append((r, start, n, end))
            end += n
            if samples(r, n):
                plan.logits_rows.append(end - 1)
                sampling.append(r)
        return plan, sampling, spans, pooled

    def _rope_rows(self, r: Request, start: int, n: int) -> range | list[int]:
        """The rope rows of the request's tokens at positions start..start + n: the positions,
        moved to the long rows where LongRoPE's long factors rotate them (``longrope_switch``)."""
        pretrained = self.longrope_from
        if pretrained is None or max(r.num_prompt_tokens, start + n) <= pretrained:
            return range(start, start + n)
        if r.num_prompt_tokens > pretrained:  # (a long prompt: all its tokens too)
            return range(self.max_model_len + start, self.max_model_len + start + n)
        # sampled tokens, past the prompt: long from the position that passes the length
        return [p + self.max_model_len * (p >= pretrained) for p in range(start, start + n)]

    def _inputs(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The plan's token ids, positions and attention metadata as tensors."""
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
        ids, rows, meta = self._inputs(plan)
        ropes = [(cos[rows].unsqueeze(1), sin[rows].unsqueeze(1)) for cos, sin in self.ropes]
        return self.model(ids, ropes, self.kv_caches, meta)

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
        plan, sampling, spans, pooled = self.plan(out)
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
