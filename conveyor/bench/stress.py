"""``conveyor bench overload`` and ``conveyor bench soak``: does a server survive, and lose nothing?

Overload sends far more streams than the server has seats and queue, all at once: every one must
either complete or be refused quickly (429/503), and afterwards nothing may run, wait or hold a
KV page. Soak sends many short mixed requests (chat and completions, streamed or not) from a
fixed number of clients, some of which disconnect at random points and some of which send bad
requests on purpose: only those intended errors may appear, no page may leak, and the server's
resident memory must level off (measured after every KV page has been written once: the pool is
mapped lazily).

Both start ``conveyor serve`` with ``--server-args`` unless ``--base-url`` names a running
server (then resident memory is not measured).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from conveyor.bench.client import sse_lines
from conveyor.process import ConveyorServer

PROMPTS = ["The capital of France is", "Write a haiku about rivers.", "List three fruits:",
           "Explain continuous batching in one sentence.", "Once upon a time", "2 + 2 ="]
BAD_BODIES = [  # each must be answered with a 4xx in OpenAI's error shape
    ("/v1/completions", {"prompt": "x", "temperature": -1}),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 100}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}),
    ("/v1/chat/completions", {"messages": [{"role": "nobody", "content": "hi"}]}),
    ("/v1/completions", "{not json"),
]


@dataclass
class Outcome:
    kind: str          # completed, refused, disconnected, rejected (an intended 4xx), failed
    status: int | None
    seconds: float     # until the answer's status (refusals) or the end
    detail: str = ""


@dataclass
class ServerState:
    running: float
    waiting: float
    kv_usage: float
    num_kv_pages: int
    health: int
    rss_mib: float | None
    finished: dict[str, float] = field(default_factory=dict)

    @property
    def pages_in_use(self) -> int:
        return round(self.kv_usage * self.num_kv_pages)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus samples by name, labels summed over but for ``finished_reason`` (keyed
    ``name:reason``)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + (f":{s.labels['finished_reason']}" if "finished_reason" in s.labels
                            else "")
            values[key] = values.get(key, 0.0) + s.value
    return values


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def engine_settings(base_url: str, headers: dict) -> dict:
    """The running engine's settings, as its dashboard feed gives them."""
    return httpx.get(f"{base_url}/v1/engine/dashboard", params={"window": 1}, headers=headers,
                     timeout=30).json()["settings"]


def server_state(base_url: str, headers: dict, pid: int | None, settle_s: float = 30.0
                 ) -> ServerState:
    """The server once it has gone idle (running and waiting 0), or after ``settle_s``."""
    deadline = time.monotonic() + settle_s
    while True:
        m = {k.replace("vllm:", "conveyor:", 1): v  # (a server with --metrics-prefix vllm)
             for k, v in parse_metrics(httpx.get(f"{base_url}/metrics", timeout=30).text).items()}
        idle = not m["conveyor:num_requests_running"] and not m["conveyor:num_requests_waiting"]
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return ServerState(m["conveyor:num_requests_running"], m["conveyor:num_requests_waiting"],
                       m["conveyor:kv_cache_usage_perc"],
                       engine_settings(base_url, headers)["num_kv_pages"],
                       httpx.get(f"{base_url}/health", timeout=30).status_code, rss_mib(pid),
                       {k.split(":", 2)[-1]: v for k, v in m.items()
                        if k.startswith("conveyor:request_success_total:")})


def write_kv_pool(base_url: str, headers: dict, seed: int = 0) -> None:
    """Write every KV page once: prompts of random token ids (never a prefix hit) whose tokens
    add up to the pool's. The pool is mapped lazily and pages are handed out first-freed
    first, so until each has been written, resident memory grows by first touches, not leaks."""
    settings = engine_settings(base_url, headers)
    rng = random.Random(seed)
    left = settings["num_kv_pages"] * settings["block_size"]
    length = min(settings["max_model_len"] - 1, 2048)
    with tqdm(total=left, desc="writing every KV page once", unit="tok") as bar:
        while left > 0:
            prompt = [rng.randrange(100, 10_000) for _ in range(length)]
            httpx.post(f"{base_url}/v1/completions", headers=headers, timeout=600, json={
                "model": settings["model"], "prompt": prompt, "max_tokens": 1}).raise_for_status()
            left -= length
            bar.update(length)


def _is_openai_error(response: httpx.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)


async def _send(http: httpx.AsyncClient, path: str, body: dict | str, stream: bool,
                cut_after: int | None = None) -> Outcome:
    """One request; ``cut_after``: leave after that many stream events (a client that goes)."""
    t0 = time.monotonic()
    kwargs = {"json": body} if isinstance(body, dict) else {
        "content": body, "headers": {"Content-Type": "application/json"}}
    try:
        async with http.stream("POST", path, **kwargs) as r:
            if r.status_code != 200:
                await r.aread()
                kind = "refused" if r.status_code in (429, 503) else (
                    "rejected" if 400 <= r.status_code < 500 else "failed")
                if not _is_openai_error(r):
                    kind, detail = "failed", f"not OpenAI's error shape: {r.text[:200]}"
                else:
                    detail = r.json()["error"]["code"] or ""
                return Outcome(kind, r.status_code, time.monotonic() - t0, detail)
            if not stream:
                data = json.loads(await r.aread())
                ok = data["choices"] and all(c["finish_reason"] for c in data["choices"])
                return Outcome("completed" if ok else "failed", 200, time.monotonic() - t0,
                               "" if ok else f"unfinished: {data}")
            events, done, error = 0, False, None
            async for line in sse_lines(r):
                if not line:
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                events += 1
                error = json.loads(line.removeprefix("data: ")).get("error") or error
                if cut_after is not None and events >= cut_after:
                    return Outcome("disconnected", 200, time.monotonic() - t0)
            ok = done and error is None
            return Outcome("completed" if ok else "failed", 200, time.monotonic() - t0,
                           "" if ok else f"stream ended without [DONE] or with {error}")
    except httpx.HTTPError as e:
        return Outcome("failed", None, time.monotonic() - t0, f"{type(e).__name__}: {e}")


def _body(endpoint: str, prompt: str, max_tokens: int, stream: bool) -> dict:
    common = {"max_tokens": max_tokens, "stream": stream, "temperature": 0,
              "ignore_eos": True}
    if endpoint == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": prompt}], **common}
    return {"prompt": prompt, **common}


async def _raw_stream(host: str, port: int, headers: dict, body: dict) -> Outcome:
    """One streamed completion over a bare socket: hundreds of them at once cost an httpx
    client more CPU than the server's answers, which would time the client, not the server."""
    t0 = time.monotonic()
    payload = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                     f"{head}\r\n".encode() + payload)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        seconds = time.monotonic() - t0
        rest = (await reader.read()).decode(errors="replace")  # the server closes when done
        writer.close()
    except (OSError, ValueError, IndexError) as e:
        return Outcome("failed", None, time.monotonic() - t0, f"{type(e).__name__}: {e}")
    text = rest.partition("\r\n\r\n")[2]
    if status in (429, 503):
        kind = "refused" if '"error"' in text and '"code"' in text else "failed"
        return Outcome(kind, status, seconds, text[-200:] if kind == "failed" else "")
    if status == 200 and "data: [DONE]" in text and '"error"' not in text:
        return Outcome("completed", status, time.monotonic() - t0)
    return Outcome("failed", status, time.monotonic() - t0, text[-200:])


async def run_overload(base_url: str, headers: dict, num_streams: int, max_tokens: int
                       ) -> list[Outcome]:
    url = httpx.URL(base_url)
    return await asyncio.gather(*(
        _raw_stream(url.host, url.port, headers, _body(
            "/v1/completions", PROMPTS[i % len(PROMPTS)], max_tokens, True))
        for i in range(num_streams)))


async def run_soak(base_url: str, headers: dict, num_requests: int, concurrency: int,
                   disconnect_share: float, bad_share: float, max_tokens: int, seed: int,
                   checkpoint: int, at_checkpoint) -> list[Outcome]:
    """``at_checkpoint()`` runs once, when ``checkpoint`` requests have finished."""
    rng = random.Random(seed)
    plan = []  # (kind, path, body, stream, stream events before leaving)
    for _ in range(num_requests):
        roll = rng.random()
        endpoint = rng.choice(["/v1/completions", "/v1/chat/completions"])
        stream = rng.random() < 0.5
        body = _body(endpoint, rng.choice(PROMPTS), rng.randint(1, max_tokens), stream)
        if roll < bad_share:
            plan.append(("bad", *rng.choice(BAD_BODIES), False, None))
        elif roll < bad_share + disconnect_share:  # leaves at a random point
            plan.append(("cut", endpoint, body, stream, rng.randint(1, max_tokens)))
        else:
            plan.append(("good", endpoint, body, stream, None))
    outcomes: list[Outcome] = []
    queue: asyncio.Queue = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            kind, path, body, stream, cut = queue.get_nowait()
            if kind == "cut" and not stream:  # a non-streamed request left mid-way
                try:
                    await asyncio.wait_for(_send(http, path, body, False),
                                           rng.uniform(0.01, 0.5))
                    outcome = Outcome("disconnected", 200, 0.0, "finished before leaving")
                except TimeoutError:
                    outcome = Outcome("disconnected", None, 0.0)
            else:
                outcome = await _send(http, path, body, stream, cut)
            if kind == "bad" and outcome.kind == "rejected":
                outcome.detail = f"intended: {outcome.detail}"
            # (a full queue's gate refuses before it reads a body, a bad one too: its retry
            # is told what is wrong)
            elif kind == "bad" and outcome.kind != "refused":
                outcome = Outcome("failed", outcome.status, outcome.seconds,
                                  f"a bad request was not refused with a 4xx: {outcome}")
            outcomes.append(outcome)
            bar.update()
            if len(outcomes) == checkpoint:
                await asyncio.to_thread(at_checkpoint)

    limits = httpx.Limits(max_connections=concurrency)
    with tqdm(total=num_requests, desc="soak", unit="req") as bar:
        async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                     timeout=httpx.Timeout(600.0)) as http:
            await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return outcomes


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def summary(outcomes: list[Outcome]) -> dict:
    kinds = Counter(o.kind for o in outcomes)
    refusals = [o.seconds for o in outcomes if o.kind == "refused"]
    return {
        "sent": len(outcomes),
        "outcomes": dict(kinds),
        "refused_by_code": dict(Counter(str(o.status) for o in outcomes if o.kind == "refused")),
        "rejected_by_code": dict(Counter(str(o.status) for o in outcomes
                                         if o.kind == "rejected")),
        "refusal_seconds_p50": _percentile(refusals, 50),
        "refusal_seconds_p99": _percentile(refusals, 99),
        "failures": [f"{o.status} {o.detail}" for o in outcomes if o.kind == "failed"][:20],
    }


@contextmanager
def _target(args: argparse.Namespace, default_flags: str):
    """(the server started, or None; its URL; its pid, or None) for the run inside."""
    if args.base_url:
        yield None, args.base_url, None
        return
    flags = shlex.split(args.server_args if args.server_args is not None else default_flags)
    with tempfile.NamedTemporaryFile(suffix=".log", prefix="conveyor-stress-", delete=False) as f:
        server = ConveyorServer(flags, f.name)
    with server:
        yield server, server.base_url, server.proc.pid


def _report(result: dict, server: ConveyorServer | None) -> None:
    if server is not None:  # "no error other than the intended ones", the server's side
        with open(server.log_path) as f:
            lines = f.read().splitlines()
        errors = [line for line in lines if " ERROR " in line or " CRITICAL " in line]
        result["server_log_errors"] = len(errors)
        result["server_log_first_errors"] = errors[:5]
    print(json.dumps(result, indent=2, default=str))


def _clean(after: ServerState, result: dict) -> bool:
    """Nothing runs, waits or holds a page, /health is 200, no request failed and the server
    logged no error."""
    return (after.running == after.waiting == after.pages_in_use == 0 and after.health == 200
            and not result["outcomes"].get("failed") and not result.get("server_log_errors"))


def overload(args: argparse.Namespace) -> None:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with _target(args, "--max-num-seqs 32 --max-queue-len 64") as (server, base_url, pid):
        t0 = time.monotonic()
        outcomes = asyncio.run(run_overload(base_url, headers, args.num_streams,
                                            args.max_tokens))
        elapsed = time.monotonic() - t0
        after = server_state(base_url, headers, pid)
    result = {"mode": "overload", "seconds": round(elapsed, 1), **summary(outcomes),
              "after": after.__dict__ | {"pages_in_use": after.pages_in_use}}
    _report(result, server)
    ok = _clean(after, result)
    print(f"overload: {'PASS' if ok else 'FAIL'}: {args.num_streams} streams, "
          f"{result['outcomes']}, refusal p99 {result['refusal_seconds_p99']:.3f} s, "
          f"{after.pages_in_use} pages in use after, /health {after.health}")


def soak(args: argparse.Namespace) -> None:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with _target(args, "--max-num-seqs 32") as (server, base_url, pid):
        rss: dict[str, float | None] = {"start": rss_mib(pid)}
        write_kv_pool(base_url, headers, args.seed)
        t0 = time.monotonic()
        outcomes = asyncio.run(run_soak(
            base_url, headers, args.num_requests, args.concurrency, args.disconnect_share,
            args.bad_share, args.max_tokens, args.seed, min(args.checkpoint, args.num_requests),
            lambda: rss.__setitem__("checkpoint", rss_mib(pid))))
        elapsed = time.monotonic() - t0
        after = server_state(base_url, headers, pid)
    growth = (after.rss_mib / rss["checkpoint"] - 1) if after.rss_mib and rss.get(
        "checkpoint") else None
    result = {"mode": "soak", "seconds": round(elapsed, 1), **summary(outcomes),
              "rss_mib_start": rss["start"], "rss_mib_checkpoint": rss.get("checkpoint"),
              "checkpoint": args.checkpoint, "rss_growth_after_checkpoint": growth,
              "after": after.__dict__ | {"pages_in_use": after.pages_in_use}}
    _report(result, server)
    ok = _clean(after, result) and (growth is None or growth < 0.05)
    print(f"soak: {'PASS' if ok else 'FAIL'}: {args.num_requests} requests, "
          f"{result['outcomes']}, {after.pages_in_use} pages in use after, resident memory "
          f"{rss.get('checkpoint')} MiB after {args.checkpoint} -> {after.rss_mib} MiB at the end")


def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None,
                   help="a running server (default: start conveyor serve with --server-args)")
    p.add_argument("--server-args", default=None, help="flags for the conveyor serve started")
    p.add_argument("--api-key", default=None,
                   help="the server's key (Authorization: Bearer)")
    p.add_argument("--max-tokens", type=int, default=8,
                   help="the most output tokens a request asks for")


def add_overload_args(p: argparse.ArgumentParser) -> None:
    _common_args(p)
    p.add_argument("--num-streams", type=int, default=640,
                   help="streamed requests sent at once")


def add_soak_args(p: argparse.ArgumentParser) -> None:
    _common_args(p)
    p.add_argument("--num-requests", type=int, default=10_000,
                   help="requests in the soak")
    p.add_argument("--concurrency", type=int, default=32,
                   help="requests in flight at once")
    p.add_argument("--disconnect-share", type=float, default=0.10,
                   help="share of clients that leave mid-request")
    p.add_argument("--bad-share", type=float, default=0.05,
                   help="share of malformed requests (each must get a 4xx)")
    p.add_argument("--checkpoint", type=int, default=1000,
                   help="resident memory is compared with its value after this many requests")
    p.add_argument("--seed", type=int, default=0,
                   help="the request mix's random seed")

