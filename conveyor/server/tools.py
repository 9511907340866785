"""Tool calling: tools into the prompt, ``tool_choice`` into a constraint, and the model's
output back into ``tool_calls``.

The calls' format is Hermes' (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``),
which Qwen2.5/3 and many fine-tunes are trained on. A chat template that knows tools renders
them itself; one that does not (SmolLM2's) gets them described in the system message, and an
assistant's earlier calls folded into its content in the same format. ``required`` constrains
the output to a JSON array of calls (at most ``MAX_PARALLEL_CALLS``; the request ends with the
array), a named function to that function's arguments (as vLLM), both under OpenAI's ``strict``
schemas; ``auto`` leaves the model free and parses what it wrote. Calls stream as OpenAI
streams them, each call's arguments as they grow; one cut short by max_tokens is dropped from
the answer (a stream has sent it as far as it went).
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


MAX_PARALLEL_CALLS = 16  # the array's bound: a model stuck repeating a call ends there


def _arguments_schema(tool) -> dict:
    """A tool's arguments schema as its constraint: OpenAI's ``strict`` (unlisted properties
    refused where the schema does not allow them) unless the tool says ``strict: false``."""
    schema = tool.function.parameters or {"type": "object"}
    return schema if tool.function.strict is False else strict_schema(schema)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("additionalProperties", "items", "additionalItems", "contains",
               "unevaluatedItems")
# schemas that hold for the same value as the one they sit in: an object's parts, when they
# name properties, are fragments of it, closed by it rather than each on its own
_SAME_VALUE = ("allOf", "anyOf", "oneOf", "then", "else")


def _objectish(schema) -> bool:
    kind = schema.get("type") if isinstance(schema, dict) else None
    return (kind == "object" or (isinstance(kind, list) and "object" in kind)
            or isinstance(schema, dict) and isinstance(schema.get("properties"), dict))


def strict_schema(schema, _fragment: bool = False):
    """A copy of a JSON schema in which every object schema that does not state
    ``additionalProperties`` has it false (OpenAI's ``strict``): in ``properties``, ``items``,
    ``prefixItems``, ``anyOf``/``oneOf``/``allOf``, ``$defs`` and the rest; not under ``not``
    or ``if``, where it would change what they let through. Parts of an object that hold for
    the object itself (``allOf``'s always, ``anyOf``/``oneOf``'s beside its own
    ``properties``) stay open, and the object closes over their properties and its own
    together. The argument is not modified."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict_schema(v) for k, v in out[key].items()}
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    for key in ("items", "prefixItems"):
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(s) for s in out[key]]
    own = isinstance(out.get("properties"), dict)
    parts: list = []
    for key in _SAME_VALUE:
        value = out.get(key)
        fragment = key not in ("anyOf", "oneOf") or own
        if isinstance(value, list):
            out[key] = [strict_schema(s, fragment) for s in value]
            parts += out[key]
        elif isinstance(value, dict):
            out[key] = strict_schema(value, fragment)
            parts.append(out[key])
    objectish = _objectish(out) or any(_objectish(p) for p in out.get("allOf") or [])
    stated = "additionalProperties" in out or "unevaluatedProperties" in out
    if _fragment or stated or not objectish:
        return out
    props = out["properties"] if own else {}
    names = [n for p in parts if isinstance(p, dict) and isinstance(p.get("properties"), dict)
             for n in p["properties"] if n not in props]
    if names and (own or "properties" not in out):  # the parts' properties are the object's
        out["properties"] = {**props, **dict.fromkeys(names, {})}
    out["additionalProperties"] = False
    return out


_VALUES = ("const", "enum", "default", "examples")  # data, not schemas


def _moved(schema, pointer: str):
    """``schema`` with its local references (``#``, ``#/...``) made to work from ``pointer``,
    where it now sits inside the calls' array (``$defs`` stay where they are: two tools may
    both have a ``Point``)."""
    if isinstance(schema, list):
        return [_moved(s, pointer) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value[:2] == "#/"):
            out[key] = pointer + value[1:]
        elif key in _VALUES:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # names to schemas
            out[key] = {name: _moved(s, pointer) for name, s in value.items()}
        else:
            out[key] = _moved(value, pointer)
    return out


def tool_constraint(body: ChatCompletionRequest, mode: str | None) -> tuple[str, dict] | None:
    """The structured-outputs spec ``tool_choice`` asks for, as (field, spec)."""
    if mode in (None, "none", "auto"):
        return None
    if mode != "required":
        tool = next(t for t in body.tools if t.function.name == mode)
        return "tool_choice", {"json": _arguments_schema(tool)}
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t.function.name}, "arguments": _moved(
                  _arguments_schema(t), f"#/items/anyOf/{i}/properties/arguments")}}
             for i, t in enumerate(body.tools)]
    schema = {"type": "array", "minItems": 1,
              "maxItems": MAX_PARALLEL_CALLS if body.parallel_tool_calls else 1,
              "items": {"anyOf": calls}}
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


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments) -> ToolCall:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=_call_id(), function=FunctionCall(name=name, arguments=arguments))


# -- reading calls out of a growing text ---------------------------------------------------------
_WS = " \t\n\r"


class _NotACall(ValueError):
    """The text is not (the beginning of) what a call looks like."""


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _value_end(text: str, i: int) -> int | None:
    """One past the end of the JSON value that begins at ``text[i]``; None while the text ends
    inside it. Strings and brackets are matched, not validated."""
    n = len(text)
    if text[i] == '"':
        j = i + 1
        while j < n:
            if text[j] == '"':
                return j + 1
            j += 2 if text[j] == "\\" else 1
        return None
    if text[i] in "{[":
        depth, in_string, j = 0, False, i
        while j < n:
            c = text[j]
            if in_string:
                if c == "\\":
                    j += 1
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < n and text[j] not in _WS + ',:{}[]"':
        j += 1
    if j == i:
        raise _NotACall(f"no JSON value at {text[i]!r}")
    return j if j < n else None


def _object_fields(text: str, i: int, fields: dict[str, tuple[int, int | None]]) -> int | None:
    """Reads the JSON object beginning at ``text[i]`` so far into ``fields``, its keys' values
    as (start, end; None while open); one past its closing brace (None while open)."""
    n = len(text)
    j = _skip(text, i + 1)
    if j < n and text[j] == "}":
        return j + 1
    while j < n:
        if text[j] != '"':
            raise _NotACall("an object's key is not a string")
        end = _value_end(text, j)
        if end is None:
            break
        key = json.loads(text[j:end])
        j = _skip(text, end)
        if j >= n:
            break
        if text[j] != ":":
            raise _NotACall("no colon after an object's key")
        j = _skip(text, j + 1)
        if j >= n:
            break
        end = _value_end(text, j)
        fields[key] = (j, end)
        if end is None:
            break
        j = _skip(text, end)
        if j < n and text[j] == "}":
            return j + 1
        if j < n and text[j] != ",":
            raise _NotACall("no comma between an object's members")
        j = _skip(text, j + 1)
    return None


@dataclass
class _Call:
    """A call in the text: known once its name is whole and its arguments have begun."""

    id: str = field(default_factory=_call_id)
    name: str | None = None
    arguments: tuple[int, int | None] | None = None  # the value's (start, end) in the text
    complete: bool = False
    sent: int | None = None  # characters of the arguments streamed; None: not announced yet
    all_sent: bool = False

    @property
    def known(self) -> bool:
        return self.name is not None and (self.arguments is not None or self.complete)

    def read(self, text: str, fields: dict[str, tuple[int, int | None]],
             end: int | None) -> None:
        """Take in the call's object as it now stands; _NotACall when it cannot be one."""
        name = fields.get("name")
        if self.name is None and name is not None and name[1] is not None:
            value = json.loads(text[name[0]:name[1]])
            if not isinstance(value, str):
                raise _NotACall("a call's name is not a string")
            self.name = value
        self.arguments = fields.get("arguments")
        if end is not None:
            if self.name is None:
                raise _NotACall("a call without a name")
            self.complete = True

    def arguments_text(self, text: str) -> str:
        if self.arguments is None:
            return "{}" if self.complete else ""
        start, end = self.arguments
        return text[start:len(text) if end is None else end]

    def tool_call(self, text: str) -> ToolCall:
        return ToolCall(id=self.id, function=FunctionCall(name=self.name,
                                                          arguments=self.arguments_text(text)))


class _CallReader:
    """Reads the calls of a ``required`` or ``auto`` output as it grows, one text at a time
    (each the last one extended): ``required``'s JSON array of calls, item by item, or
    ``auto``'s text with Hermes calls in it. A call's arguments are the model's own text of
    them, so that the streamed pieces add up to the whole; streamed or not, a call is read the
    same way. A call cut short (by max_tokens or a stop string) is not one; an ``auto`` call
    that turns out not to be JSON is text."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.phase = "open" if mode == "required" else "text"
        self.pos = 0           # where reading resumes
        self.tag = 0           # auto: where the current call's <tool_call> is
        self.content = ""      # auto: the text outside calls, as far as it is known to be
        self.calls: list[_Call] = []

    def feed(self, text: str, finished: bool) -> None:
        if self.mode != "required":
            return self._hermes(text, finished)
        try:
            self._array(text)
        except ValueError:  # the rest is not calls (which the grammar keeps from happening)
            self.phase = "done"

    def result(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = [c.tool_call(text) for c in self.calls if c.complete]
        if self.mode == "required":
            return None, calls
        return (self.content.strip() or None) if calls else self.content, calls

    def _array(self, text: str) -> None:
        while self.phase != "done":
            j = _skip(text, self.pos)
            if j >= len(text):
                return
            if self.phase == "in":  # the current call's object, from its start
                call, fields = self.calls[-1], {}
                end = _object_fields(text, j, fields)
                call.read(text, fields, end)
                if end is None:
                    return
                self.phase, self.pos = "between", end
                continue
            expected = {"open": "[", "item": "{]", "between": ",]"}[self.phase]
            if text[j] not in expected:
                raise _NotACall(f"{text[j]!r} where the array of calls has one of {expected}")
            if text[j] == "{":
                self.calls.append(_Call())
                self.phase, self.pos = "in", j
            else:
                self.phase = "done" if text[j] == "]" else "item"
                self.pos = j + 1

    def _hermes(self, text: str, finished: bool) -> None:
        while True:
            if self.phase == "text":
                start = text.find(CALL_OPEN, self.pos)
                if start < 0:
                    safe = len(text) if finished else _without_partial_open(text)
                    self.content += text[self.pos:max(safe, self.pos)]
                    self.pos = max(safe, self.pos)
                    return
                self.content += text[self.pos:start]
                self.tag, self.pos, self.phase = start, start + len(CALL_OPEN), "call"
            elif self.phase == "call":
                if not self._hermes_call(text, finished):
                    return
            else:  # "after": the call's JSON is read; up to its </tool_call> is the call's
                close = text.find(CALL_CLOSE, self.pos)
                again = text.find(CALL_OPEN, self.pos)
                if close >= 0 and (again < 0 or close < again):
                    self.pos, self.phase = close + len(CALL_CLOSE), "text"
                elif again >= 0:
                    self.pos, self.phase = again, "text"
                else:
                    self.pos = len(text) if finished else self.pos
                    return

    def _hermes_call(self, text: str, finished: bool) -> bool:
        """Read on in the current call; whether there is more to read after it."""
        j = _skip(text, self.pos)
        if j < len(text) and text[j] == "{":
            if not self.calls or self.calls[-1].complete:
                self.calls.append(_Call())
            call = self.calls[-1]
        elif j >= len(text) and not finished:
            return False
        else:
            return self._not_a_call(text)
        fields: dict[str, tuple[int, int | None]] = {}
        try:
            end = _object_fields(text, j, fields)
            call.read(text, fields, end)
        except ValueError:
            try:
                call.read(text, fields, None)  # as far as it was JSON
            except ValueError:
                pass
            if not (call.known and call.arguments and call.arguments[1] is not None):
                return self._not_a_call(text)
            call.complete, end = True, call.arguments[1]  # a call, with junk after it
        if end is not None:
            self.pos, self.phase = end, "after"
            return True
        if finished and not call.known:
            return self._not_a_call(text)
        return False  # a call read so far (or cut short, which drops it)

    def _not_a_call(self, text: str) -> bool:
        """The <tool_call> at ``self.tag`` opens no call: it is text."""
        if self.calls and not self.calls[-1].complete:
            self.calls.pop()
        self.content += text[self.tag:self.tag + len(CALL_OPEN)]
        self.pos, self.phase = self.tag + len(CALL_OPEN), "text"
        return True


def parse_tool_calls(text: str, mode: str | None) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished output under ``mode``. ``required``: the complete
    calls of the array (all of them unless it was cut short), never content."""
    if mode in (None, "none"):
        return text, []
    if mode not in ("auto", "required"):
        return None, [_call(mode, text)]
    reader = _CallReader(mode)
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
    reader: _CallReader | None = None

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
            self.reader = _CallReader(self.mode)
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
            content = content.rstrip(_WS)  # held: dropped if calls follow
        self.sent_content += len(content)
        if not (content or calls):
            return None, tokens
        return DeltaMessage(content=content or None, tool_calls=calls or None), tokens


def _without_partial_open(text: str) -> int:
    """Where ``text`` stops being safe to send: before a tail that may begin ``<tool_call>``."""
    for k in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)
