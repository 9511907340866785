"""A GGUF's SentencePiece tokenizer against llama.cpp's own test vectors: the texts and token
ids its tokenizer test (``test-tokenizer-0``) holds for the vocabulary file it ships
(``models/ggml-vocab-phi-3.gguf``, the Llama 2 SentencePiece vocabulary with Phi-3's special
tokens): leading, trailing and repeated spaces, tabs, newlines, code, emoji, other scripts."""

from __future__ import annotations

import pytest
from converted_ggufs import llama_cpp

from conveyor.model.gguf_tokenizer import load_gguf_tokenizer

SEPARATOR = "\n__ggml_vocab_test__\n"


def test_a_sentencepiece_vocabulary_tokenizes_as_llama_cpp(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))  # (built, not read from a cache)
    vocab = llama_cpp() / "models" / "ggml-vocab-phi-3.gguf"
    texts = vocab.with_suffix(".gguf.inp").read_text(encoding="utf-8").split(SEPARATOR)
    expected = vocab.with_suffix(".gguf.out").read_text().split("\n")
    assert len(expected) >= len(texts) > 40
    tokenizer = load_gguf_tokenizer(str(vocab))
    wrong = [(text, want) for text, want in zip(texts, expected)
             if tokenizer.encode(text, add_special_tokens=False) != [int(t) for t in want.split()]]
    assert not wrong, f"{len(wrong)} of {len(texts)} differ, first: {wrong[0]!r}"


@pytest.mark.parametrize("text,ids", [
    ("<s> Hi", [1, 29871, 6324]),       # a space prefix after a special token too
    ("<s>Hi", [1, 6324]),
    ("<|user|>\nHi", [32010, 6324]),    # Phi-3's turn token takes the line break after it
    ("  leading spaces", [259, 8236, 8162]),
])
def test_special_tokens_and_the_space_prefix_as_llama_cpp(tmp_path, monkeypatch, text, ids):
    """As llama-tokenize (llama.cpp 11434, the peer build) gives them on the same file."""
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    tokenizer = load_gguf_tokenizer(str(llama_cpp() / "models" / "ggml-vocab-phi-3.gguf"))
    assert tokenizer.encode(text, add_special_tokens=False) == ids
