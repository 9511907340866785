"""Access, limits and faults over real HTTP on loopback: an API key, the dashboard kept to
loopback, body and request-size limits, concurrency limits and timeouts, one request's fault
staying its own, and a dead engine thread reported and exited on."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from server_process import ServerProcess

KEY = "sk-test-0123456789"
GREEDY = {"temperature": 0, "ignore_eos": True}
FAULTS = ("sample:FAULT-SAMPLE,detokenize:FAULT-DETOK,nan_logits:FAULT-NAN,"
          "engine:FAULT-DIE")


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def pages_back(server: ServerProcess) -> None:
    """Nothing runs or waits, and every KV page is back in the pool."""
    deadline = time.monotonic() + 10
    while True:
        m = server.metrics()
        done = (m["conveyor:num_requests_running"], m["conveyor:num_requests_waiting"],
                m["conveyor:kv_cache_usage_perc"]) == (0, 0, 0)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert done, m


# -- an API key --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed():
    proc = ServerProcess("--max-num-seqs", "4", env={"CONVEYOR_API_KEY": KEY})
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.terminate()


def test_the_key_is_needed_everywhere_but_health_metrics_and_the_dashboard_page(keyed):
    """The dashboard's page and scripts hold no data (a browser cannot send the key with a page
    load); its feeds need the key like everything else."""
    url = keyed.base_url
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("GET", "/v1/engine/dashboard"),
                         ("GET", "/v1/engine/steps"), ("POST", "/reset_prefix_cache"),
                         ("POST", "/tokenize"), ("GET", "/version")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, url + path, headers=headers, json={})
            assert error_of(r, 401)["code"] == "invalid_api_key", (path, headers)
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    assert httpx.get(f"{url}/dashboard").status_code == 200
    assert httpx.get(f"{url}/dashboard/static/dashboard.js").status_code == 200
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{url}/v1/engine/dashboard", headers=auth).status_code == 200
    assert "started with" not in keyed.log() and KEY not in keyed.log()
    assert "API key required on every route but /health, /metrics and the dashboard's page " \
           "(from CONVEYOR_API_KEY)" in keyed.log()


def test_the_official_client_with_and_without_the_key(keyed):
    good = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key=KEY, max_retries=0)
    out = good.completions.create(model=good.models.list().data[0].id, prompt="Hello",
                                  max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
    bad = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# -- limits and faults, one server with faults injected on cue --------------------------------
@pytest.fixture(scope="module")
def faulty():
    # 0.0.0.0: not loopback, so without a key the dashboard must not be served. float32 on
    # every CPU: a request's greedy tokens alone and in a batch are compared exactly, and
    # bfloat16's coarser sums would make near-ties a matter of the batch's kernel path.
    proc = ServerProcess("--host", "0.0.0.0", "--dtype", "float32", "--max-num-seqs", "8",
                         "--max-concurrent-requests", "8", "--max-body-bytes", "65536",
                         env={"CONVEYOR_FAULT_INJECTION": FAULTS})
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.terminate()


def test_without_a_key_the_dashboard_stays_on_loopback(faulty):
    for path in ("/dashboard", "/v1/engine/dashboard", "/v1/engine/steps"):
        assert error_of(httpx.get(faulty.base_url + path), 403)["code"] == \
            "dashboard_not_public"
    assert "the dashboard is off: it shows prompt text" in faulty.log()
    assert httpx.get(f"{faulty.base_url}/v1/models").status_code == 200


def test_sizes_past_the_limits_are_4xx_and_the_server_carries_on(faulty):
    url = f"{faulty.base_url}/v1/completions"
    error = error_of(httpx.post(url, json={"prompt": "x" * 70_000}), 413)
    assert error["code"] == "request_too_large"
    chunked = httpx.post(url, content=iter([b'{"prompt": "', b"y" * 70_000, b'"}']),
                         headers={"Content-Type": "application/json"})
    assert error_of(chunked, 413)["code"] == "request_too_large"
    assert error_of(httpx.post(url, json={"prompt": "x", "stop": ["s"] * 17}), 400)[
        "param"] == "stop"
    error = error_of(httpx.post(url, json={"prompt": "x", "n": 128, "max_tokens": 1000}), 400)
    assert error["param"] == "n" and error["message"].startswith("n (128) x (prompt")
    error = error_of(httpx.post(url, json={"prompt": "x", "max_tokens": 5000}), 400)
    assert error["param"] == "max_tokens" and "max_model_len (1024)" in error["message"]
    assert error_of(httpx.post(url, json={"prompt": "x", "logprobs": 21}), 400)[
        "param"] == "logprobs"
    deep = "[" * 5000 + "]" * 5000
    error_of(httpx.post(url, content=f'{{"prompt": {deep}}}',
                        headers={"Content-Type": "application/json"}), 400)
    r = httpx.post(url, json={"prompt": "Hello", "max_tokens": 2, **GREEDY})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_request_past_its_timeout_is_ended_and_its_pages_freed(faulty):
    url = f"{faulty.base_url}/v1/completions"
    body = {"prompt": "Count to a thousand:", "max_tokens": 900, "timeout": 0.5, **GREEDY}
    t = time.monotonic()
    assert error_of(httpx.post(url, json=body, timeout=60), 408)["code"] == "timeout"
    assert time.monotonic() - t < 5
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "timeout"
    pages_back(faulty)


def test_past_max_concurrent_requests_the_rest_get_429(faulty):
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(
                http.post(f"{faulty.base_url}/v1/completions",
                          json={"prompt": "Hi", "max_tokens": 16, **GREEDY})
                for _ in range(20)))

    responses = asyncio.run(burst())
    refused = [r for r in responses if r.status_code == 429]
    assert refused and len(responses) - len(refused) >= 8
    for r in refused:
        assert error_of(r, 429)["code"] == "too_many_requests"
        assert r.headers["retry-after"] == "1"
    assert all(r.status_code in (200, 429) for r in responses)
    pages_back(faulty)


PROMPTS = ["The capital of France is", "One, two, three,", "My favourite colour is",
           "Water boils at"]


def completions(url: str, prompts: list[str], stream: bool) -> list[dict]:
    """Each prompt's result: {"text": ...} or {"error": {...}}, all sent at once."""
    async def one(http: httpx.AsyncClient, prompt: str) -> dict:
        body = {"prompt": prompt, "max_tokens": 12, "stream": stream, **GREEDY}
        if not stream:
            r = await http.post(url, json=body)
            return r.json() | {"status": r.status_code}
        text, error = "", None
        async with http.stream("POST", url, json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line.removeprefix("data: "))
                    error = event.get("error", error)
                    text += "".join(c["text"] for c in event.get("choices", []))
        return {"error": error} if error else {"choices": [{"text": text}], "status": 200}

    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(one(http, p) for p in prompts))

    return asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True])
def test_a_fault_in_one_request_ends_it_alone(faulty, stream):
    url = f"{faulty.base_url}/v1/completions"
    alone = [completions(url, [p], stream)[0]["choices"][0]["text"] for p in PROMPTS]
    faults = [f"FAULT-{kind} here" for kind in ("SAMPLE", "DETOK", "NAN")]
    results = completions(url, PROMPTS[:2] + faults + PROMPTS[2:], stream)
    texts = [r["choices"][0]["text"] for r in results[:2] + results[5:]]
    assert texts == alone  # the batch's other requests got the tokens they get alone
    for r, what in zip(results[2:5], ("sampling failed", "detokenizer",
                                      "non-finite logits")):
        assert r["error"]["code"] == "request_failed" and what in r["error"]["message"]
        if not stream:
            assert r["status"] == 500
    pages_back(faulty)
    assert "engine loop error" not in faulty.log() and "died" not in faulty.log()


def test_a_dead_engine_fails_its_clients_says_503_and_exits_1(faulty):
    url = f"{faulty.base_url}/v1/completions"
    with httpx.stream("POST", url, json={"prompt": "Tell a long story:", "max_tokens": 900,
                                         "stream": True, **GREEDY}, timeout=60) as running:
        lines = running.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        killer = httpx.post(url, json={"prompt": "FAULT-DIE", "max_tokens": 4}, timeout=60)
        assert error_of(killer, 503)["code"] == "engine_dead"
        rest = [line for line in lines if line]
    assert json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == "engine_dead"
    try:  # at once, while the process is still up
        assert error_of(httpx.get(f"{faulty.base_url}/health"), 503)["code"] == "engine_dead"
    except httpx.TransportError:
        pass  # already shutting down: no longer listening
    assert faulty.proc.wait(40) == 1
    assert "the engine thread died" in faulty.log()
