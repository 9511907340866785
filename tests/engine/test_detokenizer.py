"""Incremental detokenization gives the text of decoding all the tokens at once, through the
Rust backend directly and through the transformers wrapper alike."""

from __future__ import annotations

import pytest

from conveyor.engine.detokenizer import IncrementalDetokenizer
from conveyor.model.loader import load_tokenizer

TEXT = "Héllo wörld, naïve café! 你好世界. Emoji: 🙂🙃 and a leading-space word. " * 3


class WrapperOnly:
    """The tokenizer's ``decode`` and nothing else: no backend to call directly."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


@pytest.mark.parametrize("direct", [True, False])
def test_incremental_text_is_the_whole_decode(default_gguf_path, direct):
    tokenizer = load_tokenizer(default_gguf_path)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer if direct else WrapperOnly(tokenizer), ids[:4], [])
    assert (detok._decode_ids == tokenizer.backend_tokenizer.decode) is direct
    for token in ids[4:]:
        detok.add_token(token)
        assert "\ufffd" not in detok.text  # a split character is held back, never shown broken
    assert detok.text == tokenizer.decode(ids[4:], skip_special_tokens=True)
