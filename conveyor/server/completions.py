"""``POST /v1/completions``: one or more prompts, each sampled ``n`` times."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from conveyor.outputs import CompletionOutput, RequestOutput
from conveyor.server.engine_thread import Submission
from conveyor.server.errors import bad_request
from conveyor.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from conveyor.server.state import ServerState, collect, engine_failure
from conveyor.server.streaming import SSE_DONE, TextDeltas, sse


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    return list(prompt)


def _logprobs(sample: CompletionOutput, tokens: slice, offset: int) -> CompletionLogprobs:
    """OpenAI's legacy logprobs for ``sample.token_ids[tokens]``; offsets count from
    ``offset``."""
    out = CompletionLogprobs()
    for token_id, entries in zip(sample.token_ids[tokens], (sample.logprobs or [])[tokens]):
        chosen = entries[token_id]
        text = chosen.decoded_token or ""
        out.tokens.append(text)
        out.token_logprobs.append(chosen.logprob)
        out.top_logprobs.append({lp.decoded_token or "": lp.logprob for lp in entries.values()})
        out.text_offset.append(offset)
        offset += len(text)
    return out


async def create_completion(body: CompletionRequest, raw: Request,
                            state: ServerState) -> Response | CompletionResponse:
    state.check_model(body.model)
    if body.echo and body.logprobs is not None:
        raise bad_request("echo together with logprobs is not supported (no prompt logprobs)",
                          "echo")
    params = await state.sampling_params(body, body.max_tokens, body.logprobs)
    checked = [state.check_prompt(p, params, "prompt") for p in _prompts(body.prompt)]
    echoes = [(text if text is not None else state.engine.tokenizer.decode(ids))
              if body.echo else "" for text, ids in checked]
    request_id, submission = state.submit("cmpl", [ids for _, ids in checked], params,
                                           body.priority, body.timeout)
    created = int(time.time())
    if body.stream:
        return StreamingResponse(
            _stream(state, body, request_id, created, submission, echoes, params.stop_strings),
            media_type="text/event-stream")

    finals = await collect(raw, submission, len(checked))
    if finals is None:
        return Response(status_code=499)
    choices = []
    for i, out in enumerate(finals):
        for sample in out.outputs:
            logprobs = (_logprobs(sample, slice(None), len(echoes[i]))
                        if body.logprobs is not None else None)
            choices.append(CompletionChoice(index=i * body.n + sample.index,
                                            text=echoes[i] + sample.text, logprobs=logprobs,
                                            finish_reason=sample.finish_reason))
    return CompletionResponse(id=request_id, created=created, model=state.model_name,
                              choices=choices, usage=UsageInfo.of(finals))


async def _stream(state: ServerState, body: CompletionRequest, request_id: str, created: int,
                  submission: Submission, echoes: list[str], stop: list[str]
                  ) -> AsyncIterator[str]:
    deltas = [[TextDeltas(stop, echo) for _ in range(body.n)] for echo in echoes]
    offsets = [[0] * body.n for _ in echoes]
    latest: dict[int, RequestOutput] = {}

    def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        return sse(CompletionResponse(id=request_id, created=created, model=state.model_name,
                                      choices=choices, usage=usage))

    try:
        async for i, out in submission.outputs():
            latest[i] = out
            for sample in out.outputs:
                d = deltas[i][sample.index]
                if d.done:
                    continue
                text, tokens = d.next(sample)
                if not text and not sample.finished:
                    continue
                logprobs = None
                if body.logprobs is not None:
                    logprobs = _logprobs(sample, tokens, offsets[i][sample.index])
                    offsets[i][sample.index] += sum(len(t) for t in logprobs.tokens)
                yield chunk([CompletionChoice(index=i * body.n + sample.index, text=text,
                                              logprobs=logprobs,
                                              finish_reason=sample.finish_reason)])
        if body.include_usage:
            yield chunk([], UsageInfo.of([latest[i] for i in sorted(latest)]))
    except Exception as e:  # reported in the stream: the 200 status is already sent
        yield sse({"error": engine_failure(e).info.model_dump()})
    finally:
        submission.abort()
    yield SSE_DONE
