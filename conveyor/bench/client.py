"""One streamed request to any OpenAI-compatible server, timed chunk by chunk."""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from conveyor.bench.datasets import BenchRequest

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0                  # seconds from send to the first text
    itl: list[float] = field(default_factory=list)  # gaps between later text chunks
    latency: float = 0.0               # send to the last byte
    start_time: float = 0.0            # perf_counter at send
    generated_text: str = ""
    error: str = ""


def build_payload(endpoint: str, model: str, req: BenchRequest, fields: dict) -> dict:
    """fields: the sampling fields every request carries (``request_fields``)."""
    payload = {"model": model, "max_tokens": req.output_len, "stream": True,
               "stream_options": {"include_usage": True}, **fields}
    if endpoint == "/v1/chat/completions":
        payload["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        payload["prompt"] = req.prompt
    return payload


def _chunk_text(chunk: dict, chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


SSE_LINE_END = re.compile(rb"\r\n|\r|\n")


def sse_split(data: bytes) -> list[str]:
    """A whole event stream's lines, by the rule of ``sse_lines``."""
    return [line.decode("utf-8", errors="replace") for line in SSE_LINE_END.split(data)]


async def sse_lines(resp: httpx.Response) -> AsyncIterator[str]:
    """The stream's lines, which end at a line feed, a carriage return or both (Server-Sent
    Events' rule). httpx's ``aiter_lines`` also breaks at U+2028, U+0085 and the like, which a
    server may leave unescaped inside a JSON string (llama-server does, for a token's text)."""
    pending = b""
    async for data in resp.aiter_bytes():
        *lines, pending = SSE_LINE_END.split(pending + data)
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if pending:
        yield pending.decode("utf-8", errors="replace")


async def send_request(client: httpx.AsyncClient, base_url: str, endpoint: str, model: str,
                       req: BenchRequest, fields: dict) -> RequestResult:
    """Stream one request; never raises (a failure is a result with ``success=False``)."""
    result = RequestResult(prompt_len=req.prompt_len)
    chat = endpoint == "/v1/chat/completions"
    start = result.start_time = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", base_url.rstrip("/") + endpoint,
                                 json=build_payload(endpoint, model, req, fields)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:200]}"
                return result
            async for line in sse_lines(resp):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = str(chunk["error"])[:200]
                    return result
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    result.output_tokens = usage["completion_tokens"]
                text = _chunk_text(chunk, chat)
                if not text:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
                result.generated_text += text
        result.latency = time.perf_counter() - start
        if not result.output_tokens:  # servers that do not report usage: one token per chunk
            result.output_tokens = chunks
        result.success = chunks > 0
        if not result.success:
            result.error = "no text was streamed"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"[:200]
    return result
