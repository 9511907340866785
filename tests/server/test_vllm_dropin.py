"""What a vLLM setup meets, on a server started from a vLLM-style launch line: CORS (vLLM's
--allowed-origins/--allowed-methods/--allowed-headers, also from a real browser page on another
origin: Debian's chromium, tests/browser.py), /ping, request logging, uvicorn's log level, and
vLLM's metric names (--metrics-prefix vllm), --max-logprobs."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from server_process import running_server


class _Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = b"<html><body>a chat UI</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_) -> None:
        pass


@pytest.fixture(scope="module")
def origins():
    """A page server on another port of this machine, as a chat UI's dev server runs: (the
    origin the API allows, the same page under a name it does not)."""
    pages = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=pages.serve_forever, daemon=True).start()
    port = pages.server_address[1]
    yield f"http://localhost:{port}", f"http://127.0.0.1:{port}"
    pages.shutdown()


@pytest.fixture(scope="module")
def server(origins):
    # flags as vLLM's docs write them for a chat model with tools, then Conveyor's own
    with running_server("--trust-remote-code", "--enable-auto-tool-choice", "--tool-call-parser",
                        "hermes", "--enforce-eager", "--gpu-memory-utilization", "0.9",
                        "--disable-log-stats", "--served-model-name", "smol", "my-smol",
                        "--uvicorn-log-level", "warning", "--metrics-prefix", "vllm",
                        "--max-logprobs", "25",
                        "--allowed-origins", f'["{origins[0]}"]') as proc:
        yield proc


def test_a_vllm_launch_line_serves_under_its_names(server):
    names = [m["id"] for m in httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"]]
    assert names == ["smol", "my-smol"]
    for name in names:
        r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, json={
            "model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
    log = server.log()
    for flag in ("--trust-remote-code", "--enable-auto-tool-choice", "--tool-call-parser",
                 "--gpu-memory-utilization", "--disable-log-stats"):
        assert f"{flag} (vLLM's) accepted" in log, flag


def preflight(server, origin: str) -> httpx.Response:
    return httpx.options(f"{server.base_url}/v1/chat/completions", timeout=30, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization"})


def test_a_browsers_preflight_is_answered_for_the_allowed_origins_only(server, origins):
    good, evil = origins
    ok = preflight(server, good)
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == good
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    refused = preflight(server, evil)
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    reply = httpx.get(f"{server.base_url}/v1/models", headers={"Origin": good}, timeout=30)
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == good


def test_ping_answers_as_health(server):
    assert httpx.get(f"{server.base_url}/ping", timeout=30).status_code == 200
    assert httpx.post(f"{server.base_url}/ping", timeout=30).status_code == 200


def test_requests_are_not_logged_by_default_nor_uvicorns_access_below_its_level(server):
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=120,
                   json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200
    log = server.log()
    assert "--trust-remote-code (vLLM's) accepted" in log and "ready on http://" in log
    assert "finished cmpl-" not in log and "POST /v1/completions" not in log


def test_metrics_under_vllms_names_with_its_inter_token_latency(server):
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=120,
                   json={"prompt": "Hello", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    m = server.metrics()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "generation_tokens_total", "time_to_first_token_seconds_count",
                 "e2e_request_latency_seconds_count"):
        assert f"vllm:{name}" in m, name
    assert any(k.startswith("vllm:request_success_total") for k in m)
    assert not any(k.startswith("conveyor:") for k in m)
    # this request's 5 tokens came in 5 steps: 4 intervals; every request's fewer than its tokens
    assert 4 <= m["vllm:inter_token_latency_seconds_count"] < m["vllm:generation_tokens_total"]


def fetch_from(browser, origin: str, server) -> dict:
    """What a page served from ``origin`` gets from fetch() of a chat completion (JSON, so the
    browser sends a preflight first): the reply's content, or the error the browser raised."""
    page = browser.new_page()
    page.goto(f"{origin}/")
    try:
        return page.evaluate("""async (url) => {
            try {
                const r = await fetch(url + '/v1/chat/completions', {method: 'POST',
                    headers: {'Content-Type': 'application/json'},
                    body: JSON.stringify({messages: [{role: 'user', content: 'Hi'}],
                                          max_tokens: 3})});
                const body = await r.json();
                return {status: r.status, content: body.choices[0].message.content};
            } catch (e) { return {error: String(e)}; }
        }""", server.base_url)
    finally:
        page.close()


@pytest.mark.slow
def test_a_page_on_another_origin_calls_the_api_from_a_real_browser(server, origins):
    browser_module = pytest.importorskip("browser")  # skips here without chromium (not in CI)
    with browser_module.launched() as browser:
        got = fetch_from(browser, origins[0], server)
        assert got.get("status") == 200 and isinstance(got["content"], str), got
        refused = fetch_from(browser, origins[1], server)
        assert "Failed to fetch" in refused.get("error", ""), refused


def test_max_logprobs_bounds_each_kind_of_logprobs(server):
    url = server.base_url
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"prompt": "Hello", "max_tokens": 1, "logprobs": 25})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == 25
    for path, body, field in (
            ("/v1/completions", {"prompt": "Hello", "logprobs": 26}, "logprobs"),
            ("/v1/completions", {"prompt": "Hello", "prompt_logprobs": 26}, "prompt_logprobs"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                      "logprobs": True, "top_logprobs": 26}, "top_logprobs")):
        r = httpx.post(f"{url}{path}", json={**body, "max_tokens": 1}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert "at most 25 (--max-logprobs)" in r.json()["error"]["message"]
