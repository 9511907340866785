"""What happens to a step's results: each request's tokens turned into text, stop strings,
logprobs, its n samples merged, embeddings finished, failures ended, and the outputs reported.

vLLM v1 splits its engine the same way: the step loop schedules and runs the model, the output
processor owns the per-request state the user sees. The scheduler still decides a request's end
by length and stop tokens; here it is also ended by a stop string, a complete grammar or an error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from conveyor.core.grammar import UnsatisfiableConstraint, consume
from conveyor.core.request import Request, RequestStatus
from conveyor.core.scheduler import Scheduler, SchedulerOutput
from conveyor.core.timeline import BatchTimeline
from conveyor.engine.detokenizer import IncrementalDetokenizer
from conveyor.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from conveyor.sampling_params import PoolingParams

logger = logging.getLogger("conveyor")


@dataclass
class SampleState:
    """One of a request's n samples: the schedulable request plus its text."""

    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleState]
    error: str | None = None
    client_error: bool = False  # the error is the request's own input's fault
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # filled as chunks run
    pooling: PoolingParams | None = None  # an embedding request
    pooled: torch.Tensor | None = None    # its vector so far (mean pooling: the sum)
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.samples)


class OutputProcessor:
    """The requests the engine holds, from ``add`` until their final output is reported."""

    def __init__(self, tokenizer, scheduler: Scheduler, timeline: BatchTimeline) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler  # to end a request by a stop string, a grammar or an error
        self.timeline = timeline
        self.states: dict[str, RequestState] = {}
        self.live: dict[str, tuple[RequestState, SampleState]] = {}  # unfinished, by sample id

    def add(self, state: RequestState) -> None:
        self.states[state.request_id] = state
        for sample in state.samples:
            self.live[sample.request.request_id] = (state, sample)

    def abort(self, request_id: str, now: float) -> RequestState | None:
        """Forget a request; its samples leave the timeline (the caller frees their pages)."""
        state = self.states.pop(request_id, None)
        for sample in state.samples if state is not None else ():
            self.timeline.leave(sample.request, now)
            self.live.pop(sample.request.request_id, None)
        return state

    def preempted(self, request: Request) -> None:
        if request.pooling is not None:  # its prompt is computed again from the start
            self.live[request.request_id][0].pooled = None

    def process(self, sched: SchedulerOutput, ran, advanced: list[Request], now: float
                ) -> list[RequestOutput]:
        """``ran``: the runner's results for ``sched``; ``advanced``: the requests the scheduler
        gave a token this step. An output for every request that moved."""
        touched: dict[str, RequestState] = {}
        for rid, (first, rows) in ran.prompt_logprobs.items():
            if rid in self.live:
                state = self.live[rid][0]
                state.prompt_logprobs[first + 1:first + 1 + len(rows)] = [
                    self._logprobs(entries) for entries in rows]
        for request, _ in sched.scheduled:
            if request.pooling is not None and request.request_id in self.live:
                state = self._pool(request, ran.pooled.get(request.request_id), now)
                if state is not None:
                    touched[state.request_id] = state
        for rid, result in ran.samples.items():
            if result.error is not None and rid in self.live:
                state = self._fail(rid, result.error, now)
                touched[state.request_id] = state
        for request in advanced:
            if request.request_id not in self.live:  # a sibling failed this step
                continue
            state, sample = self.live[request.request_id]
            touched[state.request_id] = state
            try:
                self._advance(request, sample, ran.samples[request.request_id], now)
            except UnsatisfiableConstraint as e:  # the request's own input: no traceback
                self._fail(request.request_id, str(e), now, client_error=True)
            except Exception as e:  # this request's failure is its own; the batch carries on
                logger.exception("request %s failed", request.request_id)
                self._fail(request.request_id, f"{type(e).__name__}: {e}", now)

        outputs = []
        for state in touched.values():
            outputs.append(self._output(state))
            if state.finished:
                del self.states[state.request_id]
        return outputs

    def _advance(self, request: Request, sample: SampleState, result, now: float) -> None:
        """A sampled token's grammar, logprobs, text and stop strings."""
        if request.grammar_after is not None:  # not constrained yet: is this its start?
            if result.token_id == request.grammar_after:
                request.grammar_after = None
        elif request.grammar is not None:  # the matcher follows the tokens: one consume each
            consume(request.grammar, result.token_id)
            if request.grammar.is_stopped() and not request.is_finished:  # grammar complete
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        if sample.logprobs is not None:
            sample.logprobs.append(self._logprobs(result.logprobs))
        stop = sample.detokenizer.add_token(
            result.token_id,
            check_stop=request.num_output_tokens >= request.sampling_params.min_tokens)
        if stop is not None:  # a stop string outranks a length stop on the same token
            request.stop_reason = stop
            if request.is_finished:
                request.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        if request.is_finished:
            self._retire(request, now)

    def _pool(self, request: Request, part: torch.Tensor | None, now: float
              ) -> RequestState | None:
        """An embedding request's step: its share of the vector added; once its prompt is
        computed, the vector finished and the request ended (its state, then)."""
        state = self.live[request.request_id][0]
        if part is not None:
            state.pooled = part if state.pooled is None else state.pooled + part
        if request.num_computed_tokens < request.num_prompt_tokens:
            return None
        vector = state.pooled
        if request.pooling == "mean":
            vector = vector / request.num_prompt_tokens
        if state.pooling.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        state.embedding = vector.tolist()
        self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        self._retire(request, now)
        return state

    def _logprobs(self, entries: list[tuple[int, float, int]]) -> dict[int, Logprob]:
        return {tid: Logprob(lp, rank, self.tokenizer.decode([tid])) for tid, lp, rank in entries}

    def _retire(self, request: Request, now: float) -> None:
        """A finished sample leaves the batch's timeline and the live samples."""
        request.metrics.finished_time = now
        self.timeline.leave(request, now)
        self.live.pop(request.request_id)

    def _fail(self, sample_id: str, error: str, now: float, client_error: bool = False
              ) -> RequestState:
        """End every sample of the request this sample belongs to with ``error``. Its pages go
        back to the pool at once."""
        state, _ = self.live[sample_id]
        state.error = error
        state.client_error = client_error
        for sample in state.samples:
            request = sample.request
            if request.request_id not in self.live:
                continue  # finished before
            if request.is_finished:  # finished this step by length or a stop token
                request.status = RequestStatus.FINISHED_ERROR
            else:
                self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR)
            self._retire(request, now)
        logger.warning("request %s failed: %s", state.request_id, error)
        return state

    def _output(self, state: RequestState) -> RequestOutput:
        completions = [CompletionOutput(i, s.detokenizer.text, list(s.request.output_token_ids),
                                        s.request.finish_reason,
                                        None if s.logprobs is None else list(s.logprobs),
                                        s.request.stop_reason)
                       for i, s in enumerate(state.samples)]
        metrics = [s.request.metrics for s in state.samples]

        def first(values):
            values = [v for v in values if v is not None]
            return min(values) if values else None

        finished = state.finished
        merged = RequestMetrics(
            arrival_time=metrics[0].arrival_time,
            first_scheduled_time=first(m.first_scheduled_time for m in metrics),
            first_token_time=first(m.first_token_time for m in metrics),
            finished_time=max(m.finished_time for m in metrics) if finished else None,
            num_preemptions=sum(m.num_preemptions for m in metrics))
        cached = [s.request.num_cached_tokens for s in state.samples]
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                             finished, merged, max((c for c in cached if c is not None), default=0),
                             state.error, state.client_error, state.prompt_logprobs,
                             state.embedding)
