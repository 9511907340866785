"""Property-based tests of the block pool and the scheduler, with a fake model in place of torch."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.core.block_pool import BlockPool
from conveyor.core.kv_cache_manager import (
    ContiguousKVCacheManager,
    KVCacheManager,
    cdiv,
    make_kv_cache_manager,
)
from conveyor.core.request import Request, RequestStatus
from conveyor.core.scheduler import Scheduler, SchedulerConfig
from conveyor.core.timeline import DECODE, BatchTimeline
from conveyor.sampling_params import SamplingParams

EOS = 0


# -- BlockPool -----------------------------------------------------------------------------------
@given(num_blocks=st.integers(1, 64), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 8)),
                                                   max_size=200))
def test_block_pool_never_hands_out_a_page_twice(num_blocks, ops):
    pool = BlockPool(num_blocks)
    held: list[list[int]] = []
    for alloc, n in ops:
        if alloc and n <= pool.num_free_blocks:
            blocks = pool.allocate(n)
            held.append(blocks)
        elif alloc:
            with pytest.raises(RuntimeError):
                pool.allocate(n)
        elif held:
            pool.free(held.pop(n % len(held)))
        owned = [b for blocks in held for b in blocks]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert pool.num_free_blocks + len(owned) == num_blocks
        assert all(pool.ref_count(b) == 1 for b in owned)
    for blocks in held:
        pool.free(blocks)
    assert pool.num_free_blocks == num_blocks and pool.usage == 0


def test_block_pool_rejects_double_free():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(RuntimeError):
        pool.free(blocks)


# -- Scheduler with a fake model -----------------------------------------------------------------
@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_blocks = draw(st.integers(4, 80))
    max_model_len = draw(st.integers(2, num_blocks * block_size))
    max_num_seqs = draw(st.integers(1, 12))
    budget = draw(st.integers(max_num_seqs, max_num_seqs + 64))
    policy = draw(st.sampled_from(["continuous", "static"]))
    caching = draw(st.booleans())
    layout = draw(st.sampled_from(["paged", "contiguous"]))
    requests = []
    for _ in range(draw(st.integers(1, 24))):
        prompt = draw(st.integers(1, max_model_len - 1))
        max_tokens = draw(st.integers(1, max_model_len - prompt))
        stop_after = draw(st.integers(1, max_tokens))  # when the fake model emits EOS
        arrival = draw(st.integers(0, 30))
        requests.append((prompt, max_tokens, stop_after, arrival))
    abort = draw(st.lists(st.tuples(st.integers(0, len(requests) - 1), st.integers(0, 60)),
                          max_size=3))
    return (block_size, num_blocks, max_model_len, max_num_seqs, budget, policy, caching, layout,
            requests, abort)


def check_invariants(sched: Scheduler, out, num_blocks: int, block_size: int) -> None:
    cfg = sched.config
    assert out.num_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    scheduled_ids = [r.request_id for r, _ in out.scheduled]
    assert len(scheduled_ids) == len(set(scheduled_ids))
    for r, n in out.scheduled:
        assert n >= 1 and r in sched.running
        assert r.num_computed_tokens + n <= r.num_tokens
        assert len(r.block_ids) >= cdiv(r.num_computed_tokens + n, block_size)
    for r in sched.waiting:
        assert r.block_ids == [] and r.num_computed_tokens == 0
    holders = Counter(b for r in sched.running for b in r.block_ids)
    for b, count in holders.items():  # shared only through the prefix cache, and counted
        assert sched.kv.pool.ref_count(b) == count
    if not sched.kv.pool.enable_caching:
        assert all(count == 1 for count in holders.values()), "a page is owned twice"
    if isinstance(sched.kv, ContiguousKVCacheManager):  # whole, aligned regions
        for r in sched.running:
            first = r.block_ids[0]
            assert first % sched.kv.region_blocks == 0
            assert r.block_ids == list(range(first, first + sched.kv.region_blocks))
    assert sched.kv.pool.num_free_blocks + len(holders) == num_blocks
    pool = sched.kv.pool
    assert pool.num_cached_free_blocks == sum(1 for b in pool._cached.values()
                                              if pool.ref_count(b) == 0)


def check_seating(timeline: BatchTimeline, out, seat_of: dict[str, int]) -> None:
    """Seats are unique within a step, within max_num_seqs, and kept while a sample runs."""
    for r in out.preempted:  # a preempted sample may sit anywhere when it comes back
        seat_of.pop(r.request_id, None)
    rows = timeline.steps[-1].rows()
    slots = [slot for _, slot, _, _ in rows]
    assert len(slots) == len(set(slots)) and all(0 <= s < timeline.num_slots for s in slots)
    for (r, n), (_, slot, tokens, phase) in zip(out.scheduled, rows, strict=True):
        assert tokens == n
        assert seat_of.setdefault(r.request_id, slot) == slot, "a running sample changed seats"
        assert (phase == DECODE) == (n == 1 and r.num_output_tokens > 0
                                     and r.num_computed_tokens == r.num_tokens - 1)


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_scheduler_invariants_fcfs_and_no_leaks(workload):
    (block_size, num_blocks, max_model_len, max_num_seqs, budget, policy, caching, layout, specs,
     aborts) = workload
    kv = make_kv_cache_manager(layout, num_blocks, block_size, max_model_len, caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, policy), kv)
    rng = random.Random(0)
    reqs = [Request(str(i), [rng.randrange(1, 100) for _ in range(p)],
                    SamplingParams(max_tokens=m), frozenset([EOS]), arrival_time=a)
            for i, (p, m, _, a) in enumerate(specs)]
    stop_after = {str(i): s for i, (_, _, s, _) in enumerate(specs)}
    admitted: list[int] = []
    static_batch: set[str] = set()
    timeline = BatchTimeline(max_num_seqs)
    seat_of: dict[str, int] = {}
    bound = sum(p + m for p, m, _, _ in specs) * (len(specs) + 1) + 100

    for step in range(bound):
        for r in reqs:
            if r.metrics.arrival_time == step:
                sched.add_request(r)
                timeline.arrive(r)
        for idx, at in aborts:
            if at == step and reqs[idx].request_id in sched.requests:
                sched.abort_request(reqs[idx].request_id)
                timeline.leave(reqs[idx], step)
        if not sched.has_unfinished() and step > 30:
            break
        running_before = bool(sched.running)
        out = sched.schedule(now=step)
        check_invariants(sched, out, num_blocks, block_size)
        timeline.record_step(step, step, step + 1, out.scheduled, out.preempted)
        check_seating(timeline, out, seat_of)
        for r, _ in out.scheduled:
            if r.metrics.first_scheduled_time == step and int(r.request_id) not in admitted:
                admitted.append(int(r.request_id))
        if policy == "static":
            if not running_before:
                static_batch = set()
            static_batch |= {r.request_id for r, _ in out.scheduled}
            assert len(static_batch) <= max_num_seqs, "static batch took a new request"
        sampled = {}
        for r, n in out.scheduled:
            if r.num_computed_tokens + n == r.num_tokens:
                done = r.num_output_tokens + 1 >= stop_after[r.request_id]
                sampled[r.request_id] = EOS if done else 7
        for r in sched.update_from_output(out, sampled, now=step):
            if r.is_finished:
                timeline.leave(r, step + 1)
    else:
        pytest.fail("requests starved: the workload did not finish")

    arrival_order = sorted(admitted, key=lambda i: (specs[i][3], i))
    assert admitted == arrival_order, "admission was not first-come-first-served"
    assert kv.pool.num_free_blocks == num_blocks, "KV pages leaked"
    assert all(kv.pool.ref_count(b) == 0 for b in range(num_blocks))
    assert sorted(timeline._free_slots) == list(range(max_num_seqs)), "a seat was not freed"
    kinds = Counter(e.kind for e in timeline.events)
    assert kinds["arrive"] == len(reqs) == sum(kinds[k] for k in ("stop", "length", "abort"))
    for r in reqs:
        assert r.is_finished
        if r.status != RequestStatus.FINISHED_ABORTED:
            assert r.num_output_tokens == stop_after[r.request_id]


def test_preemption_evicts_the_newest_and_requeues_it_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    sched = Scheduler(SchedulerConfig(4, 64, max_model_len=8), kv)
    a = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=4), frozenset(), 0)
    b = Request("b", [1, 2, 3, 4], SamplingParams(max_tokens=4), frozenset(), 0)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule(0)  # a and b take 2 pages each: the pool is full
    assert [r.request_id for r, _ in out.scheduled] == ["a", "b"]
    sched.update_from_output(out, {"a": 5, "b": 5}, 0)
    out = sched.schedule(1)  # both need their 3rd page... a gets b's
    assert out.preempted == [b]
    assert [r.request_id for r, _ in out.scheduled] == ["a"]
    assert b.num_computed_tokens == 0 and b.block_ids == [] and b.metrics.num_preemptions == 1
    assert list(sched.waiting) == [b] and b.num_tokens == 5  # its sampled token is kept
    assert sched.num_preemptions_total == 1


def test_max_model_len_must_fit_the_pool():
    with pytest.raises(ValueError, match="max_model_len 100 does not fit"):
        Scheduler(SchedulerConfig(4, 64, max_model_len=100), KVCacheManager(4, 16))


def test_chunked_prefill_shares_the_budget_with_decodes():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(8, 10, max_model_len=200), kv)
    short = Request("s", [1, 2], SamplingParams(max_tokens=50), frozenset(), 0)
    sched.add_request(short)
    out = sched.schedule(0)
    sched.update_from_output(out, {"s": 3}, 0)
    long = Request("l", list(range(1, 26)), SamplingParams(max_tokens=5), frozenset(), 1)
    sched.add_request(long)
    chunks = []
    for step in range(1, 5):
        out = sched.schedule(step)
        plan = {r.request_id: n for r, n in out.scheduled}
        assert plan["s"] == 1  # the decode keeps going every step
        chunks.append(plan.get("l", 0))
        sched.update_from_output(out, {"s": 3} | ({"l": 4} if long.num_computed_tokens +
                                                   plan.get("l", 0) == 25 else {}), step)
    assert chunks == [9, 9, 7, 1]  # 25-token prompt in 9-token chunks, then its first decode
