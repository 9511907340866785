"""Structured outputs and tool calls over real HTTP, through the official client: OpenAI's
response_format (and ``parse`` with a pydantic model), vLLM's structured_outputs and guided_*
fields, tools with every tool_choice, streamed and not, and 400s for what cannot be enforced."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from conveyor.bench.schemas import BATTERY
from conveyor.core.grammar import GrammarCompiler
from conveyor.model.loader import load_tokenizer
from conveyor.sampling_params import StructuredOutputsParams

from engine_checks import assert_allowed
from server_process import running_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {
        "type": "object", "additionalProperties": False,
        "properties": {"timezone": {"type": "string", "maxLength": 30}},
        "required": ["timezone"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def server():
    with running_server("--max-num-seqs", "16") as proc:
        yield proc


def chat(client, model, messages=None, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 200)
    return client.chat.completions.create(model=model, messages=messages or [
        {"role": "user", "content": "Describe a person."}], **kw)


def streamed(stream) -> tuple[str, list[dict], str | None]:
    """(content, tool calls merged from their deltas as a client does, finish reason)."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or d.id
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


# -- response_format ---------------------------------------------------------------------------
def test_parse_with_a_pydantic_model_works_unchanged(client, model):
    r = client.chat.completions.parse(model=model, messages=[
        {"role": "user", "content": "Give me a person."}], response_format=Person,
        temperature=0, max_tokens=100)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_response_format_streamed_or_not(server, client, model, stream):
    """The whole battery at once (one batch), streamed; a third of it not."""
    def ask(case) -> tuple[str, str | None]:
        name, schema, question = case
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                      "strict": True}}
        messages = [{"role": "user", "content": question}]
        if stream:
            text, _, reason = streamed(chat(client, model, messages, response_format=fmt,
                                            temperature=0.8, seed=3, stream=True, max_tokens=400))
            return text, reason
        r = chat(client, model, messages, response_format=fmt, temperature=0.8, seed=3,
                 max_tokens=400)
        return r.choices[0].message.content, r.choices[0].finish_reason

    cases = BATTERY if stream else BATTERY[::3]
    before = server.metrics()
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(ask, cases))
    # sampled at 0.8, an answer may run to max_tokens: its text is then a prefix the schema
    # allows (checked token by token), the others whole
    tokenizer = load_tokenizer()
    grammars = GrammarCompiler(tokenizer, len(tokenizer), frozenset([tokenizer.eos_token_id]))
    whole = 0
    for (_, schema, _), (text, reason) in zip(cases, answers):
        assert_allowed(grammars.matcher(StructuredOutputsParams(json=schema)),
                       tokenizer.encode(text, add_special_tokens=False))
        assert reason in ("stop", "length")
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)
            whole += 1
    assert whole >= len(cases) // 2
    after = server.metrics()
    grew = {k: after[f"conveyor:{k}"] - before.get(f"conveyor:{k}", 0)
            for k in ("structured_output_sequences_total", "grammar_compiles_total")}
    assert grew["structured_output_sequences_total"] == len(cases)
    assert 0 <= grew["grammar_compiles_total"] <= len(cases)


def test_json_object_on_chat_and_completions(client, model):
    r = chat(client, model, response_format={"type": "json_object"}, max_tokens=300)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    c = client.completions.create(model=model, prompt="A JSON object:", max_tokens=300,
                                  temperature=0, extra_body={"response_format": {
                                      "type": "json_object"}})
    assert isinstance(json.loads(c.choices[0].text), dict)


# -- vLLM's fields -----------------------------------------------------------------------------
def test_structured_outputs_and_guided_fields(client, model):
    r = chat(client, model, [{"role": "user", "content": "Is the sky blue?"}],
             extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = chat(client, model, extra_body={"structured_outputs": {"choice": ["cat", "dog"]}}, n=3,
             temperature=1.0, seed=1)
    assert all(c.message.content in ("cat", "dog") for c in r.choices)
    c = client.completions.create(model=model, prompt="Call me on", max_tokens=30,
                                  temperature=0, extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", c.choices[0].text)
    stream = client.completions.create(
        model=model, prompt="Answer:", max_tokens=30, temperature=0, stream=True,
        extra_body={"structured_outputs": {"grammar": 'root ::= "It is " ("yes" | "no")'}})
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) in ("It is yes", "It is no")
    schema = BATTERY[2][1]
    r = chat(client, model, [{"role": "user", "content": BATTERY[2][2]}],
             extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


# -- tools -------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_calls_that_function(client, model, stream):
    kw = dict(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                   "function": {"name": "get_weather"}})
    if stream:
        content, calls, reason = streamed(chat(client, model, ASK_WEATHER, stream=True, **kw))
    else:
        r = chat(client, model, ASK_WEATHER, **kw)
        msg, reason = r.choices[0].message, r.choices[0].finish_reason
        content = msg.content
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in msg.tool_calls]
    assert reason == "tool_calls" and not content
    assert len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_calls_one_of_the_tools(client, model, stream):
    kw = dict(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    if stream:
        _, calls, reason = streamed(chat(client, model, ASK_WEATHER, stream=True, **kw))
    else:
        r = chat(client, model, ASK_WEATHER, **kw)
        reason = r.choices[0].finish_reason
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in r.choices[0].message.tool_calls]
    assert reason == "tool_calls" and len(calls) == 1
    tool = {t["function"]["name"]: t for t in (WEATHER, TIME)}[calls[0]["name"]]
    jsonschema.validate(json.loads(calls[0]["arguments"]), tool["function"]["parameters"])


def test_auto_and_none_leave_the_model_free_and_tool_results_go_back_in(client, model):
    r = chat(client, model, ASK_WEATHER, tools=[WEATHER], tool_choice="none", max_tokens=20)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    call = {"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    history = ASK_WEATHER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "call_1",
                              "content": '{"temperature": 21, "sky": "sunny"}'}]
    r = chat(client, model, history, tools=[WEATHER], max_tokens=30)  # auto by default
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    content, calls, reason = streamed(chat(client, model, history, tools=[WEATHER], max_tokens=30,
                                           stream=True))
    assert reason == choice.finish_reason
    assert content == (choice.message.content or "")
    assert [c["name"] for c in calls] == [c.function.name for c in choice.message.tool_calls]


# -- refusals ----------------------------------------------------------------------------------
def test_a_constraint_the_vocabulary_cannot_write_is_a_400(server, model):
    body = {"model": model, "prompt": "Hi", "max_tokens": 5,
            "structured_outputs": {"regex": "\U00090000"}}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsatisfiable_constraint"
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: {")]
    assert json.loads(events[-1][6:])["error"]["code"] == "unsatisfiable_constraint"



@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
])
def test_what_cannot_be_enforced_is_a_400_naming_the_field(server, model, extra, param):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={
        "model": model, "messages": ASK_WEATHER, "max_tokens": 5, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert (error["param"] or "").split(".")[0] == param, error
    assert httpx.get(f"{server.base_url}/health").status_code == 200
