"""Who sat where in the batch, step by step: the record the dashboard draws.

Every sample gets a small number (``seq``) when it arrives and, from the step it is first
scheduled until it finishes, is aborted or is preempted, a seat: the lowest free slot of
``max_num_seqs``. One lane per seat then shows the batch as it runs: continuous batching refills a
seat at the next step, a static batch leaves it empty until its longest request ends. No torch here;
bounded, so it can stay on in production (a few tuples per request, a few ints per request-step).
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections import deque
from dataclasses import dataclass

from conveyor.core.request import Request
from conveyor.core.scheduler import Scheduler, SchedulerOutput, is_decode

BATCH_HISTORY = 4096   # steps whose seating is kept
EVENT_HISTORY = 16384  # arrivals, preemptions, finishes kept

PREFILL, DECODE = 0, 1


@dataclass
class StepRecord:
    """What one iteration did: the raw material of occupancy and queue plots."""

    step: int
    time: float              # time.monotonic() at the end of the step
    duration: float          # seconds the step took
    num_scheduled: int       # requests in this step's batch
    num_running: int         # requests holding a seat at the end of the step
    num_waiting: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_context_tokens: int   # KV positions the batch's attention read
    num_attention_pairs: int  # query-key pairs it computed
    kv_pages_used: int
    kv_pages_cached: int     # free pages still holding a reusable prefix
    num_preemptions: int     # in this step
    # tensor parallel: rank 0's time in the all-reduces, and in every collective (all-reduces,
    # the plan's broadcast, the logits' gather)
    all_reduce_seconds: float = 0.0
    communication_seconds: float = 0.0
    # mixtures of experts: the step's time in the MoE layers (router and experts), and the
    # distinct experts a layer ran, on average over the layers
    moe_seconds: float = 0.0
    moe_experts: float = 0.0

    @classmethod
    def of(cls, step: int, time: float, duration: float, scheduler: Scheduler,
           plan: SchedulerOutput, **measured: float) -> StepRecord:
        """The record of a step the scheduler planned as ``plan``, taken after its update (the
        engine's steps and the simulator's alike)."""
        pool = scheduler.kv.pool
        return cls(step=step, time=time, duration=duration, num_scheduled=len(plan.scheduled),
                   num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
                   num_prefill_tokens=plan.num_prefill_tokens,
                   num_decode_tokens=plan.num_decode_tokens,
                   num_context_tokens=plan.num_context_tokens,
                   num_attention_pairs=plan.num_attention_pairs,
                   kv_pages_used=pool.num_used_blocks,
                   kv_pages_cached=pool.num_cached_free_blocks,
                   num_preemptions=len(plan.preempted), **measured)


@dataclass(frozen=True)
class StepSeating:
    """One step's batch, flattened as ``(seq, slot, num_tokens, phase)`` per scheduled sample."""

    step: int
    start: float
    end: float
    entries: array

    def rows(self) -> list[list[int]]:
        e = self.entries
        return [list(e[i:i + 4]) for i in range(0, len(e), 4)]


@dataclass(frozen=True)
class TimelineEvent:
    """``arrive`` (value: prompt tokens), ``preempt`` (value: tokens to recompute), or a finish
    whose kind is the finish reason (value: output tokens)."""

    index: int
    kind: str
    seq: int
    time: float
    value: int
    request_id: str
    arrival: float
    first_token: float | None


class BatchTimeline:
    def __init__(self, max_num_seqs: int) -> None:
        self.num_slots = max_num_seqs
        self.steps: deque[StepSeating] = deque(maxlen=BATCH_HISTORY)
        self.events: deque[TimelineEvent] = deque(maxlen=EVENT_HISTORY)
        self.num_events = 0
        self._seq = itertools.count()
        self._seq_of: dict[str, int] = {}
        self._slot_of: dict[str, int] = {}
        self._free_slots = list(range(max_num_seqs))  # a heap: the lowest seat first

    def _event(self, kind: str, request: Request, time: float, value: int) -> None:
        m = request.metrics
        self.events.append(TimelineEvent(self.num_events, kind, self._seq_of[request.request_id],
                                         time, value, request.request_id, m.arrival_time,
                                         m.first_token_time))
        self.num_events += 1

    def arrive(self, request: Request) -> None:
        self._seq_of[request.request_id] = next(self._seq)
        self._event("arrive", request, request.metrics.arrival_time, request.num_prompt_tokens)

    def _unseat(self, request: Request) -> None:
        slot = self._slot_of.pop(request.request_id, None)
        if slot is not None:
            heapq.heappush(self._free_slots, slot)

    def record_step(self, step: int, start: float, end: float,
                    scheduled: list[tuple[Request, int]], preempted: list[Request]) -> None:
        """Called after the model ran but before the scheduler advanced the requests."""
        for request in preempted:
            self._unseat(request)
            self._event("preempt", request, start, request.num_tokens)
        entries = array("l")
        for request, n in scheduled:
            rid = request.request_id
            slot = self._slot_of.get(rid)
            if slot is None:
                slot = self._slot_of[rid] = heapq.heappop(self._free_slots)
            phase = DECODE if is_decode(request, n) else PREFILL
            entries.extend((self._seq_of[rid], slot, n, phase))
        self.steps.append(StepSeating(step, start, end, entries))

    def leave(self, request: Request, time: float) -> None:
        """A sample finished or was aborted: free its seat and say how it went."""
        if request.request_id not in self._seq_of:
            return
        self._unseat(request)
        self._event(request.finish_reason or "abort", request, time, request.num_output_tokens)
        del self._seq_of[request.request_id]

    def steps_since(self, step: int, not_before: float) -> list[StepSeating]:
        return [s for s in list(self.steps) if s.step >= step and s.end >= not_before]

    def events_since(self, index: int, not_before: float) -> list[TimelineEvent]:
        return [e for e in list(self.events) if e.index >= index and e.time >= not_before]
