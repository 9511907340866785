"""Reading Hermes tool calls out of a model's growing text (``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` under ``auto``, a JSON array of calls under ``required``): one reader for
the finished text and the stream alike, so that streamed calls add up to the answer's, each
call's arguments the model's own text."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from conveyor.server.protocol import FunctionCall, ToolCall

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


WHITESPACE = " \t\n\r"


class _NotACall(ValueError):
    """The text is not (the beginning of) what a call looks like."""


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
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
    while j < n and text[j] not in WHITESPACE + ',:{}[]"':
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

    id: str = field(default_factory=call_id)
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


class CallReader:
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


def _without_partial_open(text: str) -> int:
    """Where ``text`` stops being safe to send: before a tail that may begin ``<tool_call>``."""
    for k in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)
