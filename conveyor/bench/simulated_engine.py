"""The engine loop in virtual time: the real scheduler, KV cache manager and block pool, with the
forward pass replaced by a step-cost model.

Everything the scheduler decides (admissions, chunked prefill, prefix hits, preemption, either
policy) is the live engine's own code; only a step's duration comes from the cost model, and every
request generates exactly its ``output_len`` tokens (as under ``--ignore-eos``). The clients are
``bench serve``'s: each request is sent at its arrival time, or, under ``max_concurrency``, when
one of that many slots frees (first come, first served, as the benchmark's semaphore does).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from conveyor.bench.client import RequestResult
from conveyor.bench.cost_model import StepShape
from conveyor.core.kv_cache_manager import make_kv_cache_manager
from conveyor.core.request import Request
from conveyor.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, samples
from conveyor.core.timeline import StepRecord
from conveyor.sampling_params import SamplingParams

SIMULATED_TOKEN = 0  # what every simulated step "samples": no request stops on it early


@dataclass(frozen=True)
class SimulatedRequest:
    arrival: float               # seconds after the first request is due
    prompt_token_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class EngineSettings:
    """The ``conveyor serve`` flags the scheduler and the KV pool see."""

    scheduler: SchedulerConfig
    num_blocks: int
    block_size: int = 16
    kv_layout: str = "paged"
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("the KV pool needs at least one page of at least one token")


@dataclass
class Simulation:
    results: list[RequestResult]  # in the order the requests were given
    steps: list[StepRecord] = field(default_factory=list)
    duration: float = 0.0         # virtual seconds from the first arrival to the last token

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.steps)


class Simulator:
    def __init__(self, settings: EngineSettings, cost,
                 max_concurrency: int | None = None) -> None:
        """``cost``: anything with ``step_seconds(StepShape) -> float``."""
        self.settings = settings
        self.cost = cost
        self.max_concurrency = max_concurrency
        cfg = settings.scheduler
        self.scheduler = Scheduler(cfg, make_kv_cache_manager(
            settings.kv_layout, settings.num_blocks, settings.block_size, cfg.max_model_len,
            settings.enable_prefix_caching))
        self.now = 0.0

    def run(self, requests: list[SimulatedRequest],
            on_step: Callable[[SchedulerOutput, list[Request]], None] | None = None
            ) -> Simulation:
        """Replay ``requests``; ``on_step(plan, finished)`` sees each step's decisions."""
        sim = Simulation([RequestResult(prompt_len=len(r.prompt_token_ids)) for r in requests])
        due = deque(sorted(range(len(requests)), key=lambda i: requests[i].arrival))
        held: deque[int] = deque()   # due, waiting for a concurrency slot
        # when each free slot freed (a request is sent at its arrival or then, the later)
        slots = None if self.max_concurrency is None else deque([0.0] * self.max_concurrency)
        index: dict[str, int] = {}
        token_times: dict[str, list[float]] = {}
        scheduler = self.scheduler
        model_len = scheduler.config.max_model_len
        while due or held or scheduler.has_unfinished():
            while due and requests[due[0]].arrival <= self.now:
                held.append(due.popleft())
            while held and (slots is None or slots):
                i = held.popleft()
                r, result = requests[i], sim.results[i]
                result.start_time = r.arrival if slots is None else max(r.arrival,
                                                                        slots.popleft())
                if len(r.prompt_token_ids) + r.output_len > model_len or not r.prompt_token_ids:
                    result.error = (f"HTTP 400: prompt ({len(r.prompt_token_ids)} tokens) plus "
                                    f"max_tokens ({r.output_len}) exceeds max_model_len "
                                    f"({model_len})")
                    if slots is not None:
                        slots.append(result.start_time)
                    continue
                request = Request(str(i), r.prompt_token_ids,
                                  SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                                  frozenset(), result.start_time)
                scheduler.add_request(request)
                index[request.request_id], token_times[request.request_id] = i, []
            if not scheduler.has_unfinished():
                if due:
                    self.now = max(self.now, requests[due[0]].arrival)
                continue
            plan = scheduler.schedule(self.now)
            if plan.is_empty:
                stuck = scheduler.waiting.peek()
                raise ValueError(f"request {stuck.request_id} ({stuck.num_tokens} tokens) can "
                                 f"never be admitted: the KV pool has "
                                 f"{scheduler.kv.pool.num_blocks} pages of "
                                 f"{scheduler.kv.block_size} tokens")
            shape = StepShape.of(plan)
            duration = self.cost.step_seconds(shape)
            self.now += duration
            sampled = {r.request_id: SIMULATED_TOKEN for r, n in plan.scheduled if samples(r, n)}
            finished = []
            for request in scheduler.update_from_output(plan, sampled, self.now):
                token_times[request.request_id].append(self.now)
                if request.is_finished:
                    finished.append(request)
                    if slots is not None:
                        slots.append(self.now)
                    self._finish(sim.results[index[request.request_id]],
                                 token_times.pop(request.request_id))
            sim.steps.append(StepRecord.of(len(sim.steps), self.now, duration, scheduler, plan))
            if on_step is not None:
                on_step(plan, finished)
        first = min((r.arrival for r in requests), default=0.0)
        sim.duration = max(self.now - first, 1e-9)
        return sim

    @staticmethod
    def _finish(result: RequestResult, times: list[float]) -> None:
        result.success = True
        result.output_tokens = len(times)
        result.ttft = times[0] - result.start_time
        result.itl = [b - a for a, b in zip(times, times[1:])]
        result.latency = times[-1] - result.start_time
