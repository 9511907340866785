"""vLLM's tokenizer routes: ``POST /tokenize`` (a prompt, or chat messages through the chat
template) and ``POST /detokenize``, in vLLM's request and response shapes."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field, model_validator

from conveyor.server.errors import bad_request
from conveyor.server.chat import chat_prompt
from conveyor.server.protocol import MAX_MESSAGES, ChatMessage, ChatPromptFields
from conveyor.server.state import ServerState


class TokenizeRequest(ChatPromptFields):
    """Either ``prompt`` (with the tokenizer's special tokens unless ``add_special_tokens`` is
    false) or ``messages``, with the tools and the template's settings: a chat completion's
    prompt for the same body (vLLM's tokenize request takes these too)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        state.check_model(body.model)
        tokenizer = state.engine.tokenizer
        if body.prompt is not None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens
                                   is not False)
        else:
            ids, _ = chat_prompt(body, state)
        return TokenizeResponse(
            count=len(ids), max_model_len=state.engine.max_model_len, tokens=ids,
            token_strs=tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        state.check_model(body.model)
        vocab = state.engine.inputs.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"tokens {bad[:5]} are not ids of this model's vocabulary "
                              f"(0 to {vocab - 1})", "tokens")
        return DetokenizeResponse(prompt=state.engine.tokenizer.decode(body.tokens))

    return router
