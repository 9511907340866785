"""``conveyor serve --data-parallel-size N``: N engine replicas, each a ``conveyor serve`` process
of its own (its own pages; tensor-parallel too with ``-tp``) on a loopback port, behind one HTTP
front that routes each completion to a replica (``router.Router``) and passes its answer, streamed
or not, back byte for byte. ``/metrics`` is every replica's, labelled ``replica``, plus the
front's routing counts; ``/health`` is 200 while every replica is; other routes go to replica 0.
A replica that exits takes the front down (exit 1), as a dead engine does a single server.
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
from dataclasses import replace

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.background import BackgroundTask

from conveyor.config import EngineConfig
from conveyor.model.loader import load_tokenizer
from conveyor.process import ConveyorServer
from conveyor.server.config import ServerConfig
from conveyor.server.data_parallel.router import Router
from conveyor.server.errors import APIError
from conveyor.settings import to_flags
from conveyor.worker.tensor_parallel import launched_by_torchrun

logger = logging.getLogger("conveyor.server")

ROUTED = ("/v1/completions", "/v1/chat/completions")
# Hop-by-hop headers, and those the proxy recomputes.
_DROP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade"}


def replica_flags(engine: EngineConfig, server: ServerConfig, threads: int | None) -> list[str]:
    """A replica's ``conveyor serve`` flags: the front's settings, one replica, on loopback
    (its port is its own)."""
    return (to_flags(replace(engine, data_parallel_size=1, threads=engine.threads or threads))
            + to_flags(replace(server, host="127.0.0.1", port=ServerConfig.port)))


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
        if path == "/v1/chat/completions":
            text = tokenizer.apply_chat_template(body["messages"], tools=body.get("tools"),
                                                 tokenize=False, add_generation_prompt=True)
            return tokenizer.encode(text, add_special_tokens=False)
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        return list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)
    except Exception:  # noqa: BLE001 - any malformed body: the replica says what is wrong
        return []


def build_front(replicas: list[ConveyorServer], router: Router, tokenizer,
                check_replicas: Callable[[], str | None]) -> FastAPI:
    """check_replicas: why the front must stop (a replica exited), or None; polled."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async def watch() -> None:
            while check_replicas() is None:
                await asyncio.sleep(0.5)

        watcher = asyncio.create_task(watch())
        yield
        watcher.cancel()

    app = FastAPI(title="Conveyor (data parallel)", docs_url=None, redoc_url=None,
                  openapi_url=None, lifespan=lifespan)
    client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None))
    registry = CollectorRegistry()
    collector = ReplicaCollector()
    registry.register(collector)
    routed = Counter("conveyor:dp_routed_requests", "Requests the front sent to each replica, "
                     "by why: its cached prefix, or the fewest waiting tokens.",
                     ["replica", "reason"], registry=registry)

    async def forward(request: Request, replica: int, body: bytes, on_first=None,
                      on_end=None) -> Response:
        url = f"{replicas[replica].base_url}{request.url.path}"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        try:
            upstream = await client.send(client.build_request(
                request.method, url, params=request.query_params, headers=headers,
                content=body), stream=True)
        except httpx.HTTPError as e:
            if on_end is not None:
                on_end()
            return APIError(503, f"replica {replica} is unreachable: {e}").response()

        async def relay():
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

        return StreamingResponse(relay(), upstream.status_code, {
            k: v for k, v in upstream.headers.items() if k.lower() not in _DROP},
            background=BackgroundTask(upstream.aclose))

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def completion(request: Request) -> Response:
        body = await request.body()
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        ids = (await asyncio.to_thread(prompt_tokens, tokenizer, request.url.path, parsed)
               if isinstance(parsed, dict) else [])
        replica, held = router.choose(ids)
        routed.labels(str(replica), "prefix" if held else "load").inc()
        return await forward(request, replica, body,
                             on_first=lambda: router.started(replica, len(ids)),
                             on_end=lambda: router.finished(replica))

    @app.get("/health")
    async def health() -> Response:
        death = check_replicas()
        if death is not None:
            return APIError(503, death).response()
        for r in replicas:
            resp = await client.get(f"{r.base_url}/health")
            if resp.status_code != 200:
                return Response(resp.content, resp.status_code, media_type="application/json")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        collector.texts = [(await client.get(f"{r.base_url}/metrics")).text for r in replicas]
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version() -> Response:
        info = (await client.get(f"{replicas[0].base_url}/version")).json()
        return Response(json.dumps({**info, "data_parallel_size": len(replicas)}),
                        media_type="application/json")

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT"])
    async def other(request: Request, path: str) -> Response:
        return await forward(request, 0, await request.body())

    return app


def run_front(engine: EngineConfig, settings: ServerConfig) -> None:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # (a line per proxied request)
    if launched_by_torchrun():
        raise ValueError("--data-parallel-size starts its replicas itself: run it without "
                         "torchrun")
    n = engine.data_parallel_size
    # each replica's ranks get the machine's cores shared out, unless --threads says
    threads = max(1, (os.cpu_count() or 1) // (n * engine.tensor_parallel_size))
    flags = replica_flags(engine, settings, threads)
    tokenizer = load_tokenizer(engine.model)
    replicas = [ConveyorServer(flags, None) for _ in range(n)]
    for r in replicas:  # all load at once
        r.start()
    try:
        for i, r in enumerate(replicas):
            r.wait_ready()
            logger.info("replica %d ready on %s (pid %d)", i, r.base_url, r.proc.pid)
    except BaseException:
        for r in replicas:
            r.__exit__(None, None, None)
        raise
    server: uvicorn.Server | None = None
    death: list[str] = []

    def check_replicas() -> str | None:
        for i, r in enumerate(replicas):
            stopping = server is not None and server.should_exit  # (its replicas stop too)
            if not death and not stopping and r.proc.poll() is not None:
                death.append(f"data-parallel replica {i} exited with {r.proc.returncode}")
                logger.critical("%s", death[0])
                if server is not None:
                    server.should_exit = True
        return death[0] if death else None

    app = build_front(replicas, Router(n, engine.block_size), tokenizer, check_replicas)
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port,
                                           log_level="info"))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    logger.info("ready on http://%s:%d: %d data-parallel replicas of %s", settings.host,
                settings.port, n, " ".join(flags))
    try:
        server.run()
    finally:
        for r in replicas:
            r.__exit__(None, None, None)
    if death:
        logger.critical("exiting 1: %s", death[0])
        sys.exit(1)
