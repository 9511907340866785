"""vLLM's pooling routes on an embed server (``--task embed``): ``/score`` and ``/v1/score``
(text pairs scored by the cosine of their embeddings, as vLLM scores with an embedding model),
``/rerank`` and ``/v1/rerank`` (Jina's and Cohere's shape), ``/pooling`` (the pooled vectors)
and ``/classify``, which needs a classification head that no model served here has: an error
that says so. Each is a 400 naming the task on a generation server."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field

from conveyor.server.embeddings import EmbeddingUsage, Inputs, ListResponse, embed
from conveyor.server.errors import APIError, bad_request
from conveyor.server.protocol import MAX_PROMPTS, ErrorResponse
from conveyor.server.state import ServerState, prompt_list

Texts = str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]


class ScoreRequest(BaseModel):
    model: str | None = None
    text_1: Texts
    text_2: Texts


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(ListResponse):
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankRequest(BaseModel):
    model: str | None = None
    query: str
    documents: Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
    top_n: int | None = Field(None, ge=1, description="the best this many (default: all)")


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class PoolingRequest(BaseModel):
    model: str | None = None
    input: Inputs


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float]


class PoolingResponse(ListResponse):
    data: list[PoolingData]
    usage: EmbeddingUsage


def cosine(a: list[float], b: list[float]) -> float:
    norms = math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
    return sum(x * y for x, y in zip(a, b)) / norms if norms else 0.0


def pairs(first: list[str], second: list[str]) -> list[tuple[int, int]]:
    """vLLM's pairing: one against each, or item by item."""
    if len(first) == 1:
        return [(0, j) for j in range(len(second))]
    if len(first) != len(second):
        raise bad_request(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one "
                          "text_1, or as many as text_2", "text_1")
    return [(i, i) for i in range(len(first))]


_RESPONSES = {400: {"model": ErrorResponse, "description": "a generation server, or bad input"},
              404: {"model": ErrorResponse, "description": "unknown model"}}


def scoring_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/score", response_model=ScoreResponse, responses=_RESPONSES)
    @router.post("/v1/score", response_model=ScoreResponse, responses=_RESPONSES)
    async def score(body: ScoreRequest, raw: Request):
        """text_1 against text_2: the cosine of their embeddings."""
        state.check_model(body.model)
        first, second = prompt_list(body.text_1, "text_1"), prompt_list(body.text_2, "text_2")
        matched = pairs(first, second)
        done = await embed(state, raw, first + second, "text_1")
        if done is None:
            return Response(status_code=499)
        request_id, vectors, tokens = done
        return ScoreResponse(
            id=request_id, model=state.model_name, usage=EmbeddingUsage(
                prompt_tokens=tokens, total_tokens=tokens),
            data=[ScoreData(index=k, score=cosine(vectors[i], vectors[len(first) + j]))
                  for k, (i, j) in enumerate(matched)])

    @router.post("/rerank", response_model=RerankResponse, responses=_RESPONSES)
    @router.post("/v1/rerank", response_model=RerankResponse, responses=_RESPONSES)
    async def rerank(body: RerankRequest, raw: Request):
        """The documents by the cosine of their embeddings with the query's, best first."""
        state.check_model(body.model)
        done = await embed(state, raw, [body.query, *body.documents], "documents")
        if done is None:
            return Response(status_code=499)
        request_id, vectors, tokens = done
        ranked = sorted(((cosine(vectors[0], v), i) for i, v in enumerate(vectors[1:])),
                        key=lambda scored: -scored[0])
        return RerankResponse(
            id=request_id, model=state.model_name, usage=RerankUsage(total_tokens=tokens),
            results=[RerankResult(index=i, document=RerankDocument(text=body.documents[i]),
                                  relevance_score=s) for s, i in ranked[:body.top_n]])

    @router.post("/pooling", response_model=PoolingResponse, responses=_RESPONSES)
    async def pooling(body: PoolingRequest, raw: Request):
        """Each input's pooled vector (as /v1/embeddings gives it)."""
        state.check_model(body.model)
        done = await embed(state, raw, body.input, "input")
        if done is None:
            return Response(status_code=499)
        request_id, vectors, tokens = done
        return PoolingResponse(id=request_id, model=state.model_name,
                               data=[PoolingData(index=i, data=v) for i, v in enumerate(vectors)],
                               usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))

    @router.post("/classify", responses={400: {"model": ErrorResponse}})
    async def classify() -> Response:
        """vLLM's: a sequence-classification model's labels. No such model is served here."""
        raise APIError(400, f"{state.model_name} has no classification head: /classify needs a "
                            "...ForSequenceClassification model, which Conveyor does not serve "
                            "(an embed server answers /v1/embeddings, /score and /rerank)",
                       None, "unsupported")

    return router
