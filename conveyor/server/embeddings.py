"""``POST /v1/embeddings``: a vector per input, from a server started with ``--task embed``
(the prompt's last hidden states pooled and normalised, see ``PoolingParams``)."""

from __future__ import annotations

import base64
import time
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import Request, Response
from pydantic import BaseModel, Field, model_validator

from conveyor.sampling_params import PoolingParams
from conveyor.server.errors import bad_request
from conveyor.server.protocol import MAX_PROMPTS, refuse_unimplemented
from conveyor.server.state import ServerState, collect, prompt_list


# one input or many: texts or token ids
Inputs = (str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
          | Annotated[list[int], Field(min_length=1)]
          | Annotated[list[list[int]], Field(min_length=1, max_length=MAX_PROMPTS)])


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        # OpenAI's shortened vectors (Matryoshka models): no model served here is trained so
        refuse_unimplemented(data, {"dimensions": (None,)})
        return data

    model: str | None = None
    input: Inputs
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: the float32 vector's little-endian bytes")
    user: str | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ListResponse(BaseModel):
    """The head of a response that lists a vector (or score) per input; subclasses add
    ``data`` and ``usage``."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class EmbeddingResponse(ListResponse):
    data: list[Embedding]
    usage: EmbeddingUsage


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


async def embed(state: ServerState, raw: Request, inputs, param: str
                ) -> tuple[str, list[list[float]], int] | None:
    """(request id, a vector per input, prompt tokens) of an embed server; None when the
    client left. A generation server answers 400 naming ``param``."""
    if state.engine.config.task != "embed":
        raise bad_request(f"this server generates text; {raw.url.path} needs a server started "
                          "with --task embed", param, "wrong_task")
    params = PoolingParams()
    checked = [state.check_prompt(p, params, param) for p in prompt_list(inputs, param)]
    request_id, submission = state.submit("embd", [ids for _, ids in checked], params)
    finals = await collect(raw, submission, len(checked))
    if finals is None:
        return None
    return request_id, [out.embedding for out in finals], sum(len(ids) for _, ids in checked)


async def create_embedding(body: EmbeddingRequest, raw: Request, state: ServerState
                           ) -> Response | EmbeddingResponse:
    state.check_model(body.model)
    done = await embed(state, raw, body.input, "input")
    if done is None:
        return Response(status_code=499)
    request_id, vectors, tokens = done
    return EmbeddingResponse(
        id=request_id, model=state.model_name,
        data=[Embedding(embedding=_encoded(v, body.encoding_format), index=i)
              for i, v in enumerate(vectors)],
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
