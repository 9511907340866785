"""Iteration-level scheduler: decides, every step, which requests run and how many tokens each.

There is no prefill/decode distinction. Each step hands out a token budget so that every request's
computed tokens catch up with its known tokens: running requests first (in admission order), then
waiting ones in queue order while seats, budget and pages last. A waiting request starts from the
longest cached prefix of its tokens. A request that cannot get a page evicts a running request
(preemption by recompute): the most recently admitted under FCFS, the lowest priority under
``priority``.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field

from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.core.request import Request, RequestStatus

POLICIES = ("continuous", "static")
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = "continuous"
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs})")


def is_decode(request: Request, num_new_tokens: int) -> bool:
    """A fresh decode: one token after the whole prompt. Anything else is prompt or recompute."""
    return num_new_tokens == 1 and request.num_computed_tokens >= request.num_prompt_tokens


def samples(request: Request, num_new_tokens: int) -> bool:
    """The step samples a token for this request: it brings its computed tokens level with its
    known tokens (a prompt chunk short of the end yields no token; an embedding none)."""
    return (request.num_computed_tokens + num_new_tokens == request.num_tokens
            and request.pooling is None)


@dataclass
class SchedulerOutput:
    """One step's plan: ``(request, num_new_tokens)`` in batch order."""

    scheduled: list[tuple[Request, int]]
    preempted: list[Request] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # since the previous step

    num_decode_tokens: int = 0  # fresh decodes; the rest is prompt or recompute ("prefill")
    # the attention's shape, what a step's cost grows with beyond its token count: KV positions
    # read (each request's context up to its last new token) and query-key pairs (causal)
    num_context_tokens: int = 0
    num_attention_pairs: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class WaitingQueue:
    """FCFS: arrival order, preempted requests back at the front. Priority: ordered by
    (priority, arrival), lower first, preempted requests back in their place."""

    def __init__(self, by_priority: bool) -> None:
        self.by_priority = by_priority
        self._queue: deque[Request] | list[Request] = [] if by_priority else deque()
        self._seq = itertools.count()

    def order_key(self, r: Request) -> tuple:
        if r.queue_seq is None:
            r.queue_seq = next(self._seq)
        return (r.priority, r.metrics.arrival_time, r.queue_seq)

    def push(self, r: Request, front: bool = False) -> None:
        if self.by_priority:
            bisect.insort(self._queue, r, key=self.order_key)
        elif front:
            self._queue.appendleft(r)
        else:
            self._queue.append(r)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.pop(0) if self.by_priority else self._queue.popleft()

    def remove(self, r: Request) -> None:
        self._queue.remove(r)

    def __iter__(self):
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        if config.max_model_len > kv.num_tokens_capacity:
            raise ValueError(
                f"max_model_len {config.max_model_len} does not fit in the KV pool "
                f"({kv.pool.num_blocks} pages x {kv.block_size} tokens = "
                f"{kv.num_tokens_capacity} tokens): lower max_model_len or give the cache more "
                f"memory")
        self.config = config
        self.kv = kv
        self.waiting = WaitingQueue(config.scheduling_policy == "priority")
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self._finished_ids: list[str] = []
        self._static_batch: set[str] = set()

    # -- bookkeeping ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """End a request now (stop string, abort or token-level stop); its pages go back at once."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    # -- the step ------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput(scheduled=[], finished_ids=self._finished_ids)
        self._finished_ids = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, n):
                victim = self._pick_victim()
                j = self.running.index(victim)
                self.running.pop(j)
                if j < i:  # already planned this step: give its budget back
                    k = next(k for k, (r, _) in enumerate(out.scheduled) if r is victim)
                    budget += out.scheduled.pop(k)[1]
                    i -= 1
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, n))
                budget -= n
                i += 1

        if self.config.policy == "static" and not self.running:
            self._static_batch = {r.request_id for r, _ in
                                  zip(self.waiting, range(self.config.max_num_seqs))}
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting.peek()
            if self.config.policy == "static" and request.request_id not in self._static_batch:
                break
            if request.waits_for_prefill_of is not None:
                sibling = request.waits_for_prefill_of
                if not sibling.is_finished and sibling.num_computed_tokens < sibling.num_prompt_tokens:
                    break  # its prompt pages are about to be cached: reuse, don't recompute
                request.waits_for_prefill_of = None
            cached = ([] if request.computes_whole_prompt
                      else self.kv.find_cached_prefix(request))
            hit = len(cached) * self.kv.block_size
            n = min(request.num_tokens - hit, budget)
            if not self.kv.allocate_slots(request, n, cached):
                break
            self.waiting.pop()
            request.num_computed_tokens = hit
            if request.num_cached_tokens is None:
                request.num_cached_tokens = hit
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            out.scheduled.append((request, n))
            budget -= n
        out.num_decode_tokens = sum(1 for r, n in out.scheduled if is_decode(r, n))
        out.num_context_tokens = sum(r.num_computed_tokens + n for r, n in out.scheduled)
        out.num_attention_pairs = sum(n * r.num_computed_tokens + n * (n + 1) // 2
                                      for r, n in out.scheduled)
        return out

    def _pick_victim(self) -> Request:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=self.waiting.order_key)
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.metrics.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.push(request, front=True)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int],
                           now: float) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish what stopped.

        Returns the requests that received a token this step."""
        advanced = []
        for request, n in out.scheduled:
            if request.is_finished:
                continue
            request.num_computed_tokens += n
            self.kv.cache_full_blocks(request)
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.append_output_token(token)
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            advanced.append(request)
            status = request.check_stop(self.config.max_model_len)
            if status is not None:
                self.finish_request(request, status)
        return advanced
