"""Tool calling without a model: the prompt's messages, the tool_choice constraint, parsing the
Hermes format and streaming it, on outputs written by hand."""

from __future__ import annotations

import json

import pytest

from conveyor.outputs import CompletionOutput
from conveyor.server.protocol import ChatCompletionRequest
from conveyor.server.streaming import TextDeltas
from conveyor.server.tools import (ToolCallDeltas, parse_tool_calls, template_messages,
                                   tool_constraint, tool_mode)

TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "2 + 3?"}], **kw)


def test_auto_parses_hermes_calls_and_keeps_the_rest_as_content():
    text = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
            '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}')
    content, calls = parse_tool_calls(text, "auto")
    assert content == "Let me add."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("add", {"a": 2, "b": 3}), ("add", {"a": 1, "b": 1})]
    assert len({c.id for c in calls}) == 2
    assert parse_tool_calls("no calls here", "auto") == ("no calls here", [])
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(broken, "auto") == (broken, [])


def test_required_and_named_outputs_become_calls():
    content, calls = parse_tool_calls('[{"name": "add", "arguments": {"a": 1, "b": 2}}]',
                                      "required")
    assert content is None and calls[0].function.name == "add"
    assert json.loads(calls[0].function.arguments) == {"a": 1, "b": 2}
    assert parse_tool_calls('[{"name": "ad', "required") == ('[{"name": "ad', [])  # cut short
    content, calls = parse_tool_calls('{"a": 1, "b": 2}', "add")
    assert content is None and calls[0].function.arguments == '{"a": 1, "b": 2}'


def test_tool_choice_modes_and_constraints():
    assert tool_mode(request()) is None
    assert tool_mode(request(tools=[TOOL])) == "auto"
    assert tool_mode(request(tools=[TOOL], tool_choice={"type": "function",
                                                        "function": {"name": "add"}})) == "add"
    with pytest.raises(ValueError, match="needs tools"):
        tool_mode(request(tool_choice="required"))
    body = request(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    field, spec = tool_constraint(body, "required")
    assert field == "tool_choice" and spec["json"]["maxItems"] == 1
    assert spec["json"]["items"]["anyOf"][0]["properties"]["name"] == {"const": "add"}
    assert tool_constraint(body, "add")[1] == {"json": TOOL["function"]["parameters"]}
    assert tool_constraint(body, "auto") is None


def test_tools_go_to_a_template_that_takes_them_else_into_the_system_message():
    call = {"id": "c1", "type": "function", "function": {"name": "add",
                                                         "arguments": '{"a": 2, "b": 3}'}}
    body = request(tools=[TOOL])
    body.messages += ChatCompletionRequest(messages=[
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"}]).messages
    messages, tools = template_messages(body, "auto", "{% for m in messages %}{% endfor %}")
    assert tools is None and messages[0]["role"] == "system"
    assert '"name": "add"' in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2]["content"] == ('<tool_call>\n{"name": "add", "arguments": {"a": 2, '
                                      '"b": 3}}\n</tool_call>')
    assert messages[3] == {"role": "tool", "content": "5", "tool_call_id": "c1"}
    messages, tools = template_messages(body, "auto", "{{ tools }}{{ m.tool_calls }}")
    assert tools == [TOOL] and messages[0]["role"] == "user"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 3}
    assert template_messages(body, "none", "")[1] is None


def stream(mode: str, pieces: list[str]) -> list:
    """The deltas a sample growing by ``pieces`` gives, the last piece finishing it."""
    d, text, out = ToolCallDeltas(mode, TextDeltas([])), "", []
    for i, piece in enumerate(pieces):
        text += piece
        done = i == len(pieces) - 1
        sample = CompletionOutput(0, text, list(range(i + 1)), "stop" if done else None)
        delta, _ = d.next(sample)
        if delta is not None:
            out.append(delta)
    return out


def test_auto_streams_content_until_a_call_begins_then_sends_the_calls_whole():
    deltas = stream("auto", ["Sure", ". <tool", "_call>", '{"name": "add", ',
                             '"arguments": {"a": 1, "b": 2}}', "</tool_call>"])
    content = "".join(d.content or "" for d in deltas)
    assert content == "Sure. "  # "<tool" was held back, then never sent
    calls = [c for d in deltas for c in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].function.name == "add" and calls[0].id
    held = stream("auto", ["a <tool", "box>"])  # not a call after all: all of it is content
    assert [d.content for d in held] == ["a ", "<toolbox>"]


def test_a_named_function_streams_its_arguments():
    deltas = stream("add", ['{"a": ', "1, ", '"b": 2}'])
    first, *rest = [c for d in deltas for c in d.tool_calls]
    assert first.function.name == "add" and first.id and first.index == 0
    assert first.function.arguments + "".join(c.function.arguments for c in rest) == \
        '{"a": 1, "b": 2}'
    assert all(c.id is None and c.function.name is None for c in rest)
