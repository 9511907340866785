"""Per-request sampling settings, named and validated as vLLM's ``SamplingParams``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property

_GREEDY_EPS = 1e-5
_SEEDS = range(-2**63, 2**63 - 2**16)  # torch takes 64-bit seeds; sample i draws seed + i
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


class ParamError(ValueError):
    """A request parameter's bad value. ``param`` names it (None: the prompt itself), so that
    the server's 400 names the field without reading the message."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output, as vLLM's ``StructuredOutputsParams``: a JSON
    schema, any JSON object, a regular expression, one of fixed strings, or a grammar (Lark, or
    GBNF/EBNF, told apart by its ``::=``). ``disable_any_whitespace``: JSON without free
    whitespace between its tokens (as ``json.dumps(..., separators=(",", ":"))``);
    ``whitespace_pattern``: a regular expression for each run of it (vLLM's; default: any run).
    ``after_token``: the constraint holds from the token after this one's first appearance in
    the output (a reasoning model's ``</think>``: the answer is constrained, not the thinking,
    as vLLM does with a reasoning parser); None: from the first token."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    after_token: int | None = None

    def __post_init__(self) -> None:
        given = self._given()
        if len(given) != 1:
            raise ParamError("structured_outputs", "structured_outputs needs exactly one of json, "
                             f"regex, choice, grammar or json_object, got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except ValueError as e:
                raise ParamError("structured_outputs",
                                 f"structured_outputs json is not valid JSON: {e}") from e
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ParamError("structured_outputs",
                             "structured_outputs json must be a JSON schema (an object)")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ParamError("structured_outputs",
                                 "structured_outputs choice must be a list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ParamError("structured_outputs",
                                 f"structured_outputs {name} must be a non-empty string")

    def _given(self) -> list[str]:
        return [k for k in _CONSTRAINTS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        return self._given()[0]

    @cached_property
    def key(self) -> tuple[str, str, bool, str | None]:
        """What the compiled grammar depends on: the cache's key (a request looks it up a few
        times, from the server's check to the engine's matcher; a schema is dumped once)."""
        spec = getattr(self, self.kind)
        text = spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True)
        return self.kind, text, self.disable_any_whitespace, self.whitespace_pattern


# Poolings of a prompt's last hidden states into an embedding: the last token's (what a causal
# model's final state sums up; vLLM's default for one), the mean over the prompt, the first's.
POOLING_TYPES = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request (``LLM.embed``, ``/v1/embeddings``) in place of sampling: the
    prompt's last hidden states pooled into one vector (the engine's pooling_type), no token
    sampled. ``normalize``: scaled to unit length (L2), as vLLM and OpenAI return them."""

    normalize: bool = True


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # each prompt token's logprob given the tokens before it, with this many alternatives
    # (vLLM's; the first token has none). Such a request computes its whole prompt: no prefix
    # cache hit.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured_outputs: StructuredOutputsParams | None = None
    # token id -> a value added to its logit before any other rule (OpenAI's logit_bias:
    # -100 bans the token, +100 all but forces it)
    logit_bias: dict[int, float] | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ParamError(name, f"{name} {why}, got {getattr(self, name)!r}")

        check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        check(self.temperature >= 0, "temperature", "must be >= 0")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int) and (self.top_k >= 1 or self.top_k in (0, -1)),
              "top_k", "must be 0 or -1 (disabled) or an integer >= 1")
        check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
              "must be an integer >= 1")
        check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
              "min_tokens", "must be an integer in [0, max_tokens]")
        check(self.seed is None or (isinstance(self.seed, int) and self.seed in _SEEDS), "seed",
              f"must be None or an integer in [{_SEEDS.start}, {_SEEDS.stop})")
        check(self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
              "logprobs", "must be None or an integer >= 0")
        check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                                and self.prompt_logprobs >= 0),
              "prompt_logprobs", "must be None or an integer >= 0")
        check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        check(self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        check(all(isinstance(s, str) and s for s in self.stop_strings), "stop",
              "must be a non-empty string or a list of them")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be a list of token ids")
        check(self.structured_outputs is None
              or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "must be None or a StructuredOutputsParams")
        check(self.logit_bias is None or all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0
            and isinstance(b, (int, float)) and -100 <= b <= 100
            for t, b in self.logit_bias.items()), "logit_bias",
            "must map token ids to values in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)
