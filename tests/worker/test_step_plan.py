"""The step plan without weights: what a real scheduler's output becomes (token rows, rope rows,
KV slots, block tables, context lengths, the rows that sample), step after step of a workload."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.core.request import Request
from conveyor.core.scheduler import Scheduler, SchedulerConfig
from conveyor.sampling_params import SamplingParams
from conveyor.worker.step_plan import (DECODE_GROUP_GROWTH, MIN_DECODE_GROUP, StepPlanner,
                                       UNIFIED_CHUNK_WORK, group_decodes)


def run_workload(planner: StepPlanner, prompts: list[int], max_tokens: int, num_blocks: int,
                 budget: int, seed: int):
    """Every step's (its rows' (request, tokens) in the order the plan must take them, what the
    requests held before it, the plan, the requests that sample); the fake model samples token
    7 + the step number."""
    rng = random.Random(seed)
    sched = Scheduler(SchedulerConfig(8, budget, planner.max_model_len),
                      KVCacheManager(num_blocks, planner.block_size, enable_caching=False))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, n in enumerate(prompts):
        sched.add_request(Request(f"r{i}", [rng.randrange(3, 500) for _ in range(n)], params,
                                  frozenset(), 0.0))
    steps = []
    for step in range(500):
        out = sched.schedule(float(step))
        if out.is_empty and not sched.has_unfinished():
            break
        before = {r.request_id: (r.num_computed_tokens, list(r.all_token_ids), list(r.block_ids))
                  for r, _ in out.scheduled}
        queries = [r for r, n in out.scheduled if n == 1]
        rows = (queries if planner.one_decode_group  # the decodes' row order, then the chunks'
                else [r for g in group_decodes(queries) for r in g])
        rows = [(r, 1) for r in rows] + [(r, n) for r, n in out.scheduled if n > 1]
        plan, sampling, _, _ = planner.plan(out)
        steps.append((rows, before, plan, sampling))
        sched.update_from_output(out, {r.request_id: 7 + step for r in sampling}, float(step))
    assert not sched.has_unfinished()
    return steps


@settings(max_examples=60, deadline=None)
@given(block_size=st.sampled_from([1, 4, 16]), prompts=st.lists(st.integers(1, 60), min_size=1,
                                                                 max_size=8),
       max_tokens=st.integers(1, 12), budget=st.integers(8, 80),
       one_group=st.booleans(), stack_rows=st.sampled_from([None, 4, 64]), seed=st.integers(0, 9),
       every_token_a_query=st.booleans())
def test_every_token_takes_its_row_slot_and_context(block_size, prompts, max_tokens, budget,
                                                    one_group, stack_rows, seed,
                                                    every_token_a_query):
    max_model_len = 80
    planner = StepPlanner(block_size, torch.float32, max_model_len, None, one_group, stack_rows,
                          every_token_a_query=every_token_a_query and one_group)
    num_blocks = 8 * -(-max_model_len // block_size)
    for order, before, plan, sampling in run_workload(planner, prompts, max_tokens, num_blocks,
                                                      budget, seed):
        ids, positions, slots, contexts, tables = [], [], [], [], []
        for r, n in order:
            start, tokens, blocks = before[r.request_id]
            ids += tokens[start:start + n]
            positions += range(start, start + n)
            slots += [blocks[p // block_size] * block_size + p % block_size
                      for p in range(start, start + n)]
            contexts += [(r.request_id, p + 1) for p in range(start, start + n)]
            tables += [(r.request_id, blocks)] * n
        assert plan.ids == ids
        assert plan.rope_rows == positions  # (no LongRoPE: the rows are the positions)
        assert plan.slots == slots and len(set(slots)) == len(slots)  # no slot written twice

        # FlexAttention's view: each row's position, its sequence's pages those of its request
        flex_positions, owners, flex_tables = plan.sequences(block_size)
        assert flex_positions == positions
        for pos, owner, (_, blocks) in zip(flex_positions, owners, tables):
            pages = [p for p in flex_tables[owner] if p >= 0]
            assert len(pages) > pos // block_size and pages == blocks[:len(pages)]
        wide = max(map(len, flex_tables)) + 3  # (the decode graphs' buffers are wider)
        assert plan.sequences(block_size, wide)[2] == [t + [-1] * 3 for t in flex_tables]

        # attention: each query row's block table and context length, or its chunk's
        rows = [(table, ctx) for table, ctx in plan.decode_groups]
        query_rows = [(t, c) for tables_, lens in rows for t, c in zip(tables_, lens)]
        chunk_rows = []
        for n, ctx, pages in plan.prefills:
            chunk_rows += [(pages, ctx + i + 1) for i in range(n)]
        assert len(query_rows) + len(chunk_rows) == len(ids)
        for (table, ctx), (rid, want_ctx), (_, blocks) in zip(query_rows + chunk_rows, contexts,
                                                             tables):
            assert ctx == want_ctx
            if table is None:  # a chunk from its prompt's start: it reads only itself
                continue
            need = -(-ctx // block_size)
            assert table[:need] == blocks[:need]
        for tables_, _ in plan.decode_groups:  # padded to one width
            assert len({len(t) for t in tables_}) == 1
        # batch invariance: every token a query of its own, in one group
        assert not (planner.every_token_a_query and (plan.prefills or len(rows) > 1))
        if plan.prefills and stack_rows is not None:  # not unified: too many rows or too long
            assert (len(ids) > stack_rows or any(
                n * (2 * ctx + n + 1) // 2 > UNIFIED_CHUNK_WORK[torch.float32]
                for n, ctx, _ in plan.prefills))

        # sampling: a request's last row, where the step brings it level with its tokens
        ends = {}
        row = 0
        for r, n in order:
            row += n
            ends[r.request_id] = row - 1
        want = [r for r, n in order if before[r.request_id][0] + n == len(
            before[r.request_id][1])]
        assert [r.request_id for r in sampling] == [r.request_id for r in want]
        assert plan.logits_rows == [ends[r.request_id] for r in want]


@given(pages=st.lists(st.integers(1, 40), max_size=30))
def test_decode_groups_grow_at_most_twofold_once_full(pages):
    requests = []
    for i, n in enumerate(pages):
        r = Request(f"r{i}", [1], SamplingParams(), frozenset(), 0.0)
        r.block_ids = list(range(n))
        requests.append(r)
    groups = group_decodes(requests)
    assert sorted(r.request_id for g in groups for r in g) == sorted(r.request_id
                                                                    for r in requests)
    for g in groups:
        sizes = [len(r.block_ids) for r in g]
        assert sizes == sorted(sizes)
        # past the first MIN_DECODE_GROUP rows, none reads more than twice the shortest's pages
        assert all(s <= DECODE_GROUP_GROWTH * sizes[0] for s in sizes[MIN_DECODE_GROUP:])


def test_short_chunks_join_the_decodes_as_queries_of_their_own():
    """With a decode stack, a step whose chunks are short runs as one group of single-token
    queries: each chunk token attends to the context up to itself."""
    planner = StepPlanner(4, torch.float32, 64, None, True, stack_rows=64)
    _, _, plan, _ = run_workload(planner, [6, 3, 9], 3, 64, 64, 0)[0]
    assert plan.prefills == [] and len(plan.decode_groups) == 1
    _, lens = plan.decode_groups[0]
    assert lens == [1, 2, 3, 4, 5, 6, 1, 2, 3, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    without_stack = StepPlanner(4, torch.float32, 64, None, True, stack_rows=None)
    _, _, plan, _ = run_workload(without_stack, [6, 3, 9], 3, 64, 64, 0)[0]
    assert [(n, ctx, pages) for n, ctx, pages in plan.prefills] == [
        (6, 0, None), (3, 0, None), (9, 0, None)]


def test_longrope_rows_switch_where_transformers_switches():
    """Pretrained at 8 of 32: a prompt past 8 takes the long rows (32 on) for every token; a
    shorter one the short rows until a sampled token's position passes 8."""
    planner = StepPlanner(4, torch.float32, 32, 8, True, stack_rows=None)
    rows = {}
    for order, _, plan, _ in run_workload(planner, [12, 5], 8, 32, 64, 0):
        at = 0
        for r, n in order:
            rows.setdefault(r.request_id, []).extend(plan.rope_rows[at:at + n])
            at += n
    assert rows["r0"] == [32 + p for p in range(12 + 8 - 1)]
    assert rows["r1"] == list(range(8)) + [32 + p for p in range(8, 5 + 8 - 1)]
