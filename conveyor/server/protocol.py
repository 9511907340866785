"""Request and response bodies of the OpenAI API, with OpenAI's field names.

The constraints live here (not only in ``SamplingParams``) so that a bad value is a 400 naming the
field before any work is queued, and so that the generated OpenAPI schema states them.
"""

from __future__ import annotations

import logging
import reprlib
import time
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from conveyor.engine.engine import StepRecord
from conveyor.outputs import RequestOutput
from conveyor.sampling_params import ParamError, SamplingParams, StructuredOutputsParams


logger = logging.getLogger("conveyor.server")

# Sizes past which a request is refused before any work (each a 400 naming the field).
MAX_STOP_STRINGS = 16      # each checked against the new text of every token
MAX_STOP_CHARS = 1000
MAX_PROMPTS = 256          # prompts in one completions request
MAX_MESSAGES = 4096
StopStrings = (Annotated[str, Field(max_length=MAX_STOP_CHARS)]
               | Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]],
                           Field(max_length=MAX_STOP_STRINGS)] | None)


class StreamOptions(BaseModel):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far too
    continuous_usage_stats: bool = False


# -- structured outputs ------------------------------------------------------------------------
JsonSchema = dict | bool


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: JsonSchema | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    model_config = ConfigDict(populate_by_name=True)
    json_: JsonSchema | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None


# Fields of OpenAI's and vLLM's published request schemas that Conveyor does not implement:
# a request that sets one to anything but the value that changes nothing is a 400 naming it
# (a key neither schema has is ignored, as vLLM does). field -> the values that change nothing.
NOT_IMPLEMENTED: dict[str, tuple] = {
    # OpenAI's
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "functions": (None,), "function_call": (None,), "web_search_options": (None,),
    "reasoning_effort": (None,), "verbosity": (None,), "service_tier": (None, "auto", "default"),
    "store": (None, False), "metadata": (None,), "suffix": (None, ""),
    "prompt_cache_key": (None,), "safety_identifier": (None,),
    # vLLM's
    "best_of": (None, 1), "use_beam_search": (None, False), "length_penalty": (None, 1.0),
    "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None,), "bad_words": (None, []), "add_special_tokens": (None,),
    "echo": (None, False),  # (chat's: the last message before the reply; completions take it)
    "documents": (None,), "chat_template": (None,), "mm_processor_kwargs": (None,),
    "structural_tag": (None,), "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,), "logits_processors": (None,),
    "return_tokens_as_token_ids": (None, False), "return_token_ids": (None, False),
    "cache_salt": (None,), "kv_transfer_params": (None,), "vllm_xargs": (None,),
    "response_format_options": (None,), "request_id": (None,),
}


class UnimplementedField(ParamError):
    """A request field this server does not implement (``param``: its name, for the 400);
    ``why``: the message, where more can be said than that."""

    def __init__(self, param: str, value: Any, why: str | None = None) -> None:
        # (reprlib: a value nested thousands deep is no RecursionError)
        super().__init__(param, why or f"{param} is not implemented by this server (got "
                                       f"{reprlib.repr(value)})")


def refuse_unimplemented(data: Any, table: dict[str, tuple], fields: Iterable[str] = (),
                         messages: dict[str, str] | None = None) -> None:
    """UnimplementedField for the first key of ``table`` (field -> the values that change
    nothing) that ``data``, a request body, sets to another value, unless it is one of
    ``fields`` (the model's own); ``messages``: a field's message, where more can be said."""
    if isinstance(data, dict):
        for key, value in data.items():
            if key in table and key not in fields and value not in table[key]:
                raise UnimplementedField(key, value, (messages or {}).get(key))


def text_of(content: str | list | None) -> str:
    """A message's content as text: a string, or its text parts joined."""
    if isinstance(content, list):
        return "".join(part.text for part in content)
    return content if content is not None else ""


class SamplingFields(BaseModel):
    """Fields shared by completions and chat, including vLLM's extras."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        refuse_unimplemented(data, NOT_IMPLEMENTED, cls.model_fields)
        if isinstance(data, dict):
            unknown = [k for k in data if k not in cls.model_fields and k not in NOT_IMPLEMENTED]
            if unknown:  # as vLLM: ignored, and said so
                logger.warning("these fields of a request are ignored (neither OpenAI's nor "
                               "vLLM's schema has them): %s", reprlib.repr(unknown))
        return data

    model: str | None = Field(None, description="must be a served model name when given")
    n: int = Field(1, ge=1, le=128)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: StopStrings = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int = Field(0, ge=-1, description="0 or -1: disabled")
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_STRINGS)
    logit_bias: dict[int, float] | None = Field(None, max_length=1024, description=
                                                "token id -> a value in [-100, 100] added to "
                                                "its logit (OpenAI's)")
    prompt_logprobs: int | None = Field(None, ge=0, description=
                                        "vLLM's: each prompt token's logprob and this many "
                                        "alternatives, in the response's prompt_logprobs")
    priority: int = Field(0, description="lower runs first under --scheduling-policy priority")
    timeout: float | None = Field(None, gt=0, description="seconds; past them the request ends "
                                  "with a 408 (or an error event); capped by --request-timeout")
    # structured outputs: OpenAI's response_format, vLLM's object and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: JsonSchema | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def constraint(self, tools: tuple[str, dict] | None = None
                   ) -> tuple[StructuredOutputsParams, str] | None:
        """The output's constraint and the field that gave it (``tools``: the one chat's
        tool_choice asks for); ValueError, starting with the field's name, when it is malformed
        or given twice."""
        given: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise ParamError("response_format",
                                 "response_format of type json_schema needs json_schema")
            schema = rf.json_schema.schema_
            given.append(("response_format", {"json": schema} if schema is not None
                          else {"json_object": True}))
        if self.structured_outputs is not None:
            so = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            given.append(("structured_outputs", so))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                given.append((f"guided_{kind}", {kind: value}))
        if tools is not None:
            given.append(tools)
        if not given:
            return None
        if len(given) > 1:
            raise ParamError(given[1][0], f"{given[1][0]} cannot be combined with "
                             f"{given[0][0]}: give one constraint on the output")
        name, spec = given[0]
        try:
            return StructuredOutputsParams(**spec), name
        except (TypeError, ValueError) as e:
            raise ParamError(name, f"{name}: {e}") from e

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        structured: StructuredOutputsParams | None = None,
                        defaults: dict | None = None) -> SamplingParams:
        """``defaults``: the model's (--generation-config), for the fields the request left
        unset."""
        fields = dict(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            logprobs=logprobs, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, structured_outputs=structured,
            logit_bias=self.logit_bias or None, prompt_logprobs=self.prompt_logprobs)
        fields.update({k: v for k, v in (defaults or {}).items() if k not in self.model_fields_set})
        return SamplingParams(**fields)


class PromptLogprob(BaseModel):
    """One entry of vLLM's ``prompt_logprobs``, keyed by token id."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


def prompt_logprobs_of(out: RequestOutput) -> PromptLogprobs | None:
    if out.prompt_logprobs is None:
        return None
    return [None if entries is None else
            {tid: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
             for tid, lp in entries.items()} for entries in out.prompt_logprobs]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="prompt tokens served from the prefix cache")


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, outputs: list[RequestOutput]) -> UsageInfo:
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(s.token_ids) for o in outputs for s in o.outputs)
        cached = sum(o.num_cached_tokens for o in outputs)
        return cls(prompt_tokens=prompt, completion_tokens=completion,
                   total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


# -- /v1/completions ---------------------------------------------------------------------------
class CompletionRequest(SamplingFields):
    prompt: (str | Annotated[list[str], Field(max_length=MAX_PROMPTS)] | list[int]
             | Annotated[list[list[int]], Field(max_length=MAX_PROMPTS)])
    max_tokens: int = Field(16, ge=0, description="0 with echo: the prompt alone (with "
                            "logprobs, its log-likelihood)")
    logprobs: int | None = Field(None, ge=0, description="at most --max-logprobs (20)")
    echo: bool = False


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=lambda v: v is None)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# -- /v1/chat/completions ----------------------------------------------------------------------
class TextContentPart(BaseModel):
    type: Literal["text"] = "text"
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as a JSON object, in a string")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_MESSAGES)
    tool_call_id: str | None = None

    @property
    def text(self) -> str:
        return text_of(self.content)


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatPromptFields(BaseModel):
    """What a chat's prompt is made of: the chat route and /tokenize build it alike."""

    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    tools: list[ChatTool] | None = Field(None, max_length=256)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description=
                                         "vLLM's: continue the last message's text (with "
                                         "add_generation_prompt false)")
    # keywords for the chat template (e.g. {"enable_thinking": false}), as vLLM takes them
    chat_template_kwargs: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingFields, ChatPromptFields):
    parallel_tool_calls: bool = True
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI; still honoured")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, description="at most --max-logprobs (20)")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # with --reasoning-parser only (absent otherwise, as OpenAI sends it)
    reasoning_content: str | None = Field(None, exclude_if=lambda v: v is None)
    tool_calls: list[ToolCall] = []


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=lambda v: v is None)


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = Field(None, exclude_if=lambda v: v is None)
    # absent, not null, in a delta without calls (as OpenAI streams them)
    tool_calls: list[DeltaToolCall] | None = Field(None, exclude_if=lambda v: v is None)


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    # (in the first chunk after the prompt's computed)
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=lambda v: v is None)


# -- the rest ----------------------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "conveyor"
    root: str | None = None
    max_model_len: int | None = None
    # Conveyor's: the tokens that end a reply (eos, end of turn...), by id, and their texts
    stop_token_ids: list[int] | None = None
    stop_tokens: list[str] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class EngineSteps(BaseModel):
    steps: list[StepRecord]
    next: int = Field(description="the number the next step will get: `since` for the next poll")


class VersionInfo(BaseModel):
    version: str
    device: str          # where the model runs: cpu or cuda
    dtype: str
    dtype_reason: str    # why that dtype ("auto: the CPU has no bfloat16 arithmetic", ...)
    cpu_isa: str         # the CPU kernel tier: generic, avx2, avx512 or amx
    cpu_isa_reason: str  # the CPU flags that decided it (or CONVEYOR_CPU_ISA)
    kernels: str         # which path the model runs, and why
    load_seconds: float  # the model's load: file, weights placed for the kernels, kernels built
    batch_invariant: bool  # a request's tokens independent of its batch (--batch-invariant)
    kv_cache_dtype: str  # what the KV cache stores: the model dtype or int8 (--kv-cache-dtype)
    tensor_parallel_size: int  # ranks each replica's layers are split across


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
