"""The benchmark's metric definitions: exact on hand-made results, and measured on a fake server
that streams tokens on a script over real HTTP."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from conveyor.bench.client import RequestResult, sse_split
from conveyor.bench.datasets import BenchRequest
from conveyor.bench.metrics import compute_metrics, parse_goodput
from conveyor.bench.serve import arrival_gaps, run_load


def result(ttft: float, itl: list[float], tokens: int) -> RequestResult:
    return RequestResult(success=True, prompt_len=10, output_tokens=tokens, ttft=ttft, itl=itl,
                         latency=ttft + sum(itl))


def test_definitions_on_hand_made_results():
    results = [result(0.1, [0.02, 0.02, 0.02], 4),   # tpot = 0.06 / 3 = 20 ms
               result(0.3, [0.05], 2),                # tpot = 50 ms
               result(0.2, [], 1),                    # one token: no tpot, no itl
               RequestResult(success=False, prompt_len=10, error="HTTP 503")]
    m = compute_metrics(results, duration=2.0, percentiles=(50, 99),
                        goodput={"ttft": 250, "tpot": 30})
    s = m.summary
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["total_output_tokens"] == 7 and s["total_input_tokens"] == 30
    assert s["output_throughput"] == pytest.approx(3.5)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["total_token_throughput"] == pytest.approx(18.5)
    assert s["mean_ttft_ms"] == pytest.approx(200)
    assert s["median_ttft_ms"] == pytest.approx(200)
    assert s["p99_ttft_ms"] == pytest.approx(np.percentile([100, 300, 200], 99))
    assert s["mean_tpot_ms"] == pytest.approx(35)
    assert sorted(m.samples["itl"]) == pytest.approx([20, 20, 20, 50])
    assert s["p50_itl_ms"] == pytest.approx(20)
    assert s["mean_e2el_ms"] == pytest.approx((160 + 350 + 200) / 3)
    # goodput: request 1 meets both; 2 misses ttft and tpot; 3 has no tpot and meets ttft
    assert s["request_goodput"] == pytest.approx(2 / 2.0)


def test_goodput_parsing_and_arrivals():
    assert parse_goodput(["ttft:500", "e2el:3000"]) == {"ttft": 500, "e2el": 3000}
    for bad in (["itl:5"], ["ttft"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)
    assert arrival_gaps(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    gaps = arrival_gaps(4000, 10.0, 1.0, 0)
    assert np.mean(gaps) == pytest.approx(0.1, rel=0.05)          # rate 10/s
    bursty = arrival_gaps(4000, 10.0, 0.25, 0)
    assert np.mean(bursty) == pytest.approx(0.1, rel=0.1)
    assert np.std(bursty) > 1.5 * np.std(gaps)                    # same rate, burstier


# -- a fake OpenAI server with scripted timings ---------------------------------------------------
SCRIPT = {"a": [0.30, 0.10, 0.10, 0.10], "b": [0.10, 0.20], "c": [0.0, 0.0]}
# (first gap = TTFT, then ITLs) each chunk's text; "c"'s left unescaped in the JSON, as
# llama-server sends a token's U+2028 or U+0085
TEXTS = {"c": ["a\u2028b", "\x85c\r"]}


def fake_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        gaps = SCRIPT[body["prompt"]]

        async def stream():
            for gap, text in zip(gaps, TEXTS.get(body["prompt"], ["x"] * len(gaps))):
                await asyncio.sleep(gap)
                chunk = json.dumps({"choices": [{"index": 0, "text": text}]}, ensure_ascii=False)
                yield f"data: {chunk}\n\n"
            usage = {"prompt_tokens": 1, "completion_tokens": len(gaps)}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = uvicorn.Server(uvicorn.Config(fake_app(), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_measured_timings_follow_the_script(fake_server):
    workload = [BenchRequest("a", 1, 4), BenchRequest("b", 1, 2)]
    results, duration = asyncio.run(run_load(fake_server, "/v1/completions", "m", workload,
                                             [0.0, 0.0], None, {}, show_progress=False))
    a, b = results
    assert a.success and b.success
    assert a.output_tokens == 4 and b.output_tokens == 2  # from the usage chunk
    tol = 0.08
    assert a.ttft == pytest.approx(0.30, abs=tol) and b.ttft == pytest.approx(0.10, abs=tol)
    assert a.itl == pytest.approx([0.10] * 3, abs=tol) and b.itl == pytest.approx([0.20], abs=tol)
    m = compute_metrics(results, duration)
    assert m.summary["mean_tpot_ms"] == pytest.approx((100 + 200) / 2, abs=tol * 1000)
    assert duration == pytest.approx(0.6, abs=0.2)  # both at once: the longer one sets it


def test_a_line_separator_inside_a_json_string_is_text(fake_server):
    """SSE lines end at \\n or \\r only; U+2028 and U+0085 inside a chunk are its text."""
    results, _ = asyncio.run(run_load(fake_server, "/v1/completions", "m",
                                      [BenchRequest("c", 1, 2)], [0.0], None, {},
                                      show_progress=False))
    assert results[0].success, results[0].error
    assert results[0].generated_text == "a\u2028b\x85c\r"


def test_sse_split_breaks_at_line_ends_only():
    """The whole-stream form (the fuzz tests' checks read a finished response with it)."""
    stream = 'data: "a\u2028b\x85"\r\ndata: x\rdata: y\n'.encode()
    assert sse_split(stream) == ['data: "a\u2028b\x85"', "data: x", "data: y", ""]
