"""What ``LLM.generate`` and ``LLM.embed`` return: vLLM's ``RequestOutput`` and
``EmbeddingRequestOutput`` shapes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.monotonic``) of a request's life, for latency breakdowns."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None    # why this request failed (finish_reason "error"), alone
    client_error: bool = False  # ... because of its own input (a constraint it cannot meet)
    # with prompt_logprobs: per prompt token, its logprob and alternatives (None for the first)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    embedding: list[float] | None = None  # an embedding request's vector, once finished


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding as vLLM's ``LLM.embed`` returns it (``.outputs.embedding``)."""

    request_id: str
    prompt_token_ids: list[int]
    finished: bool
    outputs: EmbeddingOutput

    @classmethod
    def of(cls, out: RequestOutput) -> EmbeddingRequestOutput:
        return cls(out.request_id, out.prompt_token_ids, out.finished,
                   EmbeddingOutput(out.embedding))
