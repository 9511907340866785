"""A request as the scheduler sees it: token ids, progress and its KV pages. No torch here."""

from __future__ import annotations

import enum

from conveyor.outputs import RequestMetrics
from conveyor.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # this request failed alone (the batch carried on)

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


class Request:
    """One sequence being generated.

    The one rule the scheduler follows: ``num_computed_tokens`` (tokens whose KV is in the cache)
    catches up with ``num_tokens`` (prompt plus sampled tokens). Prefill, chunked prefill, decode
    and recompute after preemption are all that rule with different gaps.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, eos_token_ids: frozenset[int],
                 arrival_time: float, priority: int = 0) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []   # chained hashes of its full pages, memoised
        # where the chain starts: pages that hold other values for the same tokens (LongRoPE's
        # long prompts) are only ever shared with requests of the same salt
        self.cache_salt: bytes | None = None
        self.num_published_blocks = 0         # pages of block_ids already in the prefix cache
        self.num_cached_tokens: int | None = None  # prompt tokens found cached at first admission
        self.priority = priority              # lower runs first under priority scheduling
        self.queue_seq: int | None = None     # tie-breaker among equal priority and arrival
        # another sample of the same prompt whose prefill this one waits for, to share its pages
        self.waits_for_prefill_of: Request | None = None
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        # structured outputs: the matcher of its constraint, advanced by each sampled token from
        # the one after grammar_after (while that is not None, the output is unconstrained)
        self.grammar = None
        self.grammar_after: int | None = None
        # the prompt's logprobs, with this many alternatives, are computed for this sample (the
        # first of n: the others would repeat them)
        self.prompt_logprobs: int | None = None
        # an embedding request: its prompt's hidden states pooled this way (POOLING_TYPES); it
        # samples nothing and ends when its prompt is computed
        self.pooling: str | None = None

    @property
    def computes_whole_prompt(self) -> bool:
        """It reads every prompt position's output, so no prefix-cache hit may skip one."""
        return self.prompt_logprobs is not None or self.pooling in ("mean", "cls")

    @property
    def constrained(self) -> bool:
        """Whether its next token is masked by its constraint."""
        return self.grammar is not None and self.grammar_after is None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finish status the last sampled token implies, if any (stop strings are checked
        after detokenization, by the engine)."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
