"""``POST /v1/completions``: one or more prompts, each sampled ``n`` times."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from conveyor.outputs import RequestOutput
from conveyor.server.engine_thread import Submission
from conveyor.server.errors import bad_request
from conveyor.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprobs,
    UsageInfo,
    prompt_logprobs_of,
)
from conveyor.server.state import ServerState, collect, engine_failure, prompt_list
from conveyor.server.streaming import SSE_DONE, TextDeltas, sse


def _logprobs(token_ids: list[int], entries: list, offset: int) -> CompletionLogprobs:
    """OpenAI's legacy logprobs of these tokens; offsets count from ``offset``. A token without
    entries (the prompt's first) has null logprobs and is named by the decoded token in
    ``entries``' place (a string)."""
    out = CompletionLogprobs()
    for token_id, these in zip(token_ids, entries):
        if isinstance(these, str):
            text, logprob, top = these, None, None
        else:
            chosen = these[token_id]
            text, logprob = chosen.decoded_token or "", chosen.logprob
            top = {lp.decoded_token or "": lp.logprob for lp in these.values()}
        out.tokens.append(text)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _with_echo(out: RequestOutput, decode, logprobs: CompletionLogprobs) -> CompletionLogprobs:
    """The prompt's tokens with their logprobs (echo), then ``logprobs``."""
    ids, entries = out.prompt_token_ids, out.prompt_logprobs
    echo = _logprobs(ids, [decode([ids[0]]), *entries[1:]], 0)
    return CompletionLogprobs(**{k: getattr(echo, k) + getattr(logprobs, k)
                                 for k in CompletionLogprobs.model_fields})


def _prompt_only(out: RequestOutput) -> RequestOutput:
    """max_tokens 0: the engine sampled one token (it always does); dropped here, as vLLM."""
    return dataclasses.replace(out, outputs=[
        dataclasses.replace(s, text="", token_ids=[], logprobs=[], finish_reason="length",
                            stop_reason=None) for s in out.outputs])


async def create_completion(body: CompletionRequest, raw: Request,
                            state: ServerState) -> Response | CompletionResponse:
    state.check_model(body.model)
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens 0 needs echo: the prompt is then the whole answer",
                          "max_tokens")
    params = await state.sampling_params(body, max(1, body.max_tokens), body.logprobs)
    if body.echo and body.logprobs is not None:  # the prompt's logprobs are in the answer
        params = dataclasses.replace(params, prompt_logprobs=max(params.prompt_logprobs or 0,
                                                                 body.logprobs))
    checked = [state.check_prompt(p, params, "prompt") for p in prompt_list(body.prompt, "prompt")]
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
    if body.max_tokens == 0:
        finals = [_prompt_only(out) for out in finals]
    decode = state.engine.tokenizer.decode
    choices = []
    for i, out in enumerate(finals):
        for sample in out.outputs:
            logprobs = None
            if body.logprobs is not None:
                logprobs = _logprobs(sample.token_ids, sample.logprobs or [], len(echoes[i]))
                if body.echo:
                    logprobs = _with_echo(out, decode, logprobs)
            choices.append(CompletionChoice(index=i * body.n + sample.index,
                                            text=echoes[i] + sample.text, logprobs=logprobs,
                                            finish_reason=sample.finish_reason,
                                            prompt_logprobs=_asked_prompt_logprobs(body, out)))
    return CompletionResponse(id=request_id, created=created, model=state.model_name,
                              choices=choices, usage=UsageInfo.of(finals))


def _asked_prompt_logprobs(body: CompletionRequest, out: RequestOutput
                           ) -> PromptLogprobs | None:
    return prompt_logprobs_of(out) if body.prompt_logprobs is not None else None


async def _stream(state: ServerState, body: CompletionRequest, request_id: str, created: int,
                  submission: Submission, echoes: list[str], stop: list[str]
                  ) -> AsyncIterator[str]:
    deltas = [[TextDeltas(stop, echo) for _ in range(body.n)] for echo in echoes]
    offsets = [[len(echo)] * body.n for echo in echoes]
    latest: dict[int, RequestOutput] = {}
    decode = state.engine.tokenizer.decode

    def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        return sse(CompletionResponse(id=request_id, created=created, model=state.model_name,
                                      choices=choices, usage=usage))

    try:
        async for i, out in submission.outputs():
            if body.max_tokens == 0:
                out = _prompt_only(out)
            latest[i] = out
            for sample in out.outputs:
                d = deltas[i][sample.index]
                if d.done:
                    continue
                first = d.sent_tokens == 0 and d.sent_chars == 0
                text, tokens = d.next(sample)
                if not text and not sample.finished:
                    continue
                logprobs = None
                if body.logprobs is not None:
                    logprobs = _logprobs(sample.token_ids[tokens],
                                         (sample.logprobs or [])[tokens], offsets[i][sample.index])
                    offsets[i][sample.index] += sum(len(t) for t in logprobs.tokens)
                    if body.echo and first:
                        logprobs = _with_echo(out, decode, logprobs)
                yield chunk([CompletionChoice(
                    index=i * body.n + sample.index, text=text, logprobs=logprobs,
                    finish_reason=sample.finish_reason,
                    prompt_logprobs=_asked_prompt_logprobs(body, out) if first else None)],
                    UsageInfo.of([out]) if body.continuous_usage else None)
        if body.include_usage:
            yield chunk([], UsageInfo.of([latest[i] for i in sorted(latest)]))
    except Exception as e:  # reported in the stream: the 200 status is already sent
        yield sse({"error": engine_failure(e).info.model_dump()})
    finally:
        submission.abort()
    yield SSE_DONE
