"""``POST /v1/responses``: OpenAI's Responses API, stateless, over the chat path.

The request becomes a ``ChatCompletionRequest`` (``instructions`` a system message first,
function calls and their outputs assistant tool calls and tool messages, ``text.format`` the
response_format) and goes through ``create_chat_completion``: the same chat template, tools,
constraints and limits. Its answer becomes a response object; its stream of chunks becomes the
Responses API's events (``event:`` lines, each with a ``sequence_number``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError

from conveyor.server.chat import create_chat_completion
from conveyor.server.errors import APIError, bad_request
from conveyor.server.protocol import ChatCompletionRequest, ChatCompletionResponse
from conveyor.server.responses_protocol import (
    FunctionCallInput,
    IncompleteDetails,
    InputMessage,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
)
from conveyor.server.state import ServerState

# the chat request's fields that a 400 may name -> the Responses request's, and the words
# its message may use for them
_PARAMS = {"messages": ("input", ("messages",)),
           "max_completion_tokens": ("max_output_tokens", ("max_completion_tokens",
                                                           "max_tokens")),
           "response_format": ("text", ("response_format",))}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completions request that answers ``body``."""
    messages: list[dict] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    items = ([InputMessage(role="user", content=body.input)] if isinstance(body.input, str)
             else body.input)
    for item in items:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallInput):  # joins the assistant's turn, if it has one
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1]["tool_calls"] = [*messages[-1].get("tool_calls", []), call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    chat: dict = {"model": body.model, "messages": messages, "stream": body.stream,
                  "parallel_tool_calls": body.parallel_tool_calls, "user": body.user,
                  "max_completion_tokens": body.max_output_tokens}
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    for key in ("temperature", "top_p"):
        if getattr(body, key) is not None:
            chat[key] = getattr(body, key)
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"})}
                         for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        chat["tool_choice"] = choice if isinstance(choice, str) else {
            "type": "function", "function": {"name": choice.name}}
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "description": fmt.description,
            "schema": fmt.schema_, "strict": fmt.strict}}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:  # not expected: the Responses request was checked alike
        raise bad_request(f"input: {e.errors()[0]['msg']}", "input") from e


def _usage(usage: dict) -> ResponseUsage:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ResponseUsage(input_tokens=usage["prompt_tokens"],
                         input_tokens_details=InputTokensDetails(cached_tokens=cached),
                         output_tokens=usage["completion_tokens"],
                         output_tokens_details=OutputTokensDetails(),
                         total_tokens=usage["total_tokens"])


def _finish(response: ResponseObject, finish_reason: str | None) -> None:
    """The status: incomplete (and so the last item) when cut short at max_output_tokens."""
    if finish_reason == "length":
        response.status = "incomplete"
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        if response.output:
            response.output[-1].status = "incomplete"
    else:
        response.status = "completed"


async def create_response(body: ResponsesRequest, raw: Request, state: ServerState
                          ) -> Response | ResponseObject:
    try:
        answer = await create_chat_completion(to_chat(body), raw, state)
    except APIError as e:  # named as the Responses request names it
        if e.info.param in _PARAMS:
            e.info.param, words = _PARAMS[e.info.param]
            for word in words:
                e.info.message = e.info.message.replace(word, e.info.param)
        raise
    response = ResponseObject(
        id=_id("resp"), created_at=int(time.time()), status="in_progress",
        model=state.model_name, instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, tools=body.tools or [],
        tool_choice=body.tool_choice or "auto", parallel_tool_calls=body.parallel_tool_calls,
        text=body.text or TextConfig(), metadata=body.metadata or {}, user=body.user)
    if isinstance(answer, StreamingResponse):
        return StreamingResponse(_stream(answer.body_iterator, response),
                                 media_type="text/event-stream")
    if not isinstance(answer, ChatCompletionResponse):
        return answer  # the client left
    response.id = "resp_" + answer.id.split("-", 1)[-1]  # the engine's request id's
    choice = answer.choices[0]
    message = choice.message
    if message.reasoning_content:
        response.output.append(OutputReasoning(id=_id("rs"), status="completed", content=[
            ReasoningText(text=message.reasoning_content)]))
    if message.content or not message.tool_calls:
        response.output.append(OutputMessage(id=_id("msg"), status="completed", content=[
            OutputText(text=message.content or "")]))
    response.output += [OutputFunctionCall(id=_id("fc"), call_id=c.id, name=c.function.name,
                                           arguments=c.function.arguments, status="completed")
                        for c in message.tool_calls]
    _finish(response, choice.finish_reason)
    response.usage = _usage(answer.usage.model_dump())
    return response


class _Events:
    """Output items as they grow, and the events that say so (each method's: a list)."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.sequence_number = 0
        self.open: OutputItem | None = None

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **{
            k: v.model_dump(by_alias=True) if isinstance(v, BaseModel) else v
            for k, v in fields.items()}}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _at(self) -> dict:
        return {"item_id": self.open.id, "output_index": len(self.response.output) - 1}

    def add(self, item: OutputItem) -> list[str]:
        out = self.close()
        self.response.output.append(item)
        self.open = item
        out.append(self.event("response.output_item.added",
                              output_index=self._at()["output_index"], item=item))
        if not isinstance(item, OutputFunctionCall):
            out.append(self.event("response.content_part.added", **self._at(), content_index=0,
                                  part=item.content[0]))
        return out

    def text(self, delta: str, reasoning: bool = False) -> list[str]:
        out = []
        if not isinstance(self.open, OutputReasoning if reasoning else OutputMessage):
            out = self.add(
                OutputReasoning(id=_id("rs"), status="in_progress",
                                content=[ReasoningText(text="")]) if reasoning else
                OutputMessage(id=_id("msg"), status="in_progress", content=[OutputText(text="")]))
        self.open.content[0].text += delta
        return [*out, self.event("response.reasoning_text.delta" if reasoning
                                 else "response.output_text.delta", **self._at(),
                                 content_index=0, delta=delta,
                                 **({} if reasoning else {"logprobs": []}))]

    def call(self, delta: dict) -> list[str]:
        """A chat stream's tool call delta: a new call when it has an id."""
        function, out = delta.get("function") or {}, []
        if delta.get("id") is not None or not isinstance(self.open, OutputFunctionCall):
            out = self.add(OutputFunctionCall(
                id=_id("fc"), call_id=delta.get("id") or _id("call"),
                name=function.get("name") or "", arguments="", status="in_progress"))
        if function.get("arguments"):
            self.open.arguments += function["arguments"]
            out.append(self.event("response.function_call_arguments.delta", **self._at(),
                                  delta=function["arguments"]))
        return out

    def close(self, status: str = "completed") -> list[str]:
        item = self.open
        if item is None:
            return []
        at = self._at()
        self.open = None
        item.status = status
        if isinstance(item, OutputFunctionCall):
            out = [self.event("response.function_call_arguments.done", **at,
                              arguments=item.arguments, name=item.name)]
        else:
            part, thought = item.content[0], isinstance(item, OutputReasoning)
            out = [self.event(f"response.{'reasoning_text' if thought else 'output_text'}.done",
                              **at, content_index=0, text=part.text,
                              **({} if thought else {"logprobs": []})),
                   self.event("response.content_part.done", **at, content_index=0, part=part)]
        return [*out, self.event("response.output_item.done", output_index=at["output_index"],
                                 item=item)]


async def _stream(chunks: AsyncIterator[str], response: ResponseObject) -> AsyncIterator[str]:
    """The chat stream's chunks (``data:`` lines) in, the Responses API's events out."""
    events = _Events(response)
    finish_reason = None
    async with aclosing(chunks):  # leaving early ends the chat stream, which aborts
        async for line in chunks:
            if not line.startswith("data: {"):
                continue  # [DONE]
            chunk, out = json.loads(line[len("data: "):]), []
            if events.sequence_number == 0:  # the first chunk (the role) names the request
                response.id = "resp_" + str(chunk.get("id", uuid.uuid4().hex)).split("-", 1)[-1]
                out += [events.event("response.created", response=response),
                        events.event("response.in_progress", response=response)]
            if "error" in chunk:  # the chat stream's error event; it ends there
                error = chunk["error"]
                response.status = "failed"
                response.error = ResponseError(code=error.get("code") or "server_error",
                                               message=error["message"])
                yield "".join([*out, events.event("error", code=error.get("code"),
                                                  message=error["message"],
                                                  param=error.get("param")),
                               events.event("response.failed", response=response)])
                return
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    out += events.text(delta["reasoning_content"], reasoning=True)
                if delta.get("content"):
                    out += events.text(delta["content"])
                for call in delta.get("tool_calls") or []:
                    out += events.call(call)
                finish_reason = choice.get("finish_reason") or finish_reason
            if chunk.get("usage"):
                response.usage = _usage(chunk["usage"])
            if out:
                yield "".join(out)
    out = []
    if not response.output:  # an empty answer is an empty message, as when not streamed
        out = events.add(OutputMessage(id=_id("msg"), status="in_progress",
                                       content=[OutputText(text="")]))
    out += events.close("incomplete" if finish_reason == "length" else "completed")
    _finish(response, finish_reason)
    yield "".join([*out, events.event("response.incomplete" if response.status == "incomplete"
                                      else "response.completed", response=response)])
