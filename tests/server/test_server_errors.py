"""The engine thread survives whatever a request does to the engine (no model needed: a fake
engine fails on cue), the queue limit counts requests not yet seen by the engine, and the engine
is built on the thread that steps it; if the thread dies, nobody is left waiting; timeouts,
the concurrency limit and clients that stop reading free their seats."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from conveyor.engine.faults import EngineKilled
from conveyor.core.grammar import GrammarStats
from conveyor.outputs import CompletionOutput, RequestMetrics, RequestOutput
from conveyor.sampling_params import SamplingParams
from conveyor.server.engine_thread import (
    MAX_UNREAD_OUTPUTS,
    EngineDead,
    EngineRequest,
    EngineThread,
    QueueFull,
    RequestTimeout,
    Submission,
    TooManyRequests,
)
from conveyor.server.metrics import ServerMetrics


class FakeEngine:
    """Finishes every request in one step; ``add_request`` rejects prompts containing -1 and
    ``step`` raises while ``fail_steps`` is positive."""

    def __init__(self, fail_steps: int = 0) -> None:
        self.fail_steps = fail_steps
        self.pending: dict[str, list[int]] = {}
        pool = SimpleNamespace(usage=0.0)
        self.scheduler = SimpleNamespace(running=[], waiting=[], num_preemptions_total=0,
                                         kv=SimpleNamespace(pool=pool, prefix_queries=0,
                                                            prefix_hits=0))
        self.grammars = SimpleNamespace(stats=GrammarStats())
        self.last_batch_size = 0
        self.steps, self.num_steps = [], 0  # (no step records)
        self.aborted: list[str] = []
        self.built_on = threading.current_thread()
        self.stepped_on: set[threading.Thread] = set()
        self.tensor_parallel = None  # one rank: no workers to watch
        self.shut_down = False

    def shutdown(self) -> None:
        self.shut_down = True

    def add_request(self, request_id, prompt, params, arrival_time=None, priority=0) -> None:
        if -1 in prompt["prompt_token_ids"]:
            raise ValueError("prompt token ids must be in [0, 10)")
        self.pending[request_id] = prompt["prompt_token_ids"]

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.pending.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[RequestOutput]:
        self.stepped_on.add(threading.current_thread())
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("boom")
        now = time.monotonic()
        outputs = [RequestOutput(rid, None, ids, [CompletionOutput(0, "ok", [1], "length")],
                                 True, RequestMetrics(now, now, now, now))
                   for rid, ids in self.pending.items()]
        self.last_batch_size = len(outputs)
        self.pending.clear()
        return outputs


def run_one(thread: EngineThread, request_id: str, prompt: list[int]) -> RequestOutput:
    async def go() -> RequestOutput:
        submission = thread.submit([EngineRequest(request_id, prompt, SamplingParams())])
        return [out async for _, out in submission.outputs()][-1]

    return asyncio.run(asyncio.wait_for(go(), 10))


@pytest.fixture
def make_thread():
    threads = []

    def make(build=FakeEngine, max_queue_len: int | None = None) -> EngineThread:
        thread = EngineThread(build, max_queue_len)
        threads.append(thread)
        return thread

    yield make
    for thread in threads:
        thread.stop()
        assert thread.engine.shut_down  # a stopped thread stops its engine's workers


def test_failed_step_fails_its_requests_and_the_thread_carries_on(make_thread):
    thread = make_thread(lambda: FakeEngine(fail_steps=1))
    thread.start(ServerMetrics("fake"))
    with pytest.raises(RuntimeError, match="engine failed"):
        run_one(thread, "a", [1, 2])
    assert thread.engine.aborted == ["a"]
    assert run_one(thread, "b", [1, 2]).outputs[0].text == "ok"


def test_rejected_add_fails_alone(make_thread):
    thread = make_thread()
    thread.start(ServerMetrics("fake"))
    with pytest.raises(ValueError, match="token ids"):
        run_one(thread, "bad", [-1])
    assert run_one(thread, "good", [3]).finished
    metrics = thread.metrics.exposition().decode()
    assert 'conveyor:request_success_total{finished_reason="length",model_name="fake"} 1.0' in (
        metrics)


def test_queue_limit_counts_requests_not_yet_seen_by_the_engine(make_thread):
    thread = make_thread(max_queue_len=2)  # not started: nothing is drained

    async def burst() -> int:
        accepted = 0
        for i in range(3):
            try:
                thread.submit([EngineRequest(str(i), [1], SamplingParams())])
                accepted += 1
            except QueueFull:
                pass
        return accepted

    assert asyncio.run(burst()) == 2


def test_engine_is_built_and_stepped_on_one_thread_not_the_callers(make_thread):
    thread = make_thread()
    thread.start(ServerMetrics("fake"))
    assert run_one(thread, "a", [1]).finished
    engine = thread.engine
    assert engine.built_on is not threading.current_thread()
    assert engine.stepped_on == {engine.built_on}


def test_a_failed_build_raises_on_the_callers_thread():
    def build():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        EngineThread(build)


class DyingEngine(FakeEngine):
    """``add_request`` of a prompt containing -2 kills the engine thread outright."""

    def add_request(self, request_id, prompt, params, arrival_time=None, priority=0) -> None:
        if -2 in prompt["prompt_token_ids"]:
            raise EngineKilled("injected")
        super().add_request(request_id, prompt, params, arrival_time, priority)


def test_a_dead_engine_fails_every_waiting_client_and_refuses_new_ones():
    deaths = []
    thread = EngineThread(DyingEngine, on_death=lambda: deaths.append(1))
    thread.start(ServerMetrics("fake"))

    async def go() -> list:
        doomed = [thread.submit([EngineRequest(str(i), [-2] if i == 1 else [1],
                                               SamplingParams())]) for i in range(4)]

        async def last(submission):
            return [out async for _, out in submission.outputs()][-1]

        return await asyncio.wait_for(asyncio.gather(*(last(s) for s in doomed),
                                                     return_exceptions=True), 10)

    results = asyncio.run(go())
    assert isinstance(results[1], EngineDead)  # the killer itself is told, not left hanging
    assert all(isinstance(r, (EngineDead, RequestOutput)) for r in results)
    thread.stop()  # the clients are told before on_death runs: wait for the thread to end
    assert deaths == [1] and "injected" in thread.death
    with pytest.raises(EngineDead):
        run_one(thread, "late", [1])
    assert thread.num_open == 0


def test_concurrency_limit_counts_open_submissions_and_frees_them_on_close():
    thread = EngineThread(FakeEngine, max_concurrent_requests=2)  # not started

    async def burst() -> None:
        first = thread.submit([EngineRequest("a", [1], SamplingParams())])
        thread.submit([EngineRequest("b", [1], SamplingParams())])
        with pytest.raises(TooManyRequests):
            thread.submit([EngineRequest("c", [1], SamplingParams())])
        first.abort()
        thread.submit([EngineRequest("d", [1], SamplingParams())])

    asyncio.run(burst())
    assert thread.num_open == 2
    thread.stop()


def test_a_request_past_its_timeout_ends_with_an_error_and_is_aborted(make_thread):
    thread = make_thread()  # never started: nothing comes back

    async def go() -> None:
        submission = thread.submit([EngineRequest("slow", [1], SamplingParams())], timeout=0.2)
        with pytest.raises(RequestTimeout, match="0.2 s"):
            async for _ in submission.outputs():
                pass

    asyncio.run(go())
    assert thread.num_open == 0


def test_a_client_that_reads_nothing_is_cut_after_a_bounded_number_of_outputs(make_thread):
    thread = make_thread()

    async def go() -> Submission:
        submission = thread.submit([EngineRequest("stalled", [1], SamplingParams())])
        running = RequestOutput("stalled", None, [1], [CompletionOutput(0, "", [], None)],
                                False, RequestMetrics(0.0))
        for _ in range(MAX_UNREAD_OUTPUTS + 1):
            submission.put(running)
        return submission

    submission = asyncio.run(go())
    assert thread.num_open == 0  # its seat is free and an abort is queued for the engine
    assert isinstance(list(submission.outbox._queue)[-1], RequestTimeout)
