"""``conveyor serve --data-parallel-size N`` (and ``--replica-url URL``): engine replicas, each a
``conveyor serve`` process of its own (its own pages; tensor-parallel too with ``-tp``), behind
one HTTP front that routes each completion to a replica (``router.Router``) and passes its
answer, streamed or not, back byte for byte. ``/metrics`` is every replica's, labelled
``replica``, plus the front's routing counts; other routes go to the first replica up.

Local replicas are the front's: it starts them on loopback ports, and one that exits takes the
front down (exit 1), as a dead engine does a single server. A ``--replica-url`` replica is an
already running ``conveyor serve`` (another machine's, say), checked at start to serve the
front's model: the front does not own it, so when it cannot be reached the front keeps serving
with the others, answers 503 only when none is left, skips it until its ``/health`` answers
again (polled), and ``/health`` reports it. Replicas are numbered local first, then the URLs in
the order given.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.background import BackgroundTask

from conveyor.config import EngineConfig
from conveyor.logs import configure_logging
from conveyor.model.hub import resolve_model
from conveyor.model.loader import default_model_path, load_tokenizer
from conveyor.process import ConveyorServer
from conveyor.server.access import ApiKeyGuard, is_loopback, with_cors
from conveyor.server.config import ServerConfig
from conveyor.server.data_parallel.router import NoReplicaUp, Router
from conveyor.server.errors import APIError
from conveyor.settings import to_flags
from conveyor.worker.tensor_parallel import launched_by_torchrun

logger = logging.getLogger("conveyor.server")

# the routes a replica is chosen for (by the prompt's tokens); the rest go to the first one up
ROUTED = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings")
# Hop-by-hop headers, and those the proxy recomputes.
_DROP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade"}
CONNECT_TIMEOUT_S = 10.0  # a replica (another machine) that takes longer is unreachable
PROBE_TIMEOUT_S = 5.0     # a replica's /health, /metrics and /version
POLL_S = 1.0              # how often a replica that is down is asked for /health
# The request never reached the replica: another may take it.
_NOT_CONNECTED = (httpx.ConnectError, httpx.ConnectTimeout)


@dataclass
class Replica:
    base_url: str
    server: ConveyorServer | None = None  # a local replica's process; None: one by URL

    @property
    def local(self) -> bool:
        return self.server is not None


def local_replica_count(data_parallel_size: int, urls: list[str]) -> int:
    """The replicas the front starts itself: --data-parallel-size counts every replica, those
    by URL too (as vLLM's counts every node's); with the default 1 the URLs alone serve."""
    if not urls:
        return data_parallel_size
    if 1 < data_parallel_size < len(urls):
        raise ValueError(f"--data-parallel-size {data_parallel_size} counts every replica, but "
                         f"{len(urls)} --replica-url are given: give at least {len(urls)} (or "
                         f"1: the URLs alone)")
    return max(data_parallel_size, len(urls)) - len(urls)


def served_names(engine: EngineConfig, server: ServerConfig) -> list[str]:
    """The names the replicas answer to, without loading the model (the loader's naming)."""
    if server.served_model_name:
        return server.served_model_name
    path = default_model_path() if engine.model is None else os.fspath(engine.model)
    if path.endswith(".gguf") and os.path.isfile(path):
        return [os.path.splitext(os.path.basename(path))[0]]
    return [os.path.basename(os.path.normpath(path))]


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def check_url_replica(url: str, names: list[str], api_key: str | None) -> None:
    """Raises ValueError (one line) unless the server at ``url`` answers /v1/models with every
    name the front answers to."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{url}/v1/models", headers=headers, timeout=CONNECT_TIMEOUT_S)
    except httpx.HTTPError as e:
        raise ValueError(f"--replica-url {url} does not answer ({_one_line(e)}): start "
                         f"`conveyor serve` there first") from None
    if resp.status_code != 200:
        hint = ": give the front the replicas' --api-key" if resp.status_code == 401 else ""
        raise ValueError(f"--replica-url {url}: /v1/models answered {resp.status_code}{hint}")
    try:
        served = [m["id"] for m in resp.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"--replica-url {url}: /v1/models is no OpenAI model list") from None
    missing = [n for n in names if n not in served]
    if missing:
        raise ValueError(f"--replica-url {url} serves {', '.join(served) or 'no model'}, not "
                         f"{missing[0]} as the front does: give it the front's model (and "
                         f"--served-model-name)")


def replica_flags(engine: EngineConfig, server: ServerConfig, threads: int | None) -> list[str]:
    """A local replica's ``conveyor serve`` flags: the front's settings, one replica, on
    loopback (its port is its own)."""
    return (to_flags(replace(engine, data_parallel_size=1, threads=engine.threads or threads))
            + to_flags(replace(server, host="127.0.0.1", port=ServerConfig.port,
                               replica_url=None)))


class ReplicaCollector:
    """The replicas' metric families, each sample labelled with its replica."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def collect(self):
        merged: dict[str, Metric] = {}
        for replica, text in enumerate(self.texts):
            for family in text_string_to_metric_families(text):
                out = merged.setdefault(family.name, Metric(family.name, family.documentation,
                                                            family.type))
                for s in family.samples:
                    out.add_sample(s.name, {**s.labels, "replica": str(replica)}, s.value,
                                   s.timestamp)
        return list(merged.values())


def prompt_tokens(tokenizer, path: str, body: dict) -> list[int]:
    """The prompt's tokens as the replica will see them (the first prompt of a batch); [] where
    the body is not one the replica will take: it answers with the error."""
    try:
        messages = body.get("messages")
        if path == "/v1/responses":  # (its text messages: near enough to route by)
            given = body["input"]
            messages = ([{"role": "system", "content": body["instructions"]}]
                        * bool(body.get("instructions"))
                        + ([{"role": "user", "content": given}] if isinstance(given, str) else
                           [{"role": m["role"], "content": m["content"]} for m in given
                            if isinstance(m.get("content"), str)]))
        if path in ("/v1/chat/completions", "/v1/responses"):
            text = tokenizer.apply_chat_template(messages, tools=body.get("tools"),
                                                 tokenize=False, add_generation_prompt=True)
            return tokenizer.encode(text, add_special_tokens=False)
        prompt = body["input" if path == "/v1/embeddings" else "prompt"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        return list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)
    except Exception:  # noqa: BLE001 - any malformed body: the replica says what is wrong
        return []


def build_front(replicas: list[Replica], router: Router, tokenizer,
                check_replicas: Callable[[], str | None]) -> FastAPI:
    """check_replicas: why the front must stop (a local replica exited), or None; polled."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
                               limits=httpx.Limits(max_connections=None))

    def name(i: int) -> str:
        return f"replica {i} ({replicas[i].base_url})"

    def went_down(i: int, why: str) -> None:
        if router.replicas[i].up:
            logger.warning("%s is unreachable (%s): no requests go there until its /health "
                           "answers", name(i), why)
        router.mark_down(i)

    async def probe(i: int) -> tuple[httpx.Response | None, str]:
        """The replica's /health (None when it did not answer), and what is wrong ('' if
        nothing); it is marked up or down by it."""
        try:
            resp = await client.get(f"{replicas[i].base_url}/health", timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError as e:
            went_down(i, _one_line(e))
            return None, _one_line(e)
        if resp.status_code != 200:
            went_down(i, f"/health answered {resp.status_code}")
            return resp, f"/health answered {resp.status_code}"
        if not router.replicas[i].up:
            logger.info("%s answers again", name(i))
        router.mark_up(i)
        return resp, ""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async def watch() -> None:
            while check_replicas() is None:
                await asyncio.sleep(0.5)

        async def poll() -> None:
            while True:
                await asyncio.sleep(POLL_S)
                await asyncio.gather(*(probe(i) for i, r in enumerate(router.replicas)
                                       if not r.up))

        tasks = [asyncio.create_task(watch()), asyncio.create_task(poll())]
        yield
        for task in tasks:
            task.cancel()
        await client.aclose()

    app = FastAPI(title="Conveyor (data parallel)", docs_url=None, redoc_url=None,
                  openapi_url=None, lifespan=lifespan)
    registry = CollectorRegistry()
    collector = ReplicaCollector()
    registry.register(collector)
    routed = Counter("conveyor:dp_routed_requests", "Requests the front sent to each replica, "
                     "by why: its cached prefix, or the fewest waiting tokens.",
                     ["replica", "reason"], registry=registry)
    up = Gauge("conveyor:dp_replica_up", "1 while the front routes to the replica, 0 while "
               "it could not reach it.", ["replica", "url"], registry=registry)

    def unreachable() -> APIError:
        return APIError(503, "no data-parallel replica is reachable: " + ", ".join(
            name(i) for i in range(len(replicas))))

    def relay(upstream: httpx.Response, on_first=None, on_end=None) -> Response:
        async def chunks():
            first = True
            try:
                async for chunk in upstream.aiter_raw():
                    if first and on_first is not None:
                        on_first()
                    first = False
                    yield chunk
            finally:
                if first and on_first is not None:
                    on_first()
                if on_end is not None:
                    on_end()

        return StreamingResponse(chunks(), upstream.status_code, {
            k: v for k, v in upstream.headers.items() if k.lower() not in _DROP},
            background=BackgroundTask(upstream.aclose))

    async def forward(request: Request, body: bytes, ids: list[int] | None) -> Response:
        """A completion (its prompt's ``ids``) to the router's choice, anything else (ids None)
        to the first replica up. A replica that cannot be connected to is marked down, and the
        request goes to the next choice."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        for _ in range(len(replicas)):
            try:
                replica, held = router.choose(ids) if ids is not None else (router.up()[0], 0)
            except NoReplicaUp:
                return unreachable().response()
            try:
                upstream = await client.send(client.build_request(
                    request.method, f"{replicas[replica].base_url}{request.url.path}",
                    params=request.query_params, headers=headers, content=body), stream=True)
            except httpx.HTTPError as e:
                if ids is not None:
                    router.withdraw(replica, len(ids))
                if isinstance(e, httpx.TransportError):
                    went_down(replica, _one_line(e))
                if isinstance(e, _NOT_CONNECTED):
                    continue
                return APIError(503, f"{name(replica)} failed: {_one_line(e)}").response()
            if ids is None:
                return relay(upstream)
            routed.labels(str(replica), "prefix" if held else "load").inc()
            n = len(ids)
            return relay(upstream, on_first=lambda: router.started(replica, n),
                         on_end=lambda: router.finished(replica))
        return unreachable().response()

    async def completion(request: Request) -> Response:
        body = await request.body()
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        ids = (await asyncio.to_thread(prompt_tokens, tokenizer, request.url.path, parsed)
               if isinstance(parsed, dict) else [])
        return await forward(request, body, ids)

    for path in ROUTED:
        app.post(path)(completion)

    @app.get("/health")
    async def health() -> Response:
        """503 once a local replica is unhealthy (the front is going down), or while no replica
        is; else 200, and each replica's state."""
        death = check_replicas()
        if death is not None:
            return APIError(503, death).response()
        probes = await asyncio.gather(*(probe(i) for i in range(len(replicas))))
        for i, (resp, wrong) in enumerate(probes):
            if replicas[i].local and wrong:
                if resp is not None:
                    return Response(resp.content, resp.status_code,
                                    media_type="application/json")
                return APIError(503, f"{name(i)} is unreachable: {wrong}").response()
        if all(wrong for _, wrong in probes):
            return APIError(503, "no data-parallel replica is healthy: " + "; ".join(
                f"{name(i)}: {wrong}" for i, (_, wrong) in enumerate(probes))).response()
        return JSONResponse({"replicas": [
            {"replica": str(i), "url": r.base_url, "local": r.local, "healthy": not wrong,
             **({"error": wrong} if wrong else {})}
            for i, (r, (_, wrong)) in enumerate(zip(replicas, probes))]})

    @app.get("/metrics")
    async def metrics() -> Response:
        async def text(i: int) -> str:
            try:
                resp = await client.get(f"{replicas[i].base_url}/metrics",
                                        timeout=PROBE_TIMEOUT_S)
            except httpx.HTTPError as e:
                if isinstance(e, httpx.TransportError):
                    went_down(i, _one_line(e))
                return ""
            return resp.text if resp.status_code == 200 else ""

        collector.texts = list(await asyncio.gather(*(text(i) for i in range(len(replicas)))))
        for i, r in enumerate(replicas):
            up.labels(str(i), r.base_url).set(1 if router.replicas[i].up else 0)
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version() -> Response:
        try:
            i = router.up()[0]
            info = (await client.get(f"{replicas[i].base_url}/version",
                                     timeout=PROBE_TIMEOUT_S)).json()
        except NoReplicaUp:
            return unreachable().response()
        except (httpx.HTTPError, ValueError) as e:
            return APIError(503, f"{name(i)} failed: {_one_line(e)}").response()
        return Response(json.dumps({**info, "data_parallel_size": len(replicas)}),
                        media_type="application/json")

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT"])
    async def other(request: Request, path: str) -> Response:
        return await forward(request, await request.body(), None)

    return app


def run_front(engine: EngineConfig, settings: ServerConfig) -> None:
    configure_logging()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # (a line per proxied request)
    if launched_by_torchrun():
        raise ValueError("--data-parallel-size starts its replicas itself: run it without "
                         "torchrun")
    urls = settings.replica_url or []
    n = local_replica_count(engine.data_parallel_size, urls)
    api_key = settings.resolved_api_key()
    for url in urls:  # before anything loads
        check_url_replica(url, served_names(engine, settings), api_key)
    # each replica's ranks get the machine's cores shared out, unless --threads says
    threads = max(1, (os.cpu_count() or 1) // (max(n, 1) * engine.tensor_parallel_size))
    flags = replica_flags(engine, settings, threads)
    tokenizer = load_tokenizer(resolve_model(engine.model, engine.revision))
    local = [ConveyorServer(flags, None) for _ in range(n)]
    for r in local:  # all load at once
        r.start()
    try:
        for i, r in enumerate(local):
            r.wait_ready()
            logger.info("replica %d ready on %s (pid %d)", i, r.base_url, r.proc.pid)
    except BaseException:
        for r in local:
            r.__exit__(None, None, None)
        raise
    replicas = [Replica(r.base_url, r) for r in local] + [Replica(url) for url in urls]
    for i, url in enumerate(urls, n):
        logger.info("replica %d: %s", i, url)
    server: uvicorn.Server | None = None
    death: list[str] = []

    def check_replicas() -> str | None:
        for i, r in enumerate(local):
            stopping = server is not None and server.should_exit  # (its replicas stop too)
            if not death and not stopping and r.proc.poll() is not None:
                death.append(f"data-parallel replica {i} exited with {r.proc.returncode}")
                logger.critical("%s", death[0])
                if server is not None:
                    server.should_exit = True
        return death[0] if death else None

    app = build_front(replicas, Router(len(replicas), engine.block_size), tokenizer,
                      check_replicas)
    # (the local replicas check the key too; those by URL are checked here)
    guarded = ApiKeyGuard(app, api_key, settings.dashboard_public or is_loopback(settings.host))
    server = uvicorn.Server(uvicorn.Config(with_cors(guarded, settings), host=settings.host,
                                           port=settings.port,
                                           log_level=settings.uvicorn_log_level))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    logger.info("ready on http://%s:%d: %d data-parallel replicas, %d local (%s)%s",
                settings.host, settings.port, len(replicas), n, " ".join(flags),
                "".join(f", {url}" for url in urls))
    try:
        server.run()
    finally:
        for r in local:
            r.__exit__(None, None, None)
    if death:
        logger.critical("exiting 1: %s", death[0])
        sys.exit(1)
