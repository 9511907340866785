"""The server under pressure: a bounded queue answers 503, and SIGTERM drains before exiting."""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest
from server_process import ServerProcess

BODY = {"prompt": "Count slowly from one to fifty:", "max_tokens": 24, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def small_server():
    proc = ServerProcess("--max-queue-len", "2", "--max-num-seqs", "2", "--enable-log-requests")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.terminate()


def test_queue_limit_answers_503_and_the_rest_complete(small_server):
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(
                http.post(f"{small_server.base_url}/v1/completions", json=BODY)
                for _ in range(12)))

    responses = asyncio.run(run())
    rejected = [r for r in responses if r.status_code == 503]
    accepted = [r for r in responses if r.status_code != 503]
    assert rejected and len(accepted) >= 2  # at least the first two, then the queue fills
    for r in rejected:
        assert r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "queue_full"
    for r in accepted:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 24


def test_sigterm_lets_running_requests_finish_then_exits_0(small_server):
    with httpx.stream("POST", f"{small_server.base_url}/v1/completions",
                      json={**BODY, "stream": True}, timeout=120) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        small_server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert first.startswith("data: ") and rest[-1] == "data: [DONE]"
    assert '"finish_reason": "length"' in rest[-2]
    assert small_server.proc.wait(60) == 0
    assert "finished cmpl-" in small_server.log()
