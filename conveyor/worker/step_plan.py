"""A step's inputs as plain lists: which rows the scheduled requests' tokens take, their rope
rows, the KV slots they write, the block tables and context lengths attention reads, and the rows
that sample. Weight-free, so that it is tested on its own; the runner turns it into tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from conveyor.core.request import Request
from conveyor.core.scheduler import SchedulerOutput, samples

# A chunk's tokens go through the decode kernel as queries of their own (see StepPlanner.plan)
# while their attention work, the contexts its tokens read, is at most this (in the model's
# dtype). Each query reads its whole context, where SDPA reads a block of queries' context once;
# but the step is then one decode-stack call: faster for short chunks, slower past these bounds
# (docs/results/design-notes#unified-chunks).
UNIFIED_CHUNK_WORK = {torch.bfloat16: 256 * 257 // 2, torch.float32: 512 * 513 // 2}

# A decode group is cut where a context needs this many times the pages of the group's shortest
# (so padding at most doubles a group's attention work), once the group has MIN_DECODE_GROUP.
DECODE_GROUP_GROWTH = 2.0
MIN_DECODE_GROUP = 4


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

    def sequences(self, block_size: int, width: int | None = None
                  ) -> tuple[list[int], list[int], list[list[int]]]:
        """The step as FlexAttention reads it (``model/flex_attention.py``): each query's
        position and sequence, and each sequence's pages (padded with -1 to ``width``, or to
        the longest): a sequence a single-token query, and one a chunk."""
        positions, owners, tables = [], [], []
        for table, context_lens in self.decode_groups:
            for row, n in zip(table, context_lens):  # (the rows are padded with page 0)
                positions.append(n - 1)
                owners.append(len(tables))
                tables.append(row[:-(-n // block_size)])
        at = len(positions)
        for n, ctx, pages in self.prefills:
            if pages is None:  # a prompt's first chunk: its pages are those its slots are on
                pages = [slot // block_size for slot in self.slots[at:at + n:block_size]]
            positions += range(ctx, ctx + n)
            owners += [len(tables)] * n
            tables.append(pages)
            at += n
        width = width or max(map(len, tables))
        return positions, owners, [t + [-1] * (width - len(t)) for t in tables]


@dataclass
class StepPlanner:
    """What planning needs of the runner: the page size, the dtype (chunk work bounds), the
    rope tables' layout, and how the attention runs (one kernel call for every decode, the
    rows of the one-call decode stack where the model has one, and whether every chunk's tokens
    are queries of their own, batch invariance's one attention for every token)."""

    block_size: int
    dtype: torch.dtype
    max_model_len: int
    longrope_from: int | None  # (rope.longrope_switch)
    one_decode_group: bool     # the decode kernel takes each context at its own length
    stack_rows: int | None     # the decode stack's most rows; None: no decode stack
    every_token_a_query: bool = False  # (needs one_decode_group)

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
        decode_groups = (group_decodes(queries) if not self.one_decode_group
                         else [queries] if queries else [])
        decodes = [(r, 1) for group in decode_groups for r in group]
        chunks = [(r, n) for r, n in out.scheduled if n > 1]
        # Where the whole step fits the one-call decode stack and no chunk reads much context,
        # the chunks' tokens join the decodes as queries of their own, each attending to the
        # context up to itself (causal by its context length): one C call for the step instead
        # of the layers one by one (docs/results/design-notes#unified-chunks).
        unified = chunks and (self.every_token_a_query or (
            self.stack_rows is not None
            and len(decodes) + sum(n for _, n in chunks) <= self.stack_rows
            and all(n * (2 * r.num_computed_tokens + n + 1) // 2
                    <= UNIFIED_CHUNK_WORK.get(self.dtype, 0) for r, n in chunks)))
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
