"""Request and response bodies of OpenAI's Responses API (``POST /v1/responses``), stateless:
text in and out, function tools, and the text formats; nothing is stored."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from conveyor.server.protocol import (FUNCTION_NAME, MAX_MESSAGES, JsonSchema,
                                      refuse_unimplemented, text_of)

# Fields of OpenAI's request that this server does not implement: set to anything but the
# values that change nothing (listed), each is a 400 naming it.
RESPONSES_NOT_IMPLEMENTED: dict[str, tuple] = {
    "previous_response_id": (None,), "conversation": (None,), "background": (None, False),
    "include": (None, []), "reasoning": (None, {}), "truncation": (None, "disabled"),
    "prompt": (None,), "max_tool_calls": (None,), "top_logprobs": (None, 0),
    "service_tier": (None, "auto", "default"), "prompt_cache_key": (None,),
    "prompt_cache_retention": (None,), "safety_identifier": (None,),
    "stream_options": (None, {}, {"include_obfuscation": False}),
}


_NOT_STORED = ("previous_response_id: this server stores no responses (every response has "
               "store false); send the whole conversation in input")


class InputText(BaseModel):
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(BaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return text_of(self.content)


class FunctionCallInput(BaseModel):
    """A call the model made earlier, sent back (an assistant message's tool call)."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputInput(BaseModel):
    """The result of a call (a tool message)."""
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return text_of(self.output)


def _item_type(item: Any) -> str | None:
    if isinstance(item, dict):
        return item.get("type", "message")  # an easy input message may leave it out
    return getattr(item, "type", None)


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallInput, Tag("function_call")]
    | Annotated[FunctionCallOutputInput, Tag("function_call_output")],
    Discriminator(_item_type, custom_error_type="invalid_item", custom_error_message=(
        "an input item is a message, a function_call or a function_call_output (other kinds "
        "are not implemented by this server)"))]


class FunctionTool(BaseModel):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class FunctionToolChoice(BaseModel):
    type: Literal["function"]
    name: str


def _none(value: Any) -> bool:
    return value is None


class TextFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    # (absent, not null, when not given: echoed as OpenAI does)
    name: str | None = Field(None, max_length=64, exclude_if=_none)
    description: str | None = Field(None, exclude_if=_none)
    schema_: JsonSchema | None = Field(None, alias="schema", exclude_if=_none)
    strict: bool | None = Field(None, exclude_if=_none)


class TextConfig(BaseModel):
    format: TextFormat = TextFormat(type="text")
    verbosity: Literal["medium"] | None = "medium"


class ResponsesRequest(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        refuse_unimplemented(data, RESPONSES_NOT_IMPLEMENTED,
                             messages={"previous_response_id": _NOT_STORED})
        return data

    model: str | None = Field(None, description="must be a served model name when given")
    input: str | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES - 1)]
    instructions: str | None = Field(None, description="a system message before the input")
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = Field(None, max_length=256)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = Field(None, description="accepted, but nothing is stored: every "
                               "response says store false (as vLLM without its store)")
    metadata: dict[str, str] | None = Field(None, max_length=16, description="echoed")
    user: str | None = None


# -- the response --------------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = []


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


Status = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Status
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputReasoning(BaseModel):
    """With --reasoning-parser: what the model thought before answering."""
    type: Literal["reasoning"] = "reasoning"
    id: str
    status: Status
    summary: list = []
    content: list[ReasoningText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Status


OutputItem = OutputMessage | OutputReasoning | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = []
    usage: ResponseUsage | None = None
    # the request's settings, echoed
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    tools: list[FunctionTool] = []
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = TextConfig()
    store: Literal[False] = False
    metadata: dict[str, str] = {}
    user: str | None = None
    previous_response_id: None = None
    background: Literal[False] = False
    truncation: Literal["disabled"] = "disabled"
