"""Tool calling: tools into the prompt, ``tool_choice`` into a constraint, and the model's
output back into ``tool_calls``.

The calls' format is Hermes' (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``),
which Qwen2.5/3 and many fine-tunes are trained on. A chat template that knows tools renders
them itself; one that does not (SmolLM2's) gets them described in the system message, and an
assistant's earlier calls folded into its content in the same format. ``required`` and a named
function constrain the output (``tool_schemas``); ``auto`` leaves the model free. What it wrote
is read back (``tool_calls``) into calls that stream as OpenAI streams them, each call's
arguments as they grow; one cut short by max_tokens is dropped from the answer (a stream has
sent it as far as it went).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

from conveyor.outputs import CompletionOutput
from conveyor.server.protocol import (ChatPromptFields, DeltaFunctionCall,
                                      DeltaMessage, DeltaToolCall, FunctionCall, ToolCall)
from conveyor.server.streaming import TextDeltas
from conveyor.server.tool_calls import CALL_CLOSE, CALL_OPEN, WHITESPACE, CallReader, call_id

_SYSTEM = (
    "You are a function calling AI model. You may call one or more functions to assist with "
    "the user query. The functions you can call are given within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n"
    "For each function call, return a JSON object with the function name and its arguments "
    "within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def check_tool_schemas(body: ChatPromptFields) -> None:
    """ValueError naming the first tool whose parameters are no JSON schema (whatever the
    tool_choice: OpenAI refuses them even where no call is forced)."""
    for i, tool in enumerate(body.tools or []):
        schema = tool.function.parameters
        if schema is None:
            continue
        try:
            validator_for(schema, default=Draft202012Validator).check_schema(schema)
        except SchemaError as e:
            raise ValueError(f"tools[{i}] ({tool.function.name!r}): its parameters are not a "
                             f"valid JSON schema: {e.message}") from None


def tool_mode(body: ChatPromptFields) -> str | None:
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


def _call_text(call: ToolCall) -> str:
    return json.dumps({"name": call.function.name,
                       "arguments": _loads_or_text(call.function.arguments)},
                      ensure_ascii=False)


def template_messages(body: ChatPromptFields, mode: str | None, template: str
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
    return ToolCall(id=call_id(), function=FunctionCall(name=name, arguments=arguments))


def parse_tool_calls(text: str, mode: str | None) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished output under ``mode``. ``required``: the complete
    calls of the array (all of them unless it was cut short), never content."""
    if mode in (None, "none"):
        return text, []
    if mode not in ("auto", "required"):
        return None, [_call(mode, text)]
    reader = CallReader(mode)
    reader.feed(text, True)
    return reader.result(text)


def finish_reason(sample: CompletionOutput, calls: list[ToolCall]) -> str | None:
    return "tool_calls" if calls and sample.finish_reason == "stop" else sample.finish_reason


@dataclass
class ToolCallDeltas:
    """One sample's stream under tools, calls as OpenAI streams them: per call a first delta
    with its index, id, type, name and its arguments so far, then the arguments as they grow.
    Under ``auto`` content streams until a call can begin (trailing whitespace is held: it is
    dropped when calls follow, as in the unstreamed answer)."""

    mode: str
    text: TextDeltas
    seen: str = ""           # text so far
    sent_content: int = 0    # characters of the reader's content sent
    sent_name: bool = False
    calls: list[ToolCall] = field(default_factory=list)  # the finished sample's calls
    reader: CallReader | None = None

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
        if self.reader is None:
            self.reader = CallReader(self.mode)
        reader = self.reader
        reader.feed(self.seen, sample.finished)
        calls = []
        for i, c in enumerate(reader.calls):
            if not c.known or c.all_sent:
                continue
            arguments = c.arguments_text(self.seen)
            if c.sent is None:
                calls.append(DeltaToolCall(index=i, id=c.id, type="function",
                                           function=DeltaFunctionCall(name=c.name,
                                                                      arguments=arguments)))
            elif len(arguments) > c.sent:
                calls.append(DeltaToolCall(index=i, function=DeltaFunctionCall(
                    arguments=arguments[c.sent:])))
            c.sent, c.all_sent = len(arguments), c.complete
        if sample.finished:
            _, self.calls = reader.result(self.seen)
        content = reader.content[self.sent_content:]
        if not (sample.finished and not self.calls):
            content = content.rstrip(WHITESPACE)  # held: dropped if calls follow
        self.sent_content += len(content)
        if not (content or calls):
            return None, tokens
        return DeltaMessage(content=content or None, tool_calls=calls or None), tokens
