"""Turning a request's growing text into stream deltas, and Server-Sent Events framing.

The engine cuts a stop string out of the final text, but while a request runs its text may end
with the beginning of a stop string that the next token completes. So a running sample's last
``max(len(stop)) - 1`` characters are held back until it finishes: a client never receives text
that the final answer does not contain.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from conveyor.outputs import CompletionOutput


class TextDeltas:
    """Per sample: how much text and how many tokens were already sent."""

    def __init__(self, stop: list[str], prefix: str = "") -> None:
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.prefix = prefix  # sent before the first delta (completions' echo)
        self.sent_chars = 0
        self.sent_tokens = 0
        self.done = False

    def next(self, sample: CompletionOutput) -> tuple[str, slice]:
        """The new text to send and the slice of ``sample.token_ids`` it covers."""
        end = len(sample.text) if sample.finished else max(
            self.sent_chars, len(sample.text) - self.holdback)
        delta = self.prefix + sample.text[self.sent_chars:end]
        self.prefix = ""
        self.sent_chars = end
        tokens = slice(self.sent_tokens, len(sample.token_ids))
        self.sent_tokens = len(sample.token_ids)
        self.done = sample.finished
        return delta, tokens


def sse(payload: BaseModel | dict) -> str:
    """One ``data:`` event; unset optional fields are sent as null, as OpenAI does."""
    body = payload.model_dump() if isinstance(payload, BaseModel) else payload
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
