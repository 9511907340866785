"""Reasoning models' thinking, apart from their answer (vLLM's ``--reasoning-parser``): the text
between ``<think>`` and ``</think>`` is ``reasoning_content``, the rest ``content``.

``deepseek_r1``: its template opens the thinking in the prompt, so the output is reasoning from
its first character (a ``<think>`` there is dropped) until ``</think>``. ``qwen3``: the output
is reasoning only when it opens with ``<think>`` (with thinking off, Qwen3's template closes an
empty one in the prompt and the output is all answer). A thought never closed is all
reasoning. Streamed or not, the split is the same.
"""

from __future__ import annotations

import dataclasses

from conveyor.outputs import CompletionOutput
from conveyor.sampling_params import SamplingParams
from conveyor.server.streaming import TextDeltas

PARSERS = ("qwen3", "deepseek_r1")
OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(text: str, parser: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output; None where a part is absent."""
    if text.startswith(OPEN):
        text = text[len(OPEN):]
    elif parser == "qwen3":
        return None, text
    reasoning, closed, content = text.partition(CLOSE)
    return reasoning, (content if closed else None)


def think_tag_ids(tokenizer) -> tuple[int | None, int | None]:
    """The ids of ``<think>`` and ``</think>``, each None where it is not one token of the
    vocabulary (looked up, not the whole vocabulary built: this runs per request)."""
    ids = tokenizer.convert_tokens_to_ids([OPEN, CLOSE])
    unknown = (None, tokenizer.unk_token_id)
    return tuple(None if i in unknown else i for i in ids)


def constrain_the_answer(params: SamplingParams, prompt_ids: list[int], tokenizer
                         ) -> SamplingParams:
    """A constraint (a response format, tool calls) holds from the end of the thinking on, as
    vLLM's: from the first ``</think>`` the output brings, unless the prompt has already closed
    the thinking (its last tag is ``</think>``: Qwen3 with thinking off), where it holds from
    the first token; and over the whole output where ``</think>`` is no token of the model's
    vocabulary (a model that does not think in these tags; the server logs it at start)."""
    spec = params.structured_outputs
    if spec is None:
        return params
    opened, close = think_tag_ids(tokenizer)
    if close is None:
        return params
    tags = [i for i, t in enumerate(prompt_ids) if t in (close, opened)]
    if tags and prompt_ids[tags[-1]] == close:
        return params
    return dataclasses.replace(
        params, structured_outputs=dataclasses.replace(spec, after_token=close))


def _partial_tag_at_end(text: str) -> int:
    """How many characters at the end of ``text`` could begin ``<think>`` or ``</think>``."""
    for n in range(len(CLOSE) - 1, 0, -1):
        if text.endswith(CLOSE[:n]) or text.endswith(OPEN[:n]):
            return n
    return 0


class ReasoningDeltas:
    """Per sample: the stream's new reasoning and content, holding back a tag's beginning
    until the next token says whether it is one."""

    def __init__(self, parser: str, deltas: TextDeltas) -> None:
        self.parser = parser
        self.deltas = deltas
        self.text = ""  # the text received from ``deltas`` so far
        self.sent_reasoning = 0
        self.sent_content = 0

    @property
    def done(self) -> bool:
        return self.deltas.done

    def next(self, sample: CompletionOutput) -> tuple[str, str, slice]:
        """(new reasoning, new content, the token slice they cover)."""
        delta, tokens = self.deltas.next(sample)
        self.text += delta
        ready = self.text if sample.finished else self.text[
            :len(self.text) - _partial_tag_at_end(self.text)]
        if not sample.finished and self.parser == "qwen3" and OPEN.startswith(ready):
            ready = ""  # (not yet known whether it opens a thought)
        reasoning, content = split_reasoning(ready, self.parser)
        reasoning, content = reasoning or "", content or ""
        new = (reasoning[self.sent_reasoning:], content[self.sent_content:])
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return *new, tokens
