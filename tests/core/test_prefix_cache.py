"""Prefix caching, shared pages for n samples, and priority scheduling."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import LLM, SamplingParams
from conveyor.core.block_pool import BlockPool, hash_block
from conveyor.core.kv_cache_manager import KVCacheManager, cdiv
from conveyor.core.request import Request
from conveyor.core.scheduler import Scheduler, SchedulerConfig


# -- the pool with a cache -----------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 24),
       ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "hit"]),
                              st.integers(0, 6)), max_size=120))
def test_cached_pages_are_never_handed_out_for_writing(num_blocks, ops):
    pool = BlockPool(num_blocks)
    held: list[list[int]] = []         # each a holder's pages
    published: dict[bytes, int] = {}   # what we published, as far as we know
    for op, n in ops:
        if op == "alloc" and n <= pool.num_free_blocks:
            fresh = pool.allocate(n)
            for b in fresh:
                assert pool.ref_count(b) == 1  # nobody else holds it...
                assert all(b != v for v in published.values()) or \
                    all(pool.lookup(h) != b for h in published)  # ...and it is no longer cached
            held.append(fresh)
        elif op == "free" and held:
            pool.free(held.pop(n % len(held)))
        elif op == "cache" and held and held[n % len(held)]:
            b = held[n % len(held)][0]
            h = hash_block(None, [b, n])
            pool.cache(b, h)
            published[h] = b
        elif op == "hit" and published:
            h = list(published)[n % len(published)]
            b = pool.lookup(h)
            if b is not None:
                was_free = pool.ref_count(b) == 0
                free_before = pool.num_free_blocks
                pool.touch([b])
                assert pool.num_free_blocks == free_before - was_free
                held.append([b])
        owned = [b for blocks in held for b in blocks]
        assert pool.num_free_blocks + len(set(owned)) == num_blocks
        for b in set(owned):
            assert pool.ref_count(b) == owned.count(b)
    for blocks in held:
        pool.free(blocks)
    assert pool.num_free_blocks == num_blocks and pool.usage == 0


def test_eviction_is_least_recently_freed_and_reset_needs_an_idle_pool():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for blk, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.cache(blk, h)
    pool.free([b])
    pool.free([a])
    assert not pool.reset_cache()          # c is still held
    assert pool.allocate(1) == [b]         # b was freed first: evicted first
    assert pool.lookup(b"b") is None and pool.lookup(b"a") == a
    pool.free([b, c])
    assert pool.reset_cache() and pool.lookup(b"a") is None


# -- the scheduler with shared prefixes ----------------------------------------------------------
@st.composite
def shared_prefix_workloads(draw):
    block_size = draw(st.sampled_from([2, 4]))
    num_blocks = draw(st.integers(12, 48))
    max_model_len = num_blocks * block_size
    prefix = draw(st.lists(st.integers(1, 9), min_size=0, max_size=max_model_len // 3))
    requests = []
    for _ in range(draw(st.integers(1, 12))):
        tail = draw(st.lists(st.integers(1, 9), min_size=1, max_size=6))
        prompt = (prefix + tail)[:max_model_len - 1]
        max_tokens = draw(st.integers(1, max(1, min(8, max_model_len - len(prompt)))))
        requests.append((prompt, max_tokens, draw(st.integers(0, 12)),
                         draw(st.integers(-2, 2))))
    return (block_size, num_blocks, draw(st.integers(1, 6)), draw(st.booleans()),
            draw(st.sampled_from(["fcfs", "priority"])), requests)


@settings(max_examples=150, deadline=None)
@given(shared_prefix_workloads())
def test_shared_pages_are_full_read_only_and_all_come_back(workload):
    block_size, num_blocks, max_num_seqs, caching, order, specs = workload
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs, max_num_seqs + 16, num_blocks * block_size,
                                      scheduling_policy=order), kv)
    reqs = [Request(str(i), p, SamplingParams(max_tokens=m), frozenset(), float(a), priority=pr)
            for i, (p, m, a, pr) in enumerate(specs)]
    rng = random.Random(0)
    for step in range(5000):
        for r in reqs:
            if r.metrics.arrival_time == step:
                sched.add_request(r)
        if not sched.has_unfinished() and step > 12:
            break
        out = sched.schedule(step)
        for r, n in out.scheduled:
            # the pages this step writes into belong to this request alone
            first, last = r.num_computed_tokens // block_size, (r.num_computed_tokens + n - 1) // block_size
            for b in r.block_ids[first:last + 1]:
                assert kv.pool.ref_count(b) == 1, "a shared page would be written"
        owners: dict[int, int] = {}
        for r in sched.running:
            for b in r.block_ids:
                owners[b] = owners.get(b, 0) + 1
        for b, count in owners.items():
            assert kv.pool.ref_count(b) == count
        assert kv.pool.num_free_blocks + len(owners) == num_blocks
        sampled = {r.request_id: rng.randrange(1, 9) for r, n in out.scheduled
                   if r.num_computed_tokens + n == r.num_tokens}
        sched.update_from_output(out, sampled, step)
    else:
        pytest.fail("the workload did not finish")
    assert kv.pool.num_free_blocks == num_blocks
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in reqs)
    if not caching:
        assert kv.prefix_hits == 0


def test_prefix_hit_skips_the_cached_pages_but_computes_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(4, 64, 64), kv)
    a = Request("a", list(range(1, 13)), SamplingParams(max_tokens=2), frozenset(), 0)
    sched.add_request(a)
    out = sched.schedule(0)
    sched.update_from_output(out, {"a": 50}, 0)
    b = Request("b", list(range(1, 13)), SamplingParams(max_tokens=2), frozenset(), 1)
    c = Request("c", list(range(1, 11)) + [77, 78], SamplingParams(max_tokens=2), frozenset(), 1)
    sched.add_request(b)
    sched.add_request(c)
    plan = {r.request_id: n for r, n in sched.schedule(1).scheduled}
    assert b.num_cached_tokens == 8 and plan["b"] == 4    # 12 tokens: 2 pages hit, last computed
    assert c.num_cached_tokens == 8 and plan["c"] == 4    # differs in the 3rd page
    assert b.block_ids[:2] == a.block_ids[:2] and c.block_ids[:2] == a.block_ids[:2]
    assert kv.pool.ref_count(a.block_ids[0]) == 3


def test_pages_are_shared_only_under_the_same_salt():
    """(LongRoPE's long prompts: the same tokens, rotated otherwise)"""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(4, 64, 64), kv)
    a = Request("a", list(range(1, 13)), SamplingParams(max_tokens=2), frozenset(), 0)
    a.cache_salt = b"long rope"
    sched.add_request(a)
    sched.update_from_output(sched.schedule(0), {"a": 50}, 0)
    plain, salted = (Request(i, list(range(1, 13)), SamplingParams(max_tokens=2), frozenset(), 1)
                     for i in "bc")
    salted.cache_salt = a.cache_salt
    sched.add_request(plain)
    sched.add_request(salted)
    sched.schedule(1)
    assert plain.num_cached_tokens == 0 and salted.num_cached_tokens == 8


def test_priority_admits_first_and_preempts_the_lowest():
    kv = KVCacheManager(num_blocks=5, block_size=2)
    sched = Scheduler(SchedulerConfig(2, 64, 10, scheduling_policy="priority"), kv)
    early_low = Request("low0", [1, 2, 3], SamplingParams(max_tokens=6), frozenset(), 0, priority=5)
    sched.add_request(early_low)
    sched.update_from_output(sched.schedule(0), {"low0": 1}, 0)
    later_low = Request("low1", [1, 2], SamplingParams(max_tokens=2), frozenset(), 1, priority=5)
    high = Request("high", [4, 5, 6], SamplingParams(max_tokens=6), frozenset(), 2, priority=-1)
    sched.add_request(later_low)
    sched.add_request(high)
    assert [r.request_id for r in sched.waiting] == ["high", "low1"]  # priority before arrival
    preempted = []
    for step in range(1, 4):
        out = sched.schedule(step)
        preempted += out.preempted
        sched.update_from_output(out, {r.request_id: 1 for r, n in out.scheduled
                                       if r.num_computed_tokens + n == r.num_tokens}, step)
    # at step 3 `high` needs a page and none is free: the low-priority request goes, although it
    # was admitted first and already planned for this step (FCFS would have evicted `high`)
    assert preempted == [early_low] and early_low.metrics.num_preemptions == 1
    assert high.num_output_tokens == 3 and high in sched.running


def test_fcfs_is_unchanged_by_priorities():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    sched = Scheduler(SchedulerConfig(1, 64, 64), kv)
    for i, prio in enumerate([3, -3, 0]):
        sched.add_request(Request(str(i), [1, 2], SamplingParams(max_tokens=1), frozenset(), i,
                                  priority=prio))
    assert [r.request_id for r, _ in sched.schedule(0).scheduled] == ["0"]


# -- with the model ------------------------------------------------------------------------------
SYSTEM = ("You are Conveyor's assistant. Answer briefly, cite the relevant part of the manual, "
          "and never invent a flag that the server does not have. The manual follows. ") * 6


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("prefix-llama"), "llama")


def run(path, caching, num_kv_blocks, prompts, **kw):
    llm = LLM(model=path, dtype="float32", num_kv_blocks=num_kv_blocks, max_model_len=256,
              max_num_seqs=8, max_num_batched_tokens=96, enable_prefix_caching=caching, **kw)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    pool = llm.engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    return llm, outs


def test_greedy_outputs_identical_with_and_without_caching(tiny_llama):
    questions = ["How do I set the port?", "What does max-num-seqs do?", "Is there a GPU path?",
                 "How are pages freed?", "What is chunked prefill?", "Which models load?",
                 "What is a preemption?", "How do I stream?"]
    prompts = [SYSTEM + q for q in questions]
    # a pool small enough that cached pages are evicted and requests preempted mid-run
    _, plain = run(tiny_llama, False, 24, prompts)
    llm, cached = run(tiny_llama, True, 24, prompts)
    kv = llm.engine.scheduler.kv
    assert kv.prefix_hits > 0
    assert sum(o.metrics.num_preemptions for o in cached) > 0
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in plain]
    assert any(o.num_cached_tokens > 0 for o in cached)


def test_n_samples_share_the_prompt_pages(tiny_llama):
    prompt = SYSTEM + "Summarise the manual."
    peak = {}
    for caching in (False, True):
        llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=200, max_model_len=512,
                  enable_prefix_caching=caching)
        params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        assert len(out.outputs) == 4
        peak[caching] = max(s.kv_pages_used for s in llm.engine.steps)
    prompt_pages = cdiv(len(out.prompt_token_ids), 16)
    assert peak[False] >= 4 * prompt_pages
    assert peak[True] <= prompt_pages + 4 * 2  # one shared prompt, a page or two of its own each
    print(f"n=4, prompt of {len(out.prompt_token_ids)} tokens: peak pages {peak[False]} "
          f"without sharing, {peak[True]} with")


def test_high_priority_request_behind_low_ones_runs_first(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=64, max_num_seqs=2,
              scheduling_policy="priority")
    prompts = [f"low priority request number {i}" for i in range(6)] + ["urgent request"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, priority=[1] * 6 + [-10])
    urgent, low = outs[-1], outs[:-1]
    assert urgent.metrics.first_scheduled_time <= min(o.metrics.first_scheduled_time for o in low)
    assert urgent.metrics.finished_time <= min(o.metrics.finished_time for o in low)
