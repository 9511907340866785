"""``POST /v1/responses`` over real HTTP, through the official client's ``responses`` API:
the same text as chat completions, OpenAI's events when streamed, function tools, text formats,
and the fields it refuses."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest


QUESTION = "Name three colours."
ADD = {"type": "function", "name": "add", "description": "Add two integers.",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                       "b": {"type": "integer"}},
                      "required": ["a", "b"], "additionalProperties": False}}
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added",
               "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


def cold(server) -> None:
    """Empty the prefix cache: a prompt prefilled from cached pages may take another greedy
    path than one prefilled whole, and the texts compared here must come alike."""
    assert httpx.post(f"{server.base_url}/reset_prefix_cache", timeout=60).status_code == 200


def chat_text(server, client, model, messages, **kw) -> tuple[str, str]:
    cold(server)
    r = client.chat.completions.create(model=model, messages=messages, temperature=0, **kw)
    return r.choices[0].message.content, r.choices[0].finish_reason


def collapse(types: list[str]) -> list[str]:
    """The event types with runs of one delta type written once."""
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and types[i - 1] == t)]


def test_text_equals_chat_completions_and_usage(server, client, model):
    cold(server)
    r = client.responses.create(model=model, input=QUESTION, max_output_tokens=8,
                                temperature=0)
    text, reason = chat_text(server, client, model, [{"role": "user", "content": QUESTION}],
                             max_completion_tokens=8)
    assert r.output_text == text and text
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model
    assert [o.type for o in r.output] == ["message"]
    message = r.output[0]
    assert message.role == "assistant" and message.content[0].type == "output_text"
    assert message.content[0].annotations == []
    assert (r.status, message.status) == (("incomplete", "incomplete") if reason == "length"
                                          else ("completed", "completed"))
    if reason == "length":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens <= 8 and r.usage.input_tokens > 5
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert (r.max_output_tokens, r.temperature, r.store, r.tools) == (8, 0, False, [])
    # the same as a list of items, the text in parts
    items = [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Name three "}, {"type": "input_text", "text": "colours."}]}]
    cold(server)
    again = client.responses.create(model=model, input=items, max_output_tokens=8, temperature=0)
    assert again.output_text == text


def test_instructions_are_a_system_message(server, client, model):
    system = "You are a pirate. Answer in one word."
    cold(server)
    r = client.responses.create(model=model, instructions=system, input=QUESTION,
                                max_output_tokens=6, temperature=0)
    text, _ = chat_text(server, client, model, [{"role": "system", "content": system},
                                        {"role": "user", "content": QUESTION}],
                        max_completion_tokens=6)
    assert r.output_text == text and r.instructions == system
    cold(server)
    developer = client.responses.create(model=model, input=[
        {"role": "developer", "content": system}, {"role": "user", "content": QUESTION}],
        max_output_tokens=6, temperature=0)
    assert developer.output_text == text


def test_stream_events_and_text(server, client, model):
    kw = {"model": model, "input": QUESTION, "max_output_tokens": 10, "temperature": 0}
    cold(server)
    whole = client.responses.create(**kw)
    cold(server)
    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    last = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert collapse(types) == ["response.created", "response.in_progress", *TEXT_EVENTS, last]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == whole.output_text
    item_id = events[2].item.id
    assert all((e.item_id, e.output_index, e.content_index) == (item_id, 0, 0) for e in deltas)
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.id == events[0].response.id and final.output[0].id == item_id
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_function_tools_required_and_named(client, model):
    r = client.responses.create(model=model, input="What is 2 + 3?", tools=[ADD],
                                tool_choice="required", parallel_tool_calls=False,
                                max_output_tokens=100, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == len(r.output) == 1 and r.status == "completed"
    for call in calls:
        assert call.name == "add" and call.call_id.startswith("call_")
        assert call.id.startswith("fc_") and call.status == "completed"
        assert set(json.loads(call.arguments)) == {"a", "b"}
    assert r.tools[0].name == "add" and r.tool_choice == "required"
    assert r.parallel_tool_calls is False
    # sent back with its output, the conversation goes on
    follow = client.responses.create(model=model, input=[
        {"role": "user", "content": "What is 2 + 3?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "add",
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}],
        tools=[ADD], tool_choice="none", max_output_tokens=4, temperature=0)
    assert follow.output[0].type == "message" and follow.output_text
    # a named function streams its arguments
    events = list(client.responses.create(
        model=model, input="What is 2 + 3?", tools=[ADD], max_output_tokens=60, temperature=0,
        tool_choice={"type": "function", "name": "add"}, stream=True))
    assert collapse([e.type for e in events])[2:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    deltas = "".join(e.delta for e in events if e.type.endswith("arguments.delta"))
    call = events[-1].response.output[0]
    assert call.type == "function_call" and call.name == "add" and call.arguments == deltas
    assert set(json.loads(deltas)) == {"a", "b"}


def test_json_schema_text_format(client, model):
    schema = {"type": "object", "properties": {"age": {"type": "integer"}},
              "required": ["age"], "additionalProperties": False}
    r = client.responses.create(model=model, input="How old is Ada? Answer in JSON.",
                                max_output_tokens=30, temperature=0, text={"format": {
                                    "type": "json_schema", "name": "person", "schema": schema,
                                    "strict": True}})
    assert r.status == "completed" and isinstance(json.loads(r.output_text)["age"], int)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"


@pytest.mark.parametrize("field,value", [
    ("previous_response_id", "resp_123"), ("background", True),
    ("include", ["reasoning.encrypted_content"]), ("reasoning", {"effort": "high"}),
    ("truncation", "auto"), ("tools", [{"type": "web_search"}]),
    ("tool_choice", "required"), ("max_output_tokens", 5000),
    ("text", {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}),
    ("input", [{"type": "input_image", "image_url": "http://x"}])])
def test_refused_fields_are_400s_naming_them(server, field, value):
    r = httpx.post(f"{server.base_url}/v1/responses", timeout=60,
                   json={"input": "Hi", "max_output_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


def test_store_is_accepted_but_nothing_is_stored(server):
    for store in (True, False):
        r = httpx.post(f"{server.base_url}/v1/responses", timeout=60,
                       json={"input": "Hi", "max_output_tokens": 2, "store": store,
                             "metadata": {"k": "v"}})
        assert r.status_code == 200, r.text
        assert r.json()["store"] is False and r.json()["metadata"] == {"k": "v"}


def test_chat_chunks_become_events_in_process():
    """Reasoning, text and two calls, then an error, without a model: the events' order, the
    items' indices and the final response."""
    from conveyor.server.responses import _stream
    from conveyor.server.responses_protocol import ResponseObject

    def chunks(*deltas, finish="length", error=None):
        async def gen():
            yield 'data: {"id": "chatcmpl-abc", "choices": [{"delta": {"role": "assistant"}}]}'
            for d in deltas:
                yield "data: " + json.dumps({"choices": [{"delta": d, "finish_reason": None}]})
            if error:
                yield "data: " + json.dumps({"error": error})
            yield "data: " + json.dumps({"choices": [{"delta": {}, "finish_reason": finish}]})
            yield "data: " + json.dumps({"choices": [], "usage": {
                "prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}})
            yield "data: [DONE]"
        return gen()

    def run(source) -> list[dict]:
        async def consume():
            response = ResponseObject(id="x", created_at=0, status="in_progress", model="m")
            return "".join([s async for s in _stream(source, response)])
        text = asyncio.run(consume())
        events = []
        for block in text.strip().split("\n\n"):
            kind, data = block.split("\n")
            events.append(json.loads(data.removeprefix("data: ")))
            assert kind == "event: " + events[-1]["type"]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        return events

    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1'}}
    events = run(chunks({"reasoning_content": "hm"}, {"content": "So"},
                        {"tool_calls": [call]},
                        {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]},
                        {"tool_calls": [{**call, "index": 1, "id": "call_2"}]}))
    assert collapse([e["type"] for e in events]) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done", *TEXT_EVENTS,
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.incomplete"]
    final = events[-1]["response"]
    assert final["id"] == "resp_abc" and final["status"] == "incomplete"
    assert [(o["type"], o["status"]) for o in final["output"]] == [
        ("reasoning", "completed"), ("message", "completed"), ("function_call", "completed"),
        ("function_call", "incomplete")]
    assert [o.get("arguments") for o in final["output"][2:]] == ['{"a": 1}', '{"a": 1']
    assert final["usage"]["total_tokens"] == 8
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    events = run(chunks({"content": "So"}, error={
        "message": "boom", "type": "timeout_error", "param": None, "code": "timeout"}))
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-2]["code"] == "timeout" and events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"] == {"code": "timeout", "message": "boom"}
