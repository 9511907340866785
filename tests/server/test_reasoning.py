"""Reasoning models (``--reasoning-parser``): the thinking goes to ``reasoning_content``, the rest
to ``content``, streamed or not, the same split either way; ``chat_template_kwargs`` reach the
template; a constraint holds from the end of the thinking. Over real HTTP through the official
client, with the default model made to write a thought and an answer by a regex constraint
(its vocabulary has no </think> token, so the constraint holds over the whole output)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.engine.input_processor import InputProcessor
from conveyor.llm import LLM
from conveyor.model.loader import load_tokenizer
from conveyor.outputs import CompletionOutput
from conveyor.sampling_params import SamplingParams, StructuredOutputsParams
from conveyor.server.reasoning import (PARSERS, ReasoningDeltas, constrain_the_answer,
                                       split_reasoning)
from conveyor.server.streaming import TextDeltas

from server_process import running_server

THOUGHT_THEN_ANSWER = r"<think>[a-z]{4,12}</think>[a-z]{4,12}"


@pytest.mark.parametrize("parser,text,want", [
    ("deepseek_r1", "<think>why</think>so", ("why", "so")),
    ("deepseek_r1", "why</think>so", ("why", "so")),
    ("deepseek_r1", "still thinking", ("still thinking", None)),
    ("qwen3", "<think>why</think>so", ("why", "so")),
    ("qwen3", "no thought", (None, "no thought")),
    ("qwen3", "<think>never closed", ("never closed", None)),
])
def test_split(parser, text, want):
    assert split_reasoning(text, parser) == want


@settings(max_examples=200, deadline=None)
@given(parser=st.sampled_from(PARSERS),
       pieces=st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "a",
                                        "b c", "\n"]), max_size=12),
       cuts=st.lists(st.integers(0, 60), max_size=8))
def test_streamed_split_is_the_whole_split(parser, pieces, cuts):
    """However the text arrives, the reasoning and content streamed join into the whole's."""
    text = "".join(pieces)
    ends = sorted({min(c, len(text)) for c in cuts} | {len(text)})
    deltas = ReasoningDeltas(parser, TextDeltas([]))
    reasoning = content = ""
    for i, end in enumerate(ends):
        finished = i == len(ends) - 1
        r, c, _ = deltas.next(CompletionOutput(0, text[:end], list(range(end)),
                                               "stop" if finished else None))
        reasoning, content = reasoning + r, content + c
    want_r, want_c = split_reasoning(text, parser)
    assert (reasoning, content) == (want_r or "", want_c or "")


def test_chat_template_kwargs_reach_the_template():
    tokenizer = load_tokenizer(None)
    tokenizer.chat_template = ("{% if enable_thinking is defined and not enable_thinking %}"
                               "NO-THINK {% endif %}{{ messages[0]['content'] }}")
    inputs = InputProcessor(tokenizer, "m", len(tokenizer), 4096, 4096, None)
    hi = [{"role": "user", "content": "hi"}]
    assert tokenizer.decode(inputs.apply_chat_template(hi)) == "hi"
    off = inputs.apply_chat_template(hi, template_kwargs={"enable_thinking": False})
    assert tokenizer.decode(off) == "NO-THINK hi"
    with pytest.raises(ValueError, match="chat_template_kwargs may not set tokenize"):
        inputs.apply_chat_template(hi, template_kwargs={"tokenize": True})


@pytest.fixture(scope="module", params=PARSERS)
def server(request):
    with running_server("--reasoning-parser", request.param) as proc:
        proc.parser = request.param
        yield proc


def ask(client, model, **kw):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Think, then answer."}],
        temperature=0, max_tokens=60,
        extra_body={"structured_outputs": {"regex": THOUGHT_THEN_ANSWER}}, **kw)


def test_the_thought_and_the_answer_apart(server, client, model):
    message = ask(client, model).choices[0].message
    reasoning, content = message.reasoning_content, message.content
    assert 4 <= len(reasoning) <= 12 and reasoning.isalpha(), message
    assert 4 <= len(content) <= 12 and content.isalpha(), message
    chunks = list(ask(client, model, stream=True))
    streamed_r = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                         for c in chunks if c.choices)
    streamed_c = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (streamed_r, streamed_c) == (reasoning, content)


def test_bad_chat_template_kwargs_are_a_400_naming_them(server):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "chat_template_kwargs": {"tokenize": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_a_constraint_holds_from_the_end_of_the_thinking():
    """As vLLM's: from the first </think> of the output, unless the prompt closed the thinking
    already (Qwen3 with thinking off); over everything where </think> is no token."""
    tokenizer = load_tokenizer(None)
    plain = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    hi = tokenizer.encode("hi")
    assert constrain_the_answer(plain, hi, tokenizer) is plain  # (no such token here)
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=True)
    think, close = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    for prompt, after in [(hi, close), (hi + [think], close), (hi + [think, close], None),
                          (hi + [think, close, think], close)]:
        got = constrain_the_answer(plain, prompt, tokenizer).structured_outputs
        assert got.after_token == after and got.json == {"type": "object"}
    unconstrained = SamplingParams()
    assert constrain_the_answer(unconstrained, hi, tokenizer) is unconstrained


def test_the_engine_constrains_from_the_token_after_after_token():
    """The default model's greedy answer up to and including its fourth token (taken as the
    end of a thought) is left alone; from there on the answer is JSON."""
    llm = LLM(None, dtype="float32", max_num_seqs=2)
    prompt = [{"role": "user", "content": "Name three colours."}]
    ids = llm.engine.inputs.apply_chat_template(prompt)
    free = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)[0].outputs[0].token_ids
    end = free[3]
    assert end not in free[:3]
    spec = StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False},
        after_token=end)
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:4] == free[:4]
    answer = llm.engine.tokenizer.decode(out.token_ids[4:])
    assert isinstance(json.loads(answer)["a"], int), answer
    assert out.finish_reason == "stop"
