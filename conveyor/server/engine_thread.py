"""The bridge between asyncio request handlers and the (not thread-safe) engine.

The engine runs on one daemon thread that owns it: it drains an inbox of add/abort commands,
steps while there is work and otherwise blocks on the inbox, and hands each output to the waiting
handler with ``call_soon_threadsafe``. HTTP handlers therefore never wait on a step to be accepted,
and the engine never waits on HTTP.

The same thread builds the engine. Every thread that runs a parallel region gets an OpenMP thread
pool of its own, and once the process holds more of those threads than it has CPUs, libgomp (the
runtime PyTorch and our kernels use) cuts its spin-wait at each barrier to 100 iterations, so
every barrier sleeps and wakes through the kernel: loading the model on the main thread and
stepping it here made a step slower in the server than offline
(docs/results/design-notes#engine-thread).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from conveyor.engine.engine import LLMEngine
from conveyor.outputs import RequestOutput
from conveyor.sampling_params import SamplingParams
from conveyor.server.metrics import ServerMetrics

logger = logging.getLogger("conveyor.server")


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0


@dataclass
class _Add:
    request: EngineRequest
    loop: asyncio.AbstractEventLoop
    submission: Submission
    arrival_time: float


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run ``fn(engine)`` on the engine thread, which alone may touch the engine."""

    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future


@dataclass
class _Live:
    """What the engine thread knows about one request it is running."""

    loop: asyncio.AbstractEventLoop
    submission: Submission
    num_prompt_tokens: int
    num_samples: int = 1
    num_output_tokens: int = 0
    last_token_time: float | None = None  # when a step last gave it tokens (time.monotonic)

    def deliver(self, item: RequestOutput | Exception) -> None:
        try:
            self.loop.call_soon_threadsafe(self.submission.put, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


_STOP = object()


class QueueFull(Exception):
    pass


class TooManyRequests(Exception):
    pass


class EngineDead(RuntimeError):
    pass


class RequestTimeout(Exception):
    pass


class RequestFailed(RuntimeError):
    """The engine ended this request with an error of its own (the batch carried on);
    ``client_error``: because of the request's input."""

    def __init__(self, message: str, client_error: bool = False) -> None:
        super().__init__(message)
        self.client_error = client_error


# Outputs a client may leave unread before its request is cut: a stream whose client stopped
# reading stalls on the socket, and each output it has not taken holds a copy of its tokens.
MAX_UNREAD_OUTPUTS = 512


class Submission:
    """The outputs of one HTTP request's engine requests, as they arrive. Closing it (finished,
    aborted, timed out or cut) aborts what still runs and frees its seat."""

    def __init__(self, inbox: queue.Queue, requests: list[EngineRequest],
                 timeout: float | None, on_close: Callable[[], None]) -> None:
        self._inbox = inbox
        self.outbox: asyncio.Queue = asyncio.Queue()
        self._index = {r.request_id: i for i, r in enumerate(requests)}
        self._unfinished = set(self._index)
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._timeout = timeout
        self._on_close: Callable[[], None] | None = on_close

    def put(self, item: RequestOutput | Exception) -> None:
        """On the event loop: an output from the engine thread."""
        if self.outbox.qsize() >= MAX_UNREAD_OUTPUTS:
            self.abort()
            item = RequestTimeout(f"the client read none of the last {MAX_UNREAD_OUTPUTS} "
                                  "outputs; the request was cut")
        self.outbox.put_nowait(item)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield ``(index, output)`` until all finish; leaving early aborts the rest."""
        try:
            while self._unfinished:
                left = None if self._deadline is None else self._deadline - time.monotonic()
                try:
                    item = await asyncio.wait_for(self.outbox.get(), left)
                except TimeoutError:
                    raise RequestTimeout(f"the request ran past its timeout of "
                                         f"{self._timeout:g} s") from None
                if isinstance(item, Exception):
                    raise item
                if item.error is not None:
                    raise RequestFailed(item.error, item.client_error)
                if item.finished:
                    self._unfinished.discard(item.request_id)
                yield self._index[item.request_id], item
        finally:
            self.abort()

    def abort(self) -> None:
        for request_id in self._unfinished:
            self._inbox.put(_Abort(request_id))
        self._unfinished.clear()
        if self._on_close is not None:
            self._on_close()
            self._on_close = None


class EngineThread:
    """Builds the engine on its own thread at once (raising what ``build`` raised); drains and
    steps only from ``start`` on."""

    def __init__(self, build: Callable[[], LLMEngine], max_queue_len: int | None = None,
                 max_concurrent_requests: int | None = None,
                 on_death: Callable[[], None] = lambda: None,
                 log_requests: bool = False) -> None:
        self.max_queue_len = max_queue_len
        self.log_requests = log_requests  # a log line each finished request
        self.max_concurrent_requests = max_concurrent_requests
        self.metrics: ServerMetrics | None = None  # set by start
        self.death: str | None = None      # why the engine thread died, once it has
        self._on_death = on_death
        self._inbox: queue.Queue = queue.Queue()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._lock = threading.Lock()      # guards the counts below
        self._num_pending = 0              # adds in the inbox, not yet seen by the engine
        self._num_waiting = 0              # the scheduler's waiting queue, as last seen
        self._num_open = 0                 # submissions not yet closed (HTTP requests in flight)
        self._started = threading.Event()
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(build, built),
                                        name="conveyor-engine", daemon=True)
        self._thread.start()
        self.engine: LLMEngine = built.result()

    # -- asyncio side --------------------------------------------------------------------------
    def start(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._started.set()

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread.is_alive():
            self._inbox.put(_STOP)
            self._started.set()
            self._thread.join(timeout)
        if not self._thread.is_alive():  # (a step still running holds the workers)
            self.engine.shutdown()

    @property
    def num_open(self) -> int:
        return self._num_open

    def submit(self, requests: list[EngineRequest], timeout: float | None = None
               ) -> Submission:
        """Queue validated requests at once. Raises TooManyRequests past
        ``max_concurrent_requests`` open submissions, QueueFull when ``max_queue_len`` wait,
        EngineDead once the engine thread has died."""
        with self._lock:
            refusal = self.refusal()
            if refusal is not None:
                raise refusal
            self._num_pending += len(requests)
            self._num_open += 1
            # queued under the lock: a dying engine thread either sees these or we see it dead
            submission = Submission(self._inbox, requests, timeout, self._close)
            loop = asyncio.get_running_loop()
            now = time.monotonic()
            for r in requests:
                self._inbox.put(_Add(r, loop, submission, now))
        return submission

    def refusal(self) -> Exception | None:
        """Why a new request would be refused now, if it would (read without the lock, it is
        a hint: the server's gate answers a burst with it before parsing any body)."""
        if self.death is not None:
            return EngineDead(self.death)
        if (self.max_concurrent_requests is not None
                and self._num_open >= self.max_concurrent_requests):
            return TooManyRequests(f"{self._num_open} requests are in flight "
                                   f"(--max-concurrent-requests {self.max_concurrent_requests})")
        if (self.max_queue_len is not None
                and self._num_pending + self._num_waiting >= self.max_queue_len):
            return QueueFull(f"{self._num_pending + self._num_waiting} requests are waiting "
                             f"(--max-queue-len {self.max_queue_len})")
        return None

    def _close(self) -> None:
        with self._lock:
            self._num_open -= 1

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """``fn(engine)``, run between two steps on the engine thread."""
        if self.death is not None:
            raise EngineDead(self.death)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Call(fn, future))
        return await asyncio.wrap_future(future)

    # -- engine thread -------------------------------------------------------------------------
    def _run(self, build: Callable[[], LLMEngine], built: concurrent.futures.Future) -> None:
        try:
            built.set_result(build())
        except BaseException as e:  # the constructor raises it on the caller's thread
            built.set_exception(e)
            return
        self._started.wait()
        if self.engine.tensor_parallel is not None:
            self.engine.tensor_parallel.watch(self._lose_worker)
        try:
            while self._drain(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step()
                self.metrics.observe_engine(self.engine)
        except BaseException as e:  # the engine's state is unknown now: fail loudly, exit
            logger.critical("the engine thread died", exc_info=e)
            self._die(f"the engine died: {type(e).__name__}: {e}")

    def _lose_worker(self, reason: str) -> None:
        """From the watcher's thread: the engine dies of it between two steps (inside one, the
        collective waiting on the worker has raised already)."""

        def fail(_: LLMEngine) -> None:
            raise RuntimeError(reason)

        self._inbox.put(_Call(fail, concurrent.futures.Future()))

    def _die(self, reason: str) -> None:
        """Every request in flight or queued gets an error; then the process is told to go
        (a supervisor restarts it), and /health says 503 meanwhile."""
        with self._lock:  # from here on submit refuses, so the inbox only shrinks
            self.death = reason
        error = EngineDead(reason)
        for live in self._live.values():
            live.deliver(error)
        self._live.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Add):
                _Live(item.loop, item.submission, 0).deliver(error)
            elif isinstance(item, _Call):
                item.future.set_exception(error)
        self._on_death()

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; False once told to stop."""
        try:
            item = self._inbox.get() if block else self._inbox.get_nowait()
            while True:
                if item is _STOP:
                    return False
                if isinstance(item, _Add):
                    self._add(item)
                elif isinstance(item, _Call):
                    item.future.set_result(item.fn(self.engine))
                else:
                    self._abort(item.request_id)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return True

    def _add(self, cmd: _Add) -> None:
        r = cmd.request
        live = self._live[r.request_id] = _Live(cmd.loop, cmd.submission,
                                                len(r.prompt_token_ids),
                                                getattr(r.params, "n", 1))
        try:
            self.engine.add_request(r.request_id, {"prompt_token_ids": r.prompt_token_ids},
                                    r.params, arrival_time=cmd.arrival_time,
                                    priority=r.priority)
        except Exception as e:  # a bad request fails alone; the engine carries on
            logger.warning("rejected %s: %s", r.request_id, e)
            del self._live[r.request_id]
            live.deliver(e if isinstance(e, ValueError) else RuntimeError(str(e)))
        else:
            self.metrics.prompt_tokens.inc(len(r.prompt_token_ids))
        finally:
            with self._lock:
                self._num_pending -= 1
                self._num_waiting = len(self.engine.scheduler.waiting)

    def _abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        self.engine.abort_request(request_id)
        self.metrics.count_finish(["abort"] * live.num_samples)
        logger.info("aborted %s (client gone) after %d output tokens", request_id,
                    live.num_output_tokens)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            logger.exception("engine step failed; failing the requests in flight")
            for request_id, live in list(self._live.items()):
                self._live.pop(request_id)
                try:
                    self.engine.abort_request(request_id)
                except Exception:
                    logger.exception("abort of %s failed", request_id)
                live.deliver(RuntimeError("the engine failed while running this request"))
            return
        with self._lock:
            self._num_waiting = len(self.engine.scheduler.waiting)
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:  # aborted while this step ran
                continue
            num_output = sum(len(c.token_ids) for c in out.outputs)
            if num_output > live.num_output_tokens:
                now = time.monotonic()
                if live.last_token_time is not None:
                    self.metrics.inter_token.observe(now - live.last_token_time)
                live.last_token_time = now
            self.metrics.generation_tokens.inc(num_output - live.num_output_tokens)
            live.num_output_tokens = num_output
            if out.finished:
                del self._live[out.request_id]
                self.metrics.observe_finished(out)
                if self.log_requests:
                    _log_finished(out, live)
            live.deliver(out)


def _log_finished(out: RequestOutput, live: _Live) -> None:
    m = out.metrics

    def span(a: float | None, b: float | None) -> float:
        return (b - a) if a is not None and b is not None else 0.0

    logger.info("finished %s: %d prompt (%d cached) + %d output tokens, queue %.3f s, "
                "prefill %.3f s, decode %.3f s, %d preemptions, finish %s", out.request_id,
                live.num_prompt_tokens, out.num_cached_tokens, live.num_output_tokens,
                span(m.arrival_time, m.first_scheduled_time),
                span(m.first_scheduled_time, m.first_token_time),
                span(m.first_token_time, m.finished_time), m.num_preemptions,
                ",".join(str(c.finish_reason) for c in out.outputs))
