"""The FastAPI application: routes, error handlers and an OpenAPI schema that matches them."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Query, Request, Response
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST

from conveyor import __version__
from conveyor.engine.engine import LLMEngine
from conveyor.kernels import isa
from conveyor.server.access import DEFAULT_MAX_BODY_BYTES, AdmissionGate, ApiKeyGuard, BodyLimit
from conveyor.server.chat import create_chat_completion
from conveyor.server.completions import create_completion
from conveyor.server.dashboard import dashboard_router, mount_static
from conveyor.server.embeddings import EmbeddingRequest, EmbeddingResponse, create_embedding
from conveyor.server.engine_thread import EngineDead
from conveyor.server.errors import APIError, install_error_handlers
from conveyor.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    EngineSteps,
    ErrorResponse,
    ModelCard,
    ModelList,
    VersionInfo,
)
from conveyor.server.responses import create_response
from conveyor.server.responses_protocol import ResponseObject, ResponsesRequest
from conveyor.server.scoring import scoring_router
from conveyor.server.state import ServerState, engine_failure, refusal_error
from conveyor.server.tokenize import tokenize_router

logger = logging.getLogger("conveyor.server")

_GENERATE_RESPONSES = {
    200: {"description": "JSON, or Server-Sent Events when `stream` is true",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}},
    400: {"model": ErrorResponse, "description": "invalid request; `param` names the field"},
    401: {"model": ErrorResponse, "description": "missing or wrong API key (--api-key)"},
    404: {"model": ErrorResponse, "description": "unknown model"},
    408: {"model": ErrorResponse, "description": "ran past its `timeout`"},
    413: {"model": ErrorResponse, "description": "request body too large"},
    429: {"model": ErrorResponse, "description": "--max-concurrent-requests in flight; see "
                                                 "the Retry-After header"},
    500: {"model": ErrorResponse, "description": "this request failed (the others carry on)"},
    503: {"model": ErrorResponse, "description": "queue full (see the Retry-After header), or "
                                                 "the engine died"},
}


def build_app(state: ServerState, ready_message: str = "", api_key: str | None = None,
              dashboard_open: bool = True,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if ready_message:
            logger.info("%s", ready_message)
        yield
        state.engine_thread.stop()

    app = FastAPI(title="Conveyor", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API over a continuously batching engine")
    install_error_handlers(app)
    app.include_router(dashboard_router(state))
    app.include_router(tokenize_router(state))
    app.include_router(scoring_router(state))
    mount_static(app)

    def refusal() -> APIError | None:
        why = state.engine_thread.refusal()
        return None if why is None else refusal_error(why)

    # added innermost first: the key, then the gate (for callers with the key), then the
    # size limit, which is the first to read a body
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(AdmissionGate, paths=("/v1/completions", "/v1/chat/completions",
                                             "/v1/responses", "/v1/embeddings"),
                       refusal=refusal)
    app.add_middleware(ApiKeyGuard, api_key=api_key, dashboard_open=dashboard_open)

    @app.get("/health", summary="200 while the engine serves; 503 once it has died")
    @app.get("/ping", summary="as /health (vLLM's and SageMaker's name)")
    @app.post("/ping", summary="as /health (vLLM's and SageMaker's name)")
    async def health() -> Response:
        death = state.engine_thread.death
        if death is not None:
            raise engine_failure(EngineDead(death))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> VersionInfo:
        """The version, and what the engine chose for this machine (tier, dtype, kernels)."""
        engine, cpu = state.engine, isa.current()
        return VersionInfo(version=__version__, device=engine.device.type,
                           dtype=str(engine.dtype).removeprefix("torch."),
                           dtype_reason=engine.dtype_reason, cpu_isa=cpu.tier,
                           cpu_isa_reason=cpu.describe(), kernels=engine.runner.kernel_path,
                           load_seconds=round(engine.load_seconds, 3),
                           batch_invariant=engine.config.batch_invariant,
                           kv_cache_dtype=str(engine.kv_dtype).removeprefix("torch."),
                           tensor_parallel_size=engine.config.tensor_parallel_size)

    def card(name: str) -> ModelCard:
        engine = state.engine
        stops = sorted(engine.eos_token_ids)
        return ModelCard(id=name, root=engine.model_path, max_model_len=engine.max_model_len,
                         stop_token_ids=stops,
                         stop_tokens=engine.tokenizer.convert_ids_to_tokens(stops))

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card(name) for name in state.served_model_names])

    @app.get("/v1/models/{model:path}", responses={404: {"model": ErrorResponse}})
    async def model(model: str) -> ModelCard:
        """One served model (the client's ``models.retrieve``); 404 for any other name."""
        state.check_model(model)
        return card(model)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/engine/steps", summary="the engine's per-step record (bounded history)")
    async def engine_steps(since: int = Query(0, ge=0)) -> EngineSteps:
        # The engine thread appends while this reads: take "next" from what was copied.
        known = state.engine.num_steps
        records = state.engine.steps_since(since)
        return EngineSteps(steps=records, next=records[-1].step + 1 if records else known)

    @app.post("/reset_prefix_cache", summary="forget every cached KV page (vLLM's endpoint)",
              responses={409: {"model": ErrorResponse, "description": "requests are running"}})
    async def reset_prefix_cache() -> Response:
        if not await state.engine_thread.call(LLMEngine.reset_prefix_cache):
            raise APIError(409, "the prefix cache can only be reset while no request runs",
                           None, "requests_running")
        return Response(status_code=200)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses=_GENERATE_RESPONSES)
    async def completions(body: CompletionRequest, raw: Request):
        return await create_completion(body, raw, state)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=_GENERATE_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(body, raw, state)

    @app.post("/v1/responses", response_model=ResponseObject, responses=_GENERATE_RESPONSES,
              summary="OpenAI's Responses API, stateless: nothing is stored")
    async def responses(body: ResponsesRequest, raw: Request):
        return await create_response(body, raw, state)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_GENERATE_RESPONSES,
              summary="a vector per input (a server started with --task embed; 400 otherwise)")
    async def embeddings(body: EmbeddingRequest, raw: Request):
        return await create_embedding(body, raw, state)

    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema, less the 422 answers it documents by default: validation errors are
    400s here, in OpenAI's error shape."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version,
                             description=app.description, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
