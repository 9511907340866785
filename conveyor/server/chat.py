"""``POST /v1/chat/completions``: messages through the model's chat template."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from conveyor.outputs import CompletionOutput, RequestOutput
from conveyor.server.engine_thread import Submission
from conveyor.server.errors import bad_request
from conveyor.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatPromptFields,
    ChatLogprobs,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    prompt_logprobs_of,
)
from conveyor.server.reasoning import ReasoningDeltas, constrain_the_answer, split_reasoning
from conveyor.server.state import ServerState, collect, engine_failure
from conveyor.server.streaming import SSE_DONE, TextDeltas, sse
from conveyor.server.tool_schemas import tool_constraint
from conveyor.server.tools import (
    ToolCallDeltas,
    check_tool_schemas,
    finish_reason,
    parse_tool_calls,
    template_messages,
    tool_mode,
)


def _logprobs(sample: CompletionOutput, tokens: slice, top: int) -> ChatLogprobs:
    """OpenAI's chat logprobs for ``sample.token_ids[tokens]``, ``top`` alternatives each."""
    content = []
    for token_id, entries in zip(sample.token_ids[tokens], (sample.logprobs or [])[tokens]):
        chosen = entries[token_id]
        ranked = sorted(entries.values(), key=lambda lp: lp.rank)[:top]
        content.append(TokenLogprob(
            token=chosen.decoded_token or "", logprob=chosen.logprob,
            bytes=list((chosen.decoded_token or "").encode()),
            top_logprobs=[TopLogprob(token=lp.decoded_token or "", logprob=lp.logprob,
                                     bytes=list((lp.decoded_token or "").encode()))
                          for lp in ranked]))
    return ChatLogprobs(content=content)


def chat_prompt(body: ChatPromptFields, state: ServerState) -> tuple[list[int], str | None]:
    """The prompt's ids (the messages, tool calls and results, and the tools, through the chat
    template) and the tool mode: the chat route's, and /tokenize's count of it."""
    try:
        check_tool_schemas(body)
    except ValueError as e:
        raise bad_request(str(e), "tools") from e
    try:
        mode = tool_mode(body)
    except ValueError as e:
        raise bad_request(str(e), "tool_choice") from e
    try:
        messages, tools = template_messages(body, mode, state.engine.tokenizer.chat_template or "")
        ids = state.engine.inputs.apply_chat_template(messages, body.add_generation_prompt, tools,
                                                      body.chat_template_kwargs,
                                                      body.continue_final_message)
    except ValueError as e:
        raise bad_request(str(e), getattr(e, "param", None) or "messages") from e
    return ids, mode


async def create_chat_completion(body: ChatCompletionRequest, raw: Request,
                                 state: ServerState) -> Response | ChatCompletionResponse:
    state.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    ids, mode = chat_prompt(body, state)
    max_tokens = body.max_completion_tokens or body.max_tokens
    limit_param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    if max_tokens is None:  # as much as the context leaves, as vLLM does
        max_tokens = max(1, state.engine.max_model_len - len(ids))
        limit_param = "messages"
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = await state.sampling_params(body, max_tokens, top, tool_constraint(body, mode))
    if state.reasoning_parser:
        params = constrain_the_answer(params, ids, state.engine.tokenizer)
    _, ids = state.check_prompt({"prompt_token_ids": ids}, params, "messages", limit_param)
    request_id, submission = state.submit("chatcmpl", [ids], params, body.priority,
                                           body.timeout)
    created = int(time.time())
    if body.stream:
        return StreamingResponse(_stream(state, body, request_id, created, submission,
                                         params.stop_strings, mode),
                                 media_type="text/event-stream")

    finals = await collect(raw, submission, 1)
    if finals is None:
        return Response(status_code=499)
    out = finals[0]
    choices = []
    for s in out.outputs:
        reasoning, text = (split_reasoning(s.text, state.reasoning_parser)
                           if state.reasoning_parser else (None, s.text))
        content, calls = parse_tool_calls(text or "", mode)
        if mode == "required" and not calls and s.finish_reason == "length":
            content = text  # cut short before a call was whole: what it wrote, not nothing
        choices.append(ChatChoice(
            index=s.index, message=AssistantMessage(content=content if text is not None else None,
                                                    reasoning_content=reasoning,
                                                    tool_calls=calls),
            logprobs=_logprobs(s, slice(None), top) if top is not None else None,
            finish_reason=finish_reason(s, calls)))
    return ChatCompletionResponse(id=request_id, created=created, model=state.model_name,
                                  choices=choices, usage=UsageInfo.of([out]),
                                  prompt_logprobs=prompt_logprobs_of(out))


def _plain_delta(deltas: TextDeltas | ReasoningDeltas, sample: CompletionOutput
                 ) -> tuple[DeltaMessage | None, slice]:
    if isinstance(deltas, ReasoningDeltas):
        reasoning, text, tokens = deltas.next(sample)
    else:
        (text, tokens), reasoning = deltas.next(sample), ""
    if not (text or reasoning or sample.finished):
        return None, tokens
    return DeltaMessage(content=text or None, reasoning_content=reasoning or None), tokens


async def _stream(state: ServerState, body: ChatCompletionRequest, request_id: str, created: int,
                  submission: Submission, stop: list[str], mode: str | None
                  ) -> AsyncIterator[str]:
    top = (body.top_logprobs or 0) if body.logprobs else None
    with_tools = mode not in (None, "none")
    deltas = [ToolCallDeltas(mode, TextDeltas(stop)) if with_tools
              else ReasoningDeltas(state.reasoning_parser, TextDeltas(stop))
              if state.reasoning_parser else TextDeltas(stop) for _ in range(body.n)]
    latest: RequestOutput | None = None

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=state.model_name,
                                       choices=choices, usage=usage))

    try:
        for i in range(body.n):  # the role first, before any token, as OpenAI does
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                     content=""))])
        async for _, out in submission.outputs():
            if latest is None and out.prompt_logprobs is not None:  # the prompt is computed
                yield sse(ChatCompletionChunk(id=request_id, created=created,
                                              model=state.model_name, choices=[],
                                              prompt_logprobs=prompt_logprobs_of(out)))
            latest = out
            for sample in out.outputs:
                d = deltas[sample.index]
                if d.done:
                    continue
                delta, tokens = d.next(sample) if with_tools else _plain_delta(d, sample)
                if delta is None and not sample.finished:
                    continue
                reason = finish_reason(sample, d.calls) if with_tools else sample.finish_reason
                yield chunk([ChatChunkChoice(
                    index=sample.index, delta=delta or DeltaMessage(),
                    logprobs=_logprobs(sample, tokens, top) if top is not None else None,
                    finish_reason=reason)], UsageInfo.of([out]) if body.continuous_usage else None)
        if body.include_usage and latest is not None:
            yield chunk([], UsageInfo.of([latest]))
    except Exception as e:  # reported in the stream: the 200 status is already sent
        yield sse({"error": engine_failure(e).info.model_dump()})
    finally:
        submission.abort()
    yield SSE_DONE
