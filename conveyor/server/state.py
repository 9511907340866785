"""What the completions and chat handlers share: checking a request against the served model,
queueing it, and collecting its outputs while watching for the client to leave."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from fastapi import Request

from conveyor.engine.engine import LLMEngine
from conveyor.engine.input_processor import Prompt
from conveyor.outputs import RequestOutput
from conveyor.sampling_params import SamplingParams
from conveyor.server.engine_thread import (
    EngineDead,
    EngineRequest,
    EngineThread,
    QueueFull,
    RequestFailed,
    RequestTimeout,
    Submission,
    TooManyRequests,
)
from conveyor.server.errors import APIError, bad_request
from conveyor.server.metrics import ServerMetrics
from conveyor.server.protocol import SamplingFields

RETRY_AFTER_S = 1


@dataclass
class ServerState:
    engine: LLMEngine          # read-only here (tokenizer, limits); the thread owns the rest
    engine_thread: EngineThread
    metrics: ServerMetrics
    served_model_names: list[str]
    request_timeout: float | None = None  # --request-timeout: the default and the most
    reasoning_parser: str | None = None  # --reasoning-parser
    # also answered to, unlisted: the model as given at launch (a path, say), as vLLM names it
    aliases: tuple[str, ...] = ()
    max_logprobs: int = 20  # --max-logprobs

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_model_names and name not in self.aliases:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.served_model_names}", "model", "model_not_found")

    async def sampling_params(self, body: SamplingFields, max_tokens: int,
                              logprobs: int | None, tools: tuple[str, dict] | None = None
                              ) -> SamplingParams:
        """The request's sampling parameters, its output constraint compiled (off the event
        loop: a large schema takes a while) so that one the engine cannot enforce is a 400
        naming the field it came from."""
        asked = "top_logprobs" if "top_logprobs" in type(body).model_fields else "logprobs"
        most = min(self.max_logprobs, self.engine.model_config.vocab_size)
        for name, value in ((asked, logprobs), ("prompt_logprobs", body.prompt_logprobs)):
            if value is not None and value > most:
                raise bad_request(f"{name} may be at most {most} (--max-logprobs), got {value}",
                                  name)
        try:
            found = body.constraint(tools)
            params = body.sampling_params(max_tokens, logprobs, found and found[0],
                                          self.engine.sampling_defaults)
        except ValueError as e:
            name = getattr(e, "param", None)  # (a ParamError's; SamplingParams' own names)
            raise bad_request(str(e), name if name in type(body).model_fields else None) from e
        if found is not None:
            try:
                await asyncio.to_thread(self.engine.grammars.compile, found[0])
            except ValueError as e:
                raise bad_request(f"{found[1]}: {e}", found[1]) from e
        return params

    def check_prompt(self, prompt: Prompt, params: SamplingParams, param: str,
                     limit_param: str = "max_tokens") -> tuple[str | None, list[int]]:
        """Tokenize and check against the engine's limits, as the engine would on add;
        ``limit_param`` is named when prompt plus output would exceed ``max_model_len``."""
        try:
            return self.engine.check_request(prompt, params)
        except ValueError as e:
            name = getattr(e, "param", None) or param  # (None: the prompt's own fault)
            raise bad_request(str(e), limit_param if name == "max_tokens" else name) from e

    def submit(self, prefix: str, prompts: list[list[int]], params: SamplingParams,
               priority: int = 0, timeout: float | None = None) -> tuple[str, Submission]:
        """Queue the prompts; ``timeout`` (seconds, the request's own) is capped by
        ``--request-timeout``."""
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}"
                                                       for i in range(len(prompts))]
        limits = [t for t in (timeout, self.request_timeout) if t is not None]
        try:
            return request_id, self.engine_thread.submit(
                [EngineRequest(i, p, params, priority) for i, p in zip(ids, prompts)],
                min(limits) if limits else None)
        except (TooManyRequests, QueueFull, EngineDead) as e:
            raise refusal_error(e) from e


def prompt_list(given: str | list[str] | list[int] | list[list[int]], param: str) -> list:
    """The prompts of a request field that takes one or many (a string or token ids, or a
    list of them); a 400 naming ``param`` where it is empty."""
    if isinstance(given, str) or (given and isinstance(given[0], int)):
        return [given]
    if not given:
        raise bad_request(f"{param} must not be empty", param)
    return list(given)


def refusal_error(exc: Exception) -> APIError:
    """What a refused request is answered: 429 or 503 with Retry-After, or 503 once dead."""
    if isinstance(exc, TooManyRequests):
        return APIError(429, f"too many requests at once: {exc}; retry later", None,
                        "too_many_requests", {"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, QueueFull):
        return APIError(503, f"the server is overloaded: {exc}; retry later", None,
                        "queue_full", {"Retry-After": str(RETRY_AFTER_S)})
    return engine_failure(exc)


def engine_failure(exc: Exception) -> APIError:
    """An error the engine thread reported for a queued request."""
    if isinstance(exc, ValueError):
        return bad_request(str(exc), None)
    if isinstance(exc, RequestTimeout):
        return APIError(408, str(exc), None, "timeout")
    if isinstance(exc, EngineDead):
        return APIError(503, f"{exc}; the server is restarting", None, "engine_dead")
    if isinstance(exc, RequestFailed) and exc.client_error:
        return bad_request(str(exc), None, "unsatisfiable_constraint")
    if isinstance(exc, RequestFailed):
        return APIError(500, f"this request failed: {exc}", None, "request_failed")
    return APIError(500, str(exc), code="engine_error")


async def _until_disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def collect(raw: Request, submission: Submission, count: int
                  ) -> list[RequestOutput] | None:
    """The final output of each request, or None when the client left first (which aborts)."""
    finals: list[RequestOutput | None] = [None] * count

    async def consume() -> None:
        async for i, out in submission.outputs():
            finals[i] = out

    work = asyncio.ensure_future(consume())
    watch = asyncio.ensure_future(_until_disconnected(raw))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():  # the client left (or the handler was cancelled) first
            work.cancel()
            submission.abort()
    if not work.done() or work.cancelled():  # a cancelled task is done only a tick later
        return None
    if work.exception() is not None:
        raise engine_failure(work.exception())
    return finals  # type: ignore[return-value]
