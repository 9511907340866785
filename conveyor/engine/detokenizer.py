"""Incremental detokenization with stop strings.

Decoding token by token goes wrong in two ways: a multi-byte character split across tokens shows
as U+FFFD until its last byte arrives, and SentencePiece drops a word's leading space when the word
is decoded alone. Both are avoided by decoding a short window that starts a few tokens back and
emitting only what that window adds once it no longer ends in U+FFFD (vLLM's offsets scheme).

Each token takes two decodes of that window. Where the transformers tokenizer only hands the ids
to its Rust backend (no clean-up of tokenization spaces), the backend is called directly, a
fraction of the wrapper's cost (docs/results/design-notes#detokenizer-backend).
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str]) -> None:
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self.tokens: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode_ids = (backend.decode if backend is not None
                            and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
                            else tokenizer.decode)

    def _decode(self, tokens: list[int]) -> str:
        return self._decode_ids(tokens, skip_special_tokens=True)

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append a token and its text; return the stop string it completed, if any.

        On a stop, ``text`` is cut just before the stop string."""
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += delta
        if not self.stop or not check_stop:
            return None
        # Only a stop string that overlaps the new text can be new.
        window_start = max(0, len(self.text) - len(delta) - self.max_stop_len + 1)
        best = None
        for s in self.stop:
            i = self.text.find(s, window_start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.text = self.text[:best[0]]
        return best[1]
