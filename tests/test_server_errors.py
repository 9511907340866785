"""The engine thread survives whatever a request does to the engine (no model needed: a fake
engine fails on cue), the queue limit counts requests not yet seen by the engine, and the engine
is built on the thread that steps it."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from conveyor.outputs import CompletionOutput, RequestMetrics, RequestOutput
from conveyor.sampling_params import SamplingParams
from conveyor.server.engine_thread import EngineRequest, EngineThread, QueueFull
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
        self.last_batch_size = 0
        self.aborted: list[str] = []
        self.built_on = threading.current_thread()
        self.stepped_on: set[threading.Thread] = set()

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
