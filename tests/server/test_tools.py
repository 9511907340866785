"""Tool calling: the prompt's messages, the tool_choice constraint (strict schemas, the bound
on parallel calls), parsing calls and streaming them, first on outputs written by hand, then
through the official client against a server of the default model."""

from __future__ import annotations

import copy
import json
import re

import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.core.grammar import GrammarCompiler
from conveyor.model.loader import load_tokenizer
from conveyor.outputs import CompletionOutput
from conveyor.sampling_params import StructuredOutputsParams
from conveyor.server.protocol import ChatCompletionRequest
from conveyor.server.streaming import TextDeltas
from conveyor.server.tool_schemas import (CALL_WHITESPACE, MAX_PARALLEL_CALLS, strict_schema,
                                         tool_constraint)
from conveyor.server.tools import ToolCallDeltas, parse_tool_calls, template_messages, tool_mode



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
    assert parse_tool_calls('[{"name": "ad', "required") == (None, [])  # cut short
    content, calls = parse_tool_calls('{"a": 1, "b": 2}', "add")
    assert content is None and calls[0].function.arguments == '{"a": 1, "b": 2}'


def test_tool_choice_modes_and_constraints(grammars):
    assert tool_mode(request()) is None
    assert tool_mode(request(tools=[TOOL])) == "auto"
    assert tool_mode(request(tools=[TOOL], tool_choice={"type": "function",
                                                        "function": {"name": "add"}})) == "add"
    with pytest.raises(ValueError, match="needs tools"):
        tool_mode(request(tool_choice="required"))
    body = request(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    field, spec = tool_constraint(body, "required")
    call = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    assert field == "tool_choice" and accepted(grammars, spec, f"[{call}]") == (True, True)
    assert accepted(grammars, spec, f"[{call}, ")[0] is False  # one call, not parallel ones
    assert accepted(grammars, spec, '[{"name": "sub", ')[0] is False
    assert tool_constraint(body, "add")[1] == {"json": {**TOOL["function"]["parameters"],
                                                        "additionalProperties": False},
                                               "whitespace_pattern": CALL_WHITESPACE}
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


def stream(mode: str, pieces: list[str], reason: str = "stop") -> list:
    """The deltas a sample growing by ``pieces`` gives, the last piece finishing it."""
    return streamed_with(ToolCallDeltas(mode, TextDeltas([])), pieces, reason)


def streamed_with(d: ToolCallDeltas, pieces: list[str], reason: str = "stop") -> list:
    text, out = "", []
    for i, piece in enumerate(pieces):
        text += piece
        done = i == len(pieces) - 1
        sample = CompletionOutput(0, text, list(range(i + 1)), reason if done else None)
        delta, _ = d.next(sample)
        if delta is not None:
            out.append(delta)
    return out


def merged(deltas) -> list[dict]:
    """The calls the deltas add up to, as a client merges them; each call's first delta (and
    only that one) carries its id, type and name."""
    calls: dict[int, dict] = {}
    for c in [c for d in deltas for c in d.tool_calls or []]:
        first = c.index not in calls
        assert (c.id is not None, c.type, c.function.name is not None) == (
            (True, "function", True) if first else (False, None, False))
        call = calls.setdefault(c.index, {"id": c.id, "name": c.function.name,
                                          "arguments": "", "deltas": 0})
        call["arguments"] += c.function.arguments or ""
        call["deltas"] += 1
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)]


def test_auto_streams_content_until_a_call_begins_then_the_call_as_it_grows():
    deltas = stream("auto", ["Sure", ". <tool", "_call>", '{"name": "add", ', '"argu',
                             'ments": {"a": 1,', ' "b": 2}}', "</tool_call>", "\n"])
    content = "".join(d.content or "" for d in deltas)
    assert content == "Sure."  # "<tool" was held back, then never sent; so was the space
    calls = merged(deltas)
    assert calls == [{"id": calls[0]["id"], "name": "add", "arguments": '{"a": 1, "b": 2}',
                      "deltas": 2}]
    held = stream("auto", ["a <tool", "box>"])  # not a call after all: all of it is content
    assert [d.content for d in held] == ["a", " <toolbox>"]


def test_a_named_function_streams_its_arguments():
    deltas = stream("add", ['{"a": ', "1, ", '"b": 2}'])
    first, *rest = [c for d in deltas for c in d.tool_calls]
    assert first.function.name == "add" and first.id and first.index == 0
    assert first.function.arguments + "".join(c.function.arguments for c in rest) == \
        '{"a": 1, "b": 2}'
    assert all(c.id is None and c.function.name is None for c in rest)


def test_a_required_array_streams_call_by_call_as_it_grows():
    text = ('[{"name": "add", "arguments": {"a": 1, "b": 2}},\n'
            ' {"name": "add", "arguments": {"a": 3, "b": 4}}]')
    d = ToolCallDeltas("required", TextDeltas([]))
    deltas = streamed_with(d, list(text))  # a character at a time
    assert all(x.content is None for x in deltas)
    calls = merged(deltas)
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("add", '{"a": 1, "b": 2}'), ("add", '{"a": 3, "b": 4}')]
    assert all(c["deltas"] == len(c["arguments"]) for c in calls)  # a piece per character
    assert [(c.id, c.function.name, c.function.arguments) for c in d.calls] == [
        (c["id"], c["name"], c["arguments"]) for c in calls]


# -- the truncated array and the streamed calls, on generated outputs ---------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=6)
generated_calls = st.lists(st.tuples(st.sampled_from(["add", "get_weather", "a_b"]),
                                     st.dictionaries(st.text(max_size=6), json_values,
                                                     max_size=3)),
                           min_size=1, max_size=4)


def render(calls, indent: int | None, ascii_only: bool) -> tuple[str, list[int], list[str]]:
    """A required output: the array's text, where each item ends, each item's arguments."""
    args = [json.dumps(a, indent=indent, ensure_ascii=ascii_only) for _, a in calls]
    text, ends = "[", []
    for i, ((name, _), a) in enumerate(zip(calls, args)):
        text += ("," if i else "") + ("\n  " if indent else "")
        text += f'{{"name": {json.dumps(name)},{" " * bool(indent)} "arguments": {a}}}'
        ends.append(len(text))
    return text + ("\n]" if indent else "]"), ends, args


@settings(max_examples=150, deadline=None)
@given(generated_calls, st.sampled_from([None, 2]), st.booleans(), st.data())
def test_a_truncated_array_keeps_its_complete_calls(calls, indent, ascii_only, data):
    text, ends, args = render(calls, indent, ascii_only)
    cut = data.draw(st.integers(0, len(text)), label="cut")
    content, parsed = parse_tool_calls(text[:cut], "required")
    complete = sum(end <= cut for end in ends)
    assert content is None
    assert [(c.function.name, c.function.arguments) for c in parsed] == [
        (name, a) for (name, _), a in zip(calls[:complete], args)]
    assert [json.loads(c.function.arguments) for c in parsed] == [a for _, a in
                                                                   calls[:complete]]


@settings(max_examples=100, deadline=None)
@given(generated_calls, st.sampled_from([None, 2]), st.data())
def test_streamed_calls_add_up_to_the_unstreamed_ones(calls, indent, data):
    text, ends, _ = render(calls, indent, False)
    cut = data.draw(st.integers(1, len(text)), label="cut")
    bounds = sorted(b for b in data.draw(st.sets(st.integers(1, len(text)), max_size=12),
                                         label="pieces") if b < cut)
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, cut])]
    reason = "stop" if cut == len(text) else "length"
    d = ToolCallDeltas("required", TextDeltas([]))
    streamed = merged(streamed_with(d, pieces, reason))
    _, whole = parse_tool_calls(text[:cut], "required")
    assert [(c.id, c.function.name, c.function.arguments) for c in d.calls] == [
        (c["id"], c["name"], c["arguments"]) for c in streamed[:len(d.calls)]]
    assert [(c.function.name, c.function.arguments) for c in d.calls] == [
        (c.function.name, c.function.arguments) for c in whole]
    # a call cut short was streamed as far as it went, and is the only one beyond them
    assert len(streamed) - len(d.calls) in (0, 1)
    for extra in streamed[len(d.calls):]:
        start = text.index('"arguments": ', max([0, *[e for e in ends if e <= cut]])) + 13
        assert text[start:cut].startswith(extra["arguments"])


def test_auto_reads_hermes_calls_streamed_or_not_alike():
    text = ('I will add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
            '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1}} junk</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": ')
    content, calls = parse_tool_calls(text, "auto")
    assert content == "I will add."  # the last call was cut short: not a call
    assert [c.function.arguments for c in calls] == ['{"a": 2, "b": 3}', '{"a": 1}']
    d = ToolCallDeltas("auto", TextDeltas([]))
    deltas = streamed_with(d, [text[i:i + 3] for i in range(0, len(text), 3)], "length")
    assert "".join(x.content or "" for x in deltas) == "I will add."
    assert [(c["name"], c["arguments"]) for c in merged(deltas)] == [
        ("add", '{"a": 2, "b": 3}'), ("add", '{"a": 1}'), ("add", '{"a": ')]
    assert [c.function.arguments for c in d.calls] == ['{"a": 2, "b": 3}', '{"a": 1}']
    junk = 'x <tool_call>{"name": "add", "arguments": {"a": 1} oops}</tool_call> y'
    d = ToolCallDeltas("auto", TextDeltas([]))
    deltas = streamed_with(d, list(junk))
    assert [(c["name"], c["arguments"]) for c in merged(deltas)] == [("add", '{"a": 1}')]
    assert parse_tool_calls(junk, "auto")[0] == "x  y"
    assert [(c.function.name, c.function.arguments) for c in d.calls] == [
        (c.function.name, c.function.arguments) for c in parse_tool_calls(junk, "auto")[1]]


# -- strict schemas ------------------------------------------------------------------------------
leaf_schemas = st.sampled_from([{"type": "string"}, {"type": "integer"}, {}, {"enum": [1, 2]}])


def object_schemas(inner):
    return st.builds(
        lambda props, extra: {"type": "object", "properties": props, **extra},
        st.dictionaries(st.sampled_from("abcd"), inner, max_size=3),
        st.sampled_from([{}, {"additionalProperties": True}, {"additionalProperties": False},
                         {"additionalProperties": {"type": "integer"}}]))


schemas = st.recursive(
    leaf_schemas,
    lambda inner: object_schemas(inner) | st.builds(lambda s: {"type": "array", "items": s}, inner)
    | st.builds(lambda alts: {"anyOf": alts}, st.lists(object_schemas(inner), min_size=1,
                                                       max_size=2)),
    max_leaves=8)


def example(schema):
    """A value valid under ``schema`` (one of the generated ones)."""
    if "anyOf" in schema:
        return example(schema["anyOf"][0])
    if schema.get("type") == "object":
        return {k: example(s) for k, s in schema["properties"].items()}
    if schema.get("type") == "array":
        return [example(schema["items"])]
    return {"string": "x", "integer": 1}.get(schema.get("type"), 1)


@settings(max_examples=200, deadline=None)
@given(schemas)
def test_strict_schemas_refuse_unlisted_properties_unless_they_allow_them(schema):
    before = copy.deepcopy(schema)
    strict = strict_schema(schema)
    assert schema == before  # the caller's schema is not touched
    assert strict_schema(strict) == strict
    value = example(schema)
    jsonschema.validate(value, schema)
    jsonschema.validate(value, strict)  # what it allowed with the listed properties, it allows
    if schema.get("type") == "object" and "additionalProperties" not in schema:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**value, "zz": 1}, strict)
        jsonschema.validate({**value, "zz": 1}, schema)

    def walk(original, made):  # each object: additionalProperties as stated, else false
        if not isinstance(original, dict):
            return
        if original.get("type") == "object":
            ap = original.get("additionalProperties")
            assert made["additionalProperties"] == (False if ap is None else strict_schema(ap))
            for k in original["properties"]:
                walk(original["properties"][k], made["properties"][k])
        for key in ("items",):
            if key in original:
                walk(original[key], made[key])
        for a, b in zip(original.get("anyOf", []), made.get("anyOf", [])):
            walk(a, b)
    walk(schema, strict)


def test_strict_schemas_close_objects_over_their_parts_and_leave_negations_alone():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "allOf": [{"properties": {"b": {"type": "integer"}}}],
              "$defs": {"P": {"type": "object", "properties": {"x": {}}}},
              "not": {"type": "object", "required": ["c"],
                      "properties": {"c": {"type": "object", "properties": {"z": {}}}}}}
    strict = strict_schema(schema)
    jsonschema.validate({"a": 1, "b": 2}, strict)
    for bad in ({"a": 1, "d": 2}, {"b": "no"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, strict)
    assert strict["$defs"]["P"]["additionalProperties"] is False
    assert strict["not"] == schema["not"]  # closing it would let more through


# -- the constraint ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def grammars() -> tuple:
    tokenizer = load_tokenizer()
    return tokenizer, GrammarCompiler(tokenizer, len(tokenizer),
                                      frozenset([tokenizer.eos_token_id]))


def accepted(grammars, spec: dict, text: str) -> tuple[bool, bool]:
    """(whether the constraint takes ``text``, whether it is then complete)."""
    tokenizer, compiler = grammars
    matcher = compiler.matcher(StructuredOutputsParams(**spec))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(ids) == len(ids), matcher.consume_tokens(ids) and \
        matcher.is_stopped()


def ends_the_turn(grammars, spec: dict, text: str) -> bool:
    """Whether the model's end of turn may follow ``text``."""
    tokenizer, compiler = grammars
    matcher = compiler.matcher(StructuredOutputsParams(**spec))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert matcher.consume_tokens(ids)
    return matcher.is_accepting()


def test_required_ends_with_the_array_and_bounds_its_length(grammars):
    _, spec = tool_constraint(request(tools=[TOOL], tool_choice="required"), "required")
    call = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    assert accepted(grammars, spec, f"[{call}]") == (True, True)  # done: the engine stops
    assert accepted(grammars, spec, f"[{call}, {call}") == (True, False)
    # the model may end its turn after a whole call, its array then read as closed there
    for text, ends in (("[", False), (f"[{call[:-1]}", False), (f"[{call}", True),
                       (f"[{call},", False), (f"[{call}, {call}", True), (f"[{call} ", False)):
        assert ends_the_turn(grammars, spec, text) == ends, text
    assert parse_tool_calls(f"[{call}, {call}", "required")[1][1].function.name == "add"
    assert accepted(grammars, spec, '[{"name": "add", "arguments": {"a": 1, "c": 2}}]')[0] \
        is False  # strict
    most = "[" + ", ".join([call] * MAX_PARALLEL_CALLS)
    assert accepted(grammars, spec, most + "]") == (True, True)
    assert accepted(grammars, spec, most + ", ")[0] is False


@pytest.mark.parametrize("mode", ["required", "add"])
def test_a_calls_whitespace_is_a_space_or_a_line_and_its_indent(grammars, mode):
    """As llama.cpp's JSON grammars bound it: free whitespace let a small model spend all its
    tokens on it and return no call."""
    _, spec = tool_constraint(request(tools=[TOOL], tool_choice="required"), mode)
    call = '{"name": "add", "arguments": %s}' % '{"a": 1, "b": 2}'
    whole = f"[{call}]" if mode == "required" else '{"a": 1, "b": 2}'
    assert accepted(grammars, spec, whole) == (True, True)
    indented = json.dumps(json.loads(whole), indent=2)
    assert accepted(grammars, spec, indented) == (True, True)
    for run in ("  ", "\n\n", " \n", "\n" + " " * 21):
        assert accepted(grammars, spec, whole[0] + run + whole[1:])[0] is False, repr(run)
    if mode == "add":  # (what bounds it: the pattern; required's grammar holds its own)
        free = {k: v for k, v in spec.items() if k != "whitespace_pattern"}
        assert accepted(grammars, free, whole[0] + "\n\n   \n" + whole[1:]) == (True, True)


def test_required_keeps_each_tools_references_working(grammars):
    params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"},
                                               "kids": {"type": "array", "items": {"$ref": "#"}}},
              "required": ["p"], "$defs": {"P": {"type": "object", "required": ["x"],
                                                 "properties": {"x": {"type": "integer"}}}}}
    other = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
             "$defs": {"P": {"type": "string"}}}  # the same name, another schema
    tools = [{"type": "function", "function": {"name": "tree", "parameters": params}},
             {"type": "function", "function": {"name": "label", "parameters": other}}]
    before = copy.deepcopy(tools)
    body = request(tools=tools, tool_choice="required")
    _, spec = tool_constraint(body, "required")
    assert tools == before and body.tools[0].function.parameters == params
    ok = ('[{"name": "tree", "arguments": {"p": {"x": 1}, "kids": [{"p": {"x": 2}}]}}, '
          '{"name": "label", "arguments": {"p": "y"}}]')
    assert accepted(grammars, spec, ok) == (True, True)
    for bad in ('[{"name": "tree", "arguments": {"p": {"x": "1"}}}]',
                '[{"name": "label", "arguments": {"p": {"x": 1}}}]',
                '[{"name": "tree", "arguments": {"p": {"x": 1, "y": 2}}}]'):
        assert accepted(grammars, spec, bad)[0] is False, bad


def test_a_tool_that_says_strict_false_keeps_its_schema_open():
    tool = copy.deepcopy(TOOL)
    tool["function"]["strict"] = False
    body = request(tools=[tool], tool_choice={"type": "function", "function": {"name": "add"}})
    assert tool_constraint(body, "add")[1] == {"json": TOOL["function"]["parameters"],
                                               "whitespace_pattern": CALL_WHITESPACE}


# -- through the official client ----------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
    "required": ["timezone"]}}}
CITY_ONLY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK_PARIS = [{"role": "user", "content": "What is the weather like in Paris today?"}]
ASK_BOTH = [{"role": "user", "content": "What is the weather in Paris, and what time is it "
                                        "there?"}]


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


def chat(client, model, messages, **kw):
    return client.chat.completions.create(model=model, messages=messages, temperature=0, **kw)


def client_stream(stream) -> tuple[list, str | None, str]:
    """(the deltas, the finish reason, the content) of a streamed choice."""
    deltas, reason, content = [], None, ""
    for chunk in stream:
        for choice in chunk.choices:
            deltas.append(choice.delta)
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return deltas, reason, content


REQUIRED = dict(tools=[WEATHER, TIME], tool_choice="required", max_tokens=150)


@pytest.fixture(scope="module")
def required_answer(client, model):
    return chat(client, model, ASK_BOTH, **REQUIRED)


def test_required_parallel_calls_end_with_the_array_streamed_or_not(client, model,
                                                                    required_answer):
    choice = required_answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert required_answer.usage.completion_tokens < 150  # the grammar was done: it stopped
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), {**schemas[name],
                                                    "additionalProperties": False})
    deltas, reason, content = client_stream(chat(client, model, ASK_BOTH, stream=True,
                                                 **REQUIRED))
    assert reason == "tool_calls" and content == ""
    streamed = merged(deltas)
    assert [(c["name"], c["arguments"]) for c in streamed] == calls
    assert all(c["deltas"] > 3 for c in streamed)  # the arguments came as they grew


def test_required_cut_short_keeps_its_complete_calls_streamed_or_not(client, model,
                                                                     required_answer):
    whole = [(c.function.name, c.function.arguments)
             for c in required_answer.choices[0].message.tool_calls]
    assert len(whole) >= 2  # this model calls both tools
    # cut inside the last call (more than 10 tokens long; its array closes in fewer)
    kw = {**REQUIRED, "max_tokens": required_answer.usage.completion_tokens - 10}
    choice = chat(client, model, ASK_BOTH, **kw).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert [(c.function.name, c.function.arguments)
            for c in choice.message.tool_calls] == whole[:-1]
    deltas, reason, content = client_stream(chat(client, model, ASK_BOTH, stream=True, **kw))
    assert reason == "length" and content == ""
    streamed = [(c["name"], c["arguments"]) for c in merged(deltas)]
    assert streamed[:len(whole) - 1] == whole[:-1] and len(streamed) - len(whole) in (-1, 0)
    for name, arguments in streamed[len(whole) - 1:]:  # the cut call, as far as it went
        assert name == whole[-1][0] and whole[-1][1].startswith(arguments)


def test_named_tool_arguments_have_only_the_listed_keys_unless_extras_are_allowed(client, model):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(client, model, ASK_PARIS, tools=[CITY_ONLY], tool_choice=choice, max_tokens=40)
    assert r.choices[0].finish_reason == "tool_calls"
    assert set(json.loads(r.choices[0].message.tool_calls[0].function.arguments)) == {"city"}
    open_tool = copy.deepcopy(CITY_ONLY)
    open_tool["function"]["parameters"]["additionalProperties"] = True
    r = chat(client, model, ASK_PARIS, tools=[open_tool], tool_choice=choice, max_tokens=40)
    keys = re.findall(r'"(\w+)"\s*:', r.choices[0].message.tool_calls[0].function.arguments)
    assert set(keys) - {"city"}  # this model adds keys where it may


@pytest.mark.parametrize("tool_choice", ["auto", "required", "none", None])
def test_a_tool_whose_parameters_are_no_json_schema_is_a_400_naming_tools(client, model,
                                                                         tool_choice):
    """As OpenAI answers, whatever the tool_choice (before, auto took it)."""
    broken = copy.deepcopy(CITY_ONLY)
    broken["function"]["parameters"]["properties"]["city"]["type"] = "txt"
    kw = {} if tool_choice is None else {"tool_choice": tool_choice}
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, ASK_PARIS, tools=[TIME, broken], max_tokens=5, **kw)
    error = e.value.body
    assert error["param"] == "tools" and "tools[1] ('get_weather')" in error["message"]


CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@st.composite
def chat_bodies(draw) -> dict:
    """Conversations with and without tools: a system or developer message, a user's question,
    an assistant's tool call (with or without text) and its result, a user's follow-up."""
    messages = []
    if draw(st.booleans()):
        messages.append({"role": draw(st.sampled_from(["system", "developer"])),
                         "content": "Be brief."})
    messages.append(ASK_PARIS[0])
    if draw(st.booleans()):
        messages += [{"role": "assistant", "content": draw(st.sampled_from([None, "Checking."])),
                      "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    if draw(st.booleans()):
        messages.append({"role": "user", "content": "And tomorrow?"})
    body = {"messages": messages, "add_generation_prompt": draw(st.booleans())}
    tools = draw(st.sampled_from([None, [WEATHER], [WEATHER, TIME]]))
    if tools:
        body["tools"] = tools
        choice = draw(st.sampled_from([None, "none", "auto", "required",
                                       {"type": "function", "function": {"name": "get_weather"}}]))
        if choice is not None:
            body["tool_choice"] = choice
    return body


@settings(max_examples=12, deadline=None)
@given(body=chat_bodies())
def test_tokenize_counts_the_prompt_the_chat_route_builds(server, model, body):
    """/tokenize with messages (tools, tool calls and results, tool_choice, the generation
    prompt or not) counts what a chat completion of the same body reports as its prompt."""
    import httpx

    counted = httpx.post(f"{server.base_url}/tokenize", json={"model": model, **body})
    assert counted.status_code == 200, counted.text
    answer = httpx.post(f"{server.base_url}/v1/chat/completions",
                        json={"model": model, **body, "max_tokens": 1}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert counted.json()["count"] == answer.json()["usage"]["prompt_tokens"]
    if "tools" in body and body.get("tool_choice") != "none":  # the tools are in the prompt
        bare = {k: v for k, v in body.items() if k not in ("tools", "tool_choice")}
        fewer = httpx.post(f"{server.base_url}/tokenize", json={"model": model, **bare})
        assert fewer.json()["count"] < counted.json()["count"]


@pytest.mark.parametrize("max_tokens", [6, 80])
def test_required_returns_a_call_or_what_it_wrote_never_nothing(client, model, max_tokens):
    """The issue's case (80 tokens: the model once spent them all on whitespace) and one cut
    before any call is whole: complete calls with finish tool_calls, or finish length with the
    text written so far as content; never an empty answer."""
    choice = chat(client, model, ASK_PARIS, tools=[WEATHER, TIME], tool_choice="required",
                  max_tokens=max_tokens).choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason in ("tool_calls", "length")
        for call in choice.message.tool_calls:
            assert call.function.name in ("get_weather", "get_time")
            json.loads(call.function.arguments)
    else:
        assert choice.finish_reason == "length" and choice.message.content
        assert choice.message.content.lstrip().startswith("[")
    if max_tokens == 6:
        assert not choice.message.tool_calls  # (no call of these tools fits in 6 tokens)
