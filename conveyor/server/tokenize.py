"""vLLM's tokenizer routes: ``POST /tokenize`` (a prompt, or chat messages through the chat
template) and ``POST /detokenize``, in vLLM's request and response shapes."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field, model_validator

from conveyor.server.errors import bad_request
from conveyor.server.protocol import MAX_MESSAGES, ChatMessage
from conveyor.server.state import ServerState


class TokenizeRequest(BaseModel):
    """Either ``prompt`` (with the tokenizer's special tokens unless ``add_special_tokens`` is
    false) or ``messages`` (through the chat template, as a chat completion's prompt)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
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
        inputs, tokenizer = state.engine.inputs, state.engine.tokenizer
        if body.prompt is not None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens
                                   is not False)
        else:
            messages = [{"role": m.role, "content": m.text} for m in body.messages]
            try:
                ids = inputs.apply_chat_template(messages, body.add_generation_prompt, None,
                                                 body.chat_template_kwargs)
            except ValueError as e:
                raise bad_request(str(e), "messages") from e
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
