"""Tool calling: tools into the prompt, ``tool_choice`` into a constraint, and the model's
output back into ``tool_calls``.

The calls' format is Hermes' (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``),
which Qwen2.5/3 and many fine-tunes are trained on. A chat template that knows tools renders
them itself; one that does not (SmolLM2's) gets them described in the system message, and an
assistant's earlier calls folded into its content in the same format. ``required`` constrains
the output to a JSON array of calls, a named function to that function's arguments (as vLLM);
``auto`` leaves the model free and parses what it wrote.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from conveyor.outputs import CompletionOutput
from conveyor.server.protocol import (ChatCompletionRequest, DeltaFunctionCall,
                                      DeltaMessage, DeltaToolCall, FunctionCall, ToolCall)
from conveyor.server.streaming import TextDeltas

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALLS = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CALL_CLOSE) + r"|$)",
                    re.DOTALL)
_SYSTEM = (
    "You are a function calling AI model. You may call one or more functions to assist with "
    "the user query. The functions you can call are given within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n"
    "For each function call, return a JSON object with the function name and its arguments "
    "within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def tool_mode(body: ChatCompletionRequest) -> str | None:
    """None (no tools), "none", "auto", "required" or the name of the function to call."""
    if not body.tools:
        if body.tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return None
    choice = body.tool_choice or "auto"
    if isinstance(choice, str):
        return choice
    names = [t.function.name for t in body.tools]
    if choice.function.name not in names:
        raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is "
                         f"not among the tools {names}")
    return choice.function.name


def _arguments_schema(parameters: dict | None) -> dict:
    return parameters if parameters else {"type": "object"}


def tool_constraint(body: ChatCompletionRequest, mode: str | None) -> tuple[str, dict] | None:
    """The structured-outputs spec ``tool_choice`` asks for, as (field, spec)."""
    if mode in (None, "none", "auto"):
        return None
    if mode != "required":
        tool = next(t for t in body.tools if t.function.name == mode)
        return "tool_choice", {"json": _arguments_schema(tool.function.parameters)}
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t.function.name},
                             "arguments": _arguments_schema(t.function.parameters)}}
             for t in body.tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    return "tool_choice", {"json": schema}


def _call_text(call: ToolCall) -> str:
    return json.dumps({"name": call.function.name,
                       "arguments": _loads_or_text(call.function.arguments)},
                      ensure_ascii=False)


def template_messages(body: ChatCompletionRequest, mode: str | None, template: str
                      ) -> tuple[list[dict], list[dict] | None]:
    """The messages as the chat template takes them, and the tools to pass it (None where the
    template does not take tools: they are then described in the system message)."""
    knows_calls = "tool_calls" in template
    messages = []
    for m in body.messages:
        message = {"role": "system" if m.role == "developer" else m.role, "content": m.text}
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls and knows_calls:  # templates take arguments as a mapping
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _loads_or_text(c.function.arguments)}}
                for c in m.tool_calls]
        elif m.tool_calls:
            message["content"] = "\n".join([m.text] * bool(m.text) + [
                f"{CALL_OPEN}\n{_call_text(c)}\n{CALL_CLOSE}" for c in m.tool_calls])
        messages.append(message)
    if mode in (None, "none"):
        return messages, None
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    if "tools" in template:
        return messages, tools
    described = _SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + described}
    else:
        messages.insert(0, {"role": "system", "content": described})
    return messages, None


def _loads_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def _call(name: str, arguments) -> ToolCall:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(
        name=name, arguments=arguments))


def parse_tool_calls(text: str, mode: str | None) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished output under ``mode``."""
    if mode in (None, "none"):
        return text, []
    if mode == "required":
        try:
            return None, [_call(c["name"], c["arguments"]) for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):  # cut short by max_tokens or a stop string
            return text, []
    if mode != "auto":
        return None, [_call(mode, text)]
    calls, kept = [], []
    for match in _CALLS.finditer(text):
        try:
            call = json.loads(match.group(1))
            calls.append(_call(call["name"], call.get("arguments", {})))
        except (ValueError, TypeError, KeyError):
            kept.append(match.group(0))  # not a call after all: it stays text
    content = (_CALLS.sub("", text) + "".join(kept)).strip() if calls else text
    return content or None, calls


def finish_reason(sample: CompletionOutput, calls: list[ToolCall]) -> str | None:
    return "tool_calls" if calls and sample.finish_reason == "stop" else sample.finish_reason


@dataclass
class ToolCallDeltas:
    """One sample's stream under tools: content streams as usual until a call can begin; a
    named function's arguments stream as they grow; other calls are sent whole at the end."""

    mode: str
    text: TextDeltas
    seen: str = ""           # text so far
    sent_content: int = 0    # characters of ``seen`` sent as content
    sent_name: bool = False
    calls: list[ToolCall] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.text.done

    def next(self, sample: CompletionOutput) -> tuple[DeltaMessage | None, slice]:
        delta, tokens = self.text.next(sample)
        self.seen += delta
        if self.mode not in ("auto", "required"):  # a named function
            first = not self.sent_name
            self.sent_name = True
            if not delta and not first:
                return None, tokens
            call = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))
            if first:
                self.calls = [_call(self.mode, "")]
                call.id, call.type = self.calls[0].id, "function"
                call.function.name = self.mode
            return DeltaMessage(tool_calls=[call]), tokens
        content = ""
        if self.mode == "auto":
            start = self.seen.find(CALL_OPEN)
            safe = len(self.seen) if start < 0 and sample.finished else (
                start if start >= 0 else _without_partial_open(self.seen))
            content = self.seen[self.sent_content:max(safe, self.sent_content)]
            self.sent_content = max(safe, self.sent_content)
        if not sample.finished:
            return (DeltaMessage(content=content) if content else None), tokens
        rest, self.calls = parse_tool_calls(self.seen, self.mode)
        if not self.calls:  # no call after all: the held text is content
            content += self.seen[self.sent_content:]
            return (DeltaMessage(content=content) if content else None), tokens
        return DeltaMessage(content=content or None, tool_calls=[
            DeltaToolCall(index=i, id=c.id, type="function", function=DeltaFunctionCall(
                name=c.function.name, arguments=c.function.arguments))
            for i, c in enumerate(self.calls)]), tokens


def _without_partial_open(text: str) -> int:
    """Where ``text`` stops being safe to send: before a tail that may begin ``<tool_call>``."""
    for k in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)
