"""The OpenAI-compatible server over real HTTP on loopback, through the official client."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest


from conveyor.kernels import isa
from conveyor.model.gguf_tokenizer import load_gguf_tokenizer
from conveyor.model.loader import default_model_path

PROMPT = "The three most useful things to know about continuous batching are"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


@pytest.fixture(scope="module")
def tokenizer():
    return load_gguf_tokenizer(default_model_path())


def chat_prompt_len(tokenizer, messages) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


# -- plain endpoints ---------------------------------------------------------------------------
def test_health_version_models_openapi(server, model):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    version = httpx.get(f"{server.base_url}/version").json()
    cpu = isa.current()  # the server runs on this machine, with no tier forced
    assert version["version"] and version["device"] == "cpu"
    assert version["cpu_isa"] == cpu.tier and version["cpu_isa_reason"] == cpu.describe()
    assert version["dtype"] == ("bfloat16" if cpu.native_bf16 else "float32")
    assert version["dtype_reason"].startswith("auto:")
    assert version["kernels"].startswith("C kernels, ") and ("CPU tier " + cpu.tier) in (
        version["kernels"])
    assert 0 < version["load_seconds"] < 600 and version["batch_invariant"] is False
    cards = httpx.get(f"{server.base_url}/v1/models").json()
    assert cards["object"] == "list" and cards["data"][0]["id"] == model
    assert cards["data"][0]["max_model_len"] == 1024
    schema = httpx.get(f"{server.base_url}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics"} <= set(
        schema["paths"])
    for path in schema["paths"].values():
        for operation in path.values():
            assert "422" not in operation["responses"]  # validation errors are 400s here
    assert set(schema["paths"]["/v1/completions"]["post"]["responses"]) >= {"200", "400", "503"}
    fields = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert fields["temperature"]["minimum"] == 0 and fields["top_p"]["maximum"] == 1


def test_one_model_and_the_tokenizer_routes(server, client, model, tokenizer):
    """The client's models.retrieve, and vLLM's /tokenize and /detokenize shapes."""
    card = client.models.retrieve(model)
    assert card.id == model and card.object == "model"
    # SmolLM2's eos <|im_end|>, and what llama.cpp also ends on: <|endoftext|>, <reponame>
    assert (card.stop_token_ids, card.stop_tokens) == (
        [0, 2, 4], ["<|endoftext|>", "<|im_end|>", "<reponame>"])
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    # the model as given at launch (here the default's path) is a name too, as in vLLM
    by_path = client.completions.create(model=default_model_path(), prompt="Hi", max_tokens=1)
    assert by_path.usage.completion_tokens == 1
    url = server.base_url
    ids = tokenizer.encode(PROMPT)
    got = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": PROMPT,
                                              "return_token_strs": True}).json()
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] == 1024
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    chat = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] == chat_prompt_len(tokenizer, MESSAGES)
    assert httpx.post(f"{url}/detokenize", json={"tokens": ids}).json() == {
        "prompt": tokenizer.decode(ids)}
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    neither = httpx.post(f"{url}/tokenize", json={"model": model})
    assert neither.status_code == 400


def test_logit_bias_changes_the_greedy_token(server, client, model, tokenizer):
    """The issue's case: -100 on the token the reply starts with bans it, +100 on another
    makes it the reply's first; a bias out of range or of no token is a 400 naming it."""
    def first(**kw) -> str:
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=1,
                                          temperature=0, **kw).choices[0].text
    plain = first()
    (token,) = tokenizer.encode(plain, add_special_tokens=False)
    assert first(logit_bias={str(token): -100}) != plain
    other = tokenizer.encode(" banana", add_special_tokens=False)[0]
    assert first(logit_bias={str(other): 100}) == tokenizer.decode([other])
    for bias in ({str(token): 101}, {"1000000": 1}, {"x": 1}):
        r = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
            "prompt": PROMPT, "max_tokens": 1, "logit_bias": bias})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


@pytest.mark.parametrize("route,field,value", [
    ("/v1/completions", "best_of", 3), ("/v1/completions", "suffix", "!"),
    ("/v1/chat/completions", "allowed_token_ids", [1, 2]),
    ("/v1/chat/completions", "store", True), ("/v1/completions", "use_beam_search", True),
    ("/v1/chat/completions", "echo", True),
])
def test_a_field_the_server_does_not_implement_is_a_400_naming_it(server, route, field, value):
    """Never dropped in silence; its do-nothing value passes, and a key no schema has is
    ignored (as vLLM does)."""
    base = ({"prompt": PROMPT} if route == "/v1/completions" else {"messages": MESSAGES})
    body = {**base, "max_tokens": 1, field: value}
    r = httpx.post(f"{server.base_url}{route}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    neutral = {"best_of": 1, "suffix": None, "allowed_token_ids": None, "store": False,
               "use_beam_search": False, "echo": False}[field]
    ok = httpx.post(f"{server.base_url}{route}", timeout=60,
                    json={**base, "max_tokens": 1, field: neutral, "no_such_key": 1})
    assert ok.status_code == 200, ok.text
    assert "ignored" in server.log() and "no_such_key" in server.log()  # said, as vLLM says


def test_continue_final_message_continues_the_assistants_text(client, model, tokenizer):
    """vLLM's prefilled answer: the prompt ends inside the last message, which the reply
    continues."""
    partial = "The three colours are red,"
    messages = [*MESSAGES, {"role": "assistant", "content": partial}]
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith(partial)
    assert r.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    plain = client.completions.create(model=model, prompt=text, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == plain.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:  # both: continue or answer?
        client.chat.completions.create(model=model, messages=messages, max_tokens=1,
                                       extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server, route):
    base = {"prompt": PROMPT} if route == "/v1/completions" else {"messages": MESSAGES}
    with httpx.stream("POST", f"{server.base_url}{route}", timeout=60, json={
            **base, "max_tokens": 5, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    with_tokens = [c for c in chunks if c["choices"] and c["choices"][0].get(
        "text", c["choices"][0].get("delta", {}).get("content"))]
    counts = [c["usage"]["completion_tokens"] for c in with_tokens]
    assert counts == sorted(counts) and counts[-1] == 5 and counts[0] >= 1
    assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"]
               for c in with_tokens)


def test_a_developer_message_is_a_system_message(client, model, tokenizer):
    """OpenAI's newer name for system instructions: the same prompt as a system message."""
    def usage(role):
        return client.chat.completions.create(
            model=model, max_tokens=1, messages=[{"role": role, "content": "Be brief."},
                                                 *MESSAGES]).usage.prompt_tokens
    assert usage("developer") == usage("system") == chat_prompt_len(
        tokenizer, [{"role": "system", "content": "Be brief."}, *MESSAGES])


# -- completions -------------------------------------------------------------------------------
def test_completion_usage_counts_tokens(client, model, tokenizer):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, logprobs=0,
                                    **GREEDY)
    choice = out.choices[0]
    assert out.object == "text_completion" and choice.finish_reason == "length"
    assert choice.text and len(choice.logprobs.tokens) == 12
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_completion_token_id_prompts_and_echo(client, model, tokenizer):
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, **GREEDY)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=8, echo=True,
                                       **GREEDY)
    assert by_ids.choices[0].text == tokenizer.decode(ids) + by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_completion_streamed_equals_non_streamed(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, **GREEDY)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True},
                                            **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_n2_and_several_prompts(client, model):
    out = client.completions.create(model=model, prompt=["Hello", "Goodbye"], n=2, max_tokens=6,
                                    temperature=0.8, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 4 * 6
    chat = client.chat.completions.create(model=model, messages=MESSAGES, n=2, max_tokens=6,
                                          temperature=0.8, seed=7,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 12


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_is_cut_and_never_streamed(client, model, stream):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, logprobs=0,
                                     **GREEDY).choices[0]
    assert "".join(full.logprobs.tokens) == full.text
    # A stop string that straddles a token boundary: its first half arrives a step early.
    boundary = next(o for o in full.logprobs.text_offset if o >= len(full.text) // 2
                    and len(full.text) - o >= 2)
    stop = full.text[boundary - 2:boundary + 2]
    expected = full.text[:full.text.index(stop)]
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=24, stop=[stop, "\x00never"], **GREEDY)
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs)]
        text, reason = "".join(c.text for c in chunks), chunks[-1].finish_reason
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, reason = choice.text, choice.finish_reason
    assert text == expected and reason == "stop"


def test_logprobs(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, logprobs=3,
                                    **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) >= 3
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the top token
    assert lp.text_offset == sorted(lp.text_offset)


def test_seed_reproducible(client, model):
    def sample(seed: int) -> str:
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=16, seed=seed,
                                         temperature=1.0).choices[0].text

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


# -- chat --------------------------------------------------------------------------------------
def test_chat_usage_and_logprobs(client, model, tokenizer):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10,
                                         logprobs=True, top_logprobs=2, **GREEDY)
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == chat_prompt_len(tokenizer, MESSAGES)
    assert out.usage.completion_tokens == len(choice.logprobs.content) == 10
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)


def test_chat_streamed_equals_non_streamed(server, client, model):
    # The same computation twice, each from an empty prefix cache: a prompt partly read from
    # pages an earlier test left is computed in other shapes, which in bfloat16 can round a
    # greedy choice apart a few tokens on.
    httpx.post(f"{server.base_url}/reset_prefix_cache").raise_for_status()
    full = client.chat.completions.create(model=model, messages=MESSAGES,
                                          max_completion_tokens=20, **GREEDY)
    httpx.post(f"{server.base_url}/reset_prefix_cache").raise_for_status()
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES,
                                                 max_completion_tokens=20, stream=True,
                                                 stream_options={"include_usage": True},
                                                 **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 20


def test_chat_stream_wire_format(server, model):
    body = {"model": model, "messages": MESSAGES, "max_tokens": 5, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    first = json.loads(events[0][6:])
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


def test_multibyte_text_never_garbled(client, model):
    messages = [{"role": "user", "content": "Translate to Japanese: I love Tokyo and sushi."}]
    kwargs = dict(model=model, messages=messages, max_tokens=32, **GREEDY)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    assert any(ord(ch) > 0x3000 for ch in full)  # 3-byte characters, split across tokens
    deltas = [c.choices[0].delta.content or "" for c in
              client.chat.completions.create(stream=True, **kwargs)]
    assert "\ufffd" not in full and all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == full


# -- many requests at once -------------------------------------------------------------------
def test_32_concurrent_streams_batch_together(server, model):
    async def run() -> tuple[list[tuple[int, str, int]], float]:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                    max_retries=0)
        peak = 0.0
        done = asyncio.Event()

        async def watch() -> None:
            nonlocal peak
            async with httpx.AsyncClient() as http:
                while not done.is_set():
                    text = (await http.get(f"{server.base_url}/metrics")).text
                    for line in text.splitlines():
                        if line.startswith("conveyor:iteration_batch_size{"):
                            peak = max(peak, float(line.rsplit(" ", 1)[1]))
                    await asyncio.sleep(0.02)

        async def one(max_tokens: int) -> tuple[int, str, int]:
            stream = await client.completions.create(
                model=model, prompt=f"{PROMPT} ({max_tokens})", max_tokens=max_tokens,
                stream=True, stream_options={"include_usage": True}, **GREEDY)
            reason, usage = None, 0
            async for chunk in stream:
                if chunk.choices:
                    reason = chunk.choices[0].finish_reason or reason
                if chunk.usage:
                    usage = chunk.usage.completion_tokens
            return max_tokens, reason, usage

        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(*(one(4 + i % 29) for i in range(32)))
        done.set()
        await watcher
        await client.close()
        return results, peak

    results, peak = asyncio.run(run())
    assert all(reason == "length" and usage == n for n, reason, usage in results)
    assert peak > 1


def test_disconnect_frees_pages(server, model):
    aborted_before = server.metrics().get("conveyor:request_success_total:abort", 0.0)

    async def run() -> list[str | None]:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                    max_retries=0)

        async def one(i: int) -> str | None:
            stream = await client.completions.create(model=model, prompt=f"{PROMPT} {i}",
                                                     max_tokens=32, stream=True, **GREEDY)
            reason, chunks = None, 0
            async for chunk in stream:
                chunks += 1
                reason = chunk.choices[0].finish_reason or reason
                if i % 2 and chunks == 3:
                    await stream.close()  # the client goes away mid-answer
                    return None
            return reason

        results = await asyncio.gather(*(one(i) for i in range(16)))
        await client.close()
        return results

    results = asyncio.run(run())
    assert results[0::2] == ["length"] * 8 and results[1::2] == [None] * 8
    m = wait_idle(server, aborts=aborted_before + 8)
    assert m["conveyor:num_requests_running"] == 0 and m["conveyor:kv_cache_usage_perc"] == 0
    assert m["conveyor:num_requests_waiting"] == 0
    assert m["conveyor:request_success_total:abort"] - aborted_before == 8


def test_non_streamed_request_is_aborted_when_the_client_leaves(server, model):
    aborted_before = server.metrics().get("conveyor:request_success_total:abort", 0.0)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # gives up long before 1000 tokens are done
        httpx.post(f"{server.base_url}/v1/completions", json=body,
                   timeout=httpx.Timeout(10.0, read=1.0))
    m = wait_idle(server, aborts=aborted_before + 1)
    assert m["conveyor:num_requests_running"] == 0 and m["conveyor:kv_cache_usage_perc"] == 0
    assert m["conveyor:request_success_total:abort"] - aborted_before == 1


def wait_idle(server, timeout: float = 10.0, aborts: float = 0.0) -> dict[str, float]:
    """Metrics once nothing runs, no page is held (gauges refresh every engine loop) and at
    least ``aborts`` requests were aborted (a request can still be on its way to the engine
    when the client leaves: idle then is not yet aborted)."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = (m["conveyor:num_requests_running"] == 0 and m["conveyor:kv_cache_usage_perc"] == 0
                and m.get("conveyor:request_success_total:abort", 0.0) >= aborts)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


# -- bad input ---------------------------------------------------------------------------------
COMPLETION = {"prompt": "Hi", "max_tokens": 4}
CHAT = {"messages": MESSAGES, "max_tokens": 4}
BAD_REQUESTS = [  # (path, body, status, param)
    ("completions", b"{not json", 400, None),
    ("completions", b"[1, 2]", 400, None),
    ("completions", {"max_tokens": 4}, 400, "prompt"),
    ("completions", {**COMPLETION, "temperature": "hot"}, 400, "temperature"),
    ("completions", {**COMPLETION, "temperature": -0.5}, 400, "temperature"),
    ("completions", {**COMPLETION, "top_p": 0}, 400, "top_p"),
    ("completions", {**COMPLETION, "top_p": 1.5}, 400, "top_p"),
    ("completions", {**COMPLETION, "n": 0}, 400, "n"),
    ("completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {**COMPLETION, "max_tokens": 2000}, 400, "max_tokens"),
    ("completions", {**COMPLETION, "prompt": ""}, 400, "prompt"),
    ("completions", {**COMPLETION, "prompt": [10**9]}, 400, "prompt"),
    ("completions", {**COMPLETION, "min_tokens": 9}, 400, "min_tokens"),
    ("completions", {**COMPLETION, "model": "gpt-7"}, 404, "model"),
    ("chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages"),
    ("chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("chat/completions", {**CHAT, "max_completion_tokens": 5000}, 400, "max_completion_tokens"),
    ("chat/completions", {**CHAT, "model": "gpt-7"}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_input_is_an_openai_error(server, path, body, status, param):
    url = f"{server.base_url}/v1/{path}"
    r = (httpx.post(url, content=body, headers={"content-type": "application/json"})
         if isinstance(body, bytes) else httpx.post(url, json=body))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_client_sees_bad_input_then_good_request_succeeds(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="Hi", temperature=-1)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-7", messages=MESSAGES)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, **GREEDY)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4


def test_metrics_count_tokens_and_latencies(server):
    m = server.metrics()
    assert m["conveyor:prompt_tokens_total"] > 0 and m["conveyor:generation_tokens_total"] > 0
    assert m["conveyor:request_success_total:length"] > 0
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total"):
        assert m[f"conveyor:{name}_count"] > 0, name
    assert "conveyor:num_preemptions_total" in m
    # vLLM's token histograms count tokens: every prompt token of a finished request
    assert (m["conveyor:request_prompt_tokens_sum"] <= m["conveyor:prompt_tokens_total"]
            and m["conveyor:request_generation_tokens_sum"]
            <= m["conveyor:generation_tokens_total"])
    assert m["conveyor:iteration_tokens_total_sum"] >= m["conveyor:generation_tokens_total"]
    # no *_created series; the process's own
    assert not [name for name in m if name.endswith("_created")]
    assert m["process_resident_memory_bytes"] > 0


def test_engine_steps_record(server):
    url = f"{server.base_url}/v1/engine/steps"
    first = httpx.get(url).json()
    assert first["steps"] and first["next"] == first["steps"][-1]["step"] + 1
    assert max(s["num_scheduled"] for s in first["steps"]) > 1  # the concurrent tests batched
    later = httpx.get(url, params={"since": first["next"]}).json()
    assert later == {"steps": [], "next": first["next"]}  # idle now: nothing new
    bad = httpx.get(url, params={"since": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"


def test_dashboard_feed_follows_one_request(server, client, model):
    url = f"{server.base_url}/v1/engine/dashboard"
    start = httpx.get(url).json()
    assert start["settings"]["max_num_seqs"] == 64 and start["settings"]["block_size"] == 16
    assert start["metrics"]["generation_tokens_total"] == server.metrics()[
        "conveyor:generation_tokens_total"]
    out = client.completions.create(model=model, prompt="Count: one two three", max_tokens=5,
                                    **GREEDY)
    feed = httpx.get(url, params={"since_step": start["next_step"],
                                  "since_event": start["next_event"]}).json()
    kinds = [e[1] for e in feed["events"]]
    assert kinds == ["arrive", "length"]
    arrive, finish = feed["events"]
    assert arrive[4] == out.usage.prompt_tokens and finish[4] == 5 and arrive[2] == finish[2]
    rows = [s[3] for s in feed["seating"]]
    assert [len(r) for r in rows] == [4] * 5  # alone: one sample, 4 numbers, 5 steps
    assert [r[3] for r in rows] == [0, 1, 1, 1, 1]  # prefill, then four decodes
    assert rows[0][2] == out.usage.prompt_tokens and len({r[1] for r in rows}) == 1
    assert feed["next_step"] == start["next_step"] + 5
    idle = httpx.get(url, params={"since_step": feed["next_step"],
                                  "since_event": feed["next_event"]}).json()
    assert idle["steps"] == idle["seating"] == idle["events"] == []
    page = httpx.get(f"{server.base_url}/dashboard")
    assert page.status_code == 200 and "uPlot.iife.min.js" in page.text
    assert httpx.get(f"{server.base_url}/dashboard/static/uPlot.iife.min.js").status_code == 200


# -- prefix caching and priority (issue: prefix caching) ----------------------------------------
def test_repeated_prefix_is_served_from_the_cache(server, client, model):
    system = "You are a careful assistant for the Conveyor inference server. " * 12
    before = server.metrics()
    first = client.completions.create(model=model, prompt=system + "First question?",
                                      max_tokens=2, **GREEDY)
    second = client.completions.create(model=model, prompt=system + "Second question?",
                                       max_tokens=2, temperature=0.0,
                                       extra_body={"ignore_eos": True, "priority": -1})
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < cached
    assert cached >= 0.8 * first.usage.prompt_tokens and cached % 16 == 0
    after = server.metrics()
    assert after["conveyor:prefix_cache_hits_total"] - before["conveyor:prefix_cache_hits_total"] \
        >= cached
    assert after["conveyor:prefix_cache_queries_total"] > before["conveyor:prefix_cache_queries_total"]


def test_reset_prefix_cache(server, client, model):
    prompt = "Repeat after me: the conveyor never stops moving, " * 8
    client.completions.create(model=model, prompt=prompt, max_tokens=1, **GREEDY)
    assert httpx.post(f"{server.base_url}/reset_prefix_cache").status_code == 200
    out = client.completions.create(model=model, prompt=prompt, max_tokens=1, **GREEDY)
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_embeddings_on_a_generation_server_are_a_clear_400(server, client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=model, input="hello")
    assert "--task embed" in e.value.body["message"]
    for path, body in (("/score", {"text_1": "a", "text_2": "b"}),
                       ("/v1/rerank", {"query": "a", "documents": ["b"]}),
                       ("/pooling", {"input": "a"})):
        r = httpx.post(f"{server.base_url}{path}", json=body, timeout=30)
        assert r.status_code == 400 and f"{path} needs a server started with --task embed" in \
            r.json()["error"]["message"], r.text


def test_success_counts_requests_and_samples_apart(server, client, model):
    """request_success counts a request of n samples once; request_sample_success n times."""
    before = server.metrics()
    client.completions.create(model=model, prompt=PROMPT, max_tokens=2, n=3, **GREEDY)
    after = server.metrics()
    for name, added in (("request_success_total", 1), ("request_sample_success_total", 3)):
        key = f"conveyor:{name}:length"
        assert after[key] - before.get(key, 0.0) == added
