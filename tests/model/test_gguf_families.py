"""The GGUF files users download, family by family: a tiny random model with the family's real
tokenizer and chat template, converted by llama.cpp's own converter (``converted_ggufs``). Each
loads; its tokens, rendered chats and greedy output equal transformers' on the folder it was
converted from; a chat ends where the family ends a turn."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import torch
import transformers
from converted_ggufs import FAMILIES, convert, hf_tokenizer, write_hf_folder
from engine_checks import assert_no_leak

from conveyor import LLM, SamplingParams

# Leading spaces, runs of spaces and newlines, digits, emoji (joined too), CJK, a decomposed
# accent (Qwen's NFC), contractions, code, and special tokens' text inline.
TEXTS = [
    "Hello world!", "  two leading spaces", "   three", "trailing  ", "a  b   c    d",
    "digits 1234567 3.14159", "emoji 🤗🦙 and 😶\u200d🌫️", "日本語のテキスト、中文文本", "naïve café",
    "cafe\u0301 decomposed e\u0301", "tabs\tand\nnewlines\n\n\n", "x\n\n  y\t\tz",
    "I've been 'told he's there, 'RE you sure?", "def f(x):\n    return x ** 2  # comment",
    "▁literal ▁▁ marks", "<s> and </s> and <unk>", "<|im_start|>user\nhi<|im_end|>\n",
    "<start_of_turn>user\nhi<end_of_turn>\n", "<|user|>\nHi<|end|>\n<|assistant|>\n",
    "[INST] Hi [/INST]", "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "<think>\nok\n</think>",
]
CHAT = [{"role": "user", "content": "Hello, how are you?"},
        {"role": "assistant", "content": "  Fine, thanks.\n"},
        {"role": "user", "content": "Tell me 1234 jokes 🤗"}]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land",
           "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """family(name) -> (its HF folder, an LLM serving its GGUF), each loaded once; the files
    are converted all at once."""
    cache = tmp_path_factory.mktemp("tokenizer-cache")
    folders = {name: write_hf_folder(name, tmp_path_factory.mktemp(name)) for name in FAMILIES}
    ggufs = dict(zip(folders, map(str, convert(list(folders.values()), "model.gguf"))))

    @functools.cache
    def load(name: str) -> tuple[Path, LLM]:
        with pytest.MonkeyPatch.context() as mp:  # (its tokenizer's cache in the temp dir)
            mp.setenv("CONVEYOR_CACHE_DIR", str(cache))
            return folders[name], LLM(model=ggufs[name], dtype="float32", num_kv_blocks=64,
                                      max_model_len=256, kv_cache_dtype="float32")
    return load


def sentencepiece(folder: Path):
    """The folder's own SentencePiece model, where it has one; and whether it adds a space
    before a text (its dummy prefix)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    path = folder / "tokenizer.model"
    if not path.exists():
        return None, False
    proto = pb.ModelProto()
    proto.ParseFromString(path.read_bytes())
    return (spm.SentencePieceProcessor(model_file=str(path)),
            proto.normalizer_spec.add_dummy_prefix)


def llama_cpp_spm(hf, sp, text: str) -> list[int]:
    """llama.cpp's SentencePiece tokenization (llama-vocab.cpp, ``tokenize``): the text split
    at the added tokens, the whitespace after one that strips it dropped (Phi-3's), each run of
    text between them encoded by the model's own SentencePiece, space prefix and all."""
    added = {t.content: (i, t.rstrip) for i, t in hf.added_tokens_decoder.items()}
    pattern = re.compile("|".join(map(re.escape, sorted(added, key=len, reverse=True))))
    ids, at = [], 0
    while at <= len(text):
        found = pattern.search(text, at)
        end = found.start() if found else len(text)
        if end > at:
            ids += sp.encode(text[at:end])
        if found is None:
            return ids
        token, rstrip = added[found.group()]
        ids.append(token)
        at = found.end()
        while rstrip and at < len(text) and text[at].isspace():
            at += 1
    return ids


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tokens_and_chats_equal_the_hf_tokenizers(family, name):
    """transformers' tokenizer is the reference, but for a SentencePiece vocabulary with a
    space prefix: llama.cpp adds it before every run of text, at the start and after each
    special token, where transformers' (legacy=False) adds it once and not to a text that
    begins with a space. There the reference is llama.cpp's own algorithm over the model's
    SentencePiece (test_gguf_tokenizer checks it on llama.cpp's own test vectors)."""
    folder, llm = family(name)
    ours, hf = llm.engine.tokenizer, hf_tokenizer(folder)
    sp, prefixed = sentencepiece(folder)

    def reference(text: str) -> list[int]:
        return (llama_cpp_spm(hf, sp, text) if prefixed
                else hf.encode(text, add_special_tokens=False))

    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False) == reference(text), text
        assert ours.decode(hf(text).input_ids) == hf.decode(hf(text).input_ids), text
        if not prefixed:
            assert ours(text).input_ids == hf(text).input_ids, text  # (BOS where it adds one)
    for generation_prompt in (True, False):
        rendered = hf.apply_chat_template(CHAT, tokenize=False,
                                          add_generation_prompt=generation_prompt)
        assert ours.apply_chat_template(CHAT, tokenize=False,
                                        add_generation_prompt=generation_prompt) == rendered
        assert llm.engine.inputs.apply_chat_template(CHAT, generation_prompt) == reference(
            rendered)


# Whitespace as SentencePiece normalizes it: leading, trailing and repeated spaces, newlines,
# tabs and their mixtures, alone and around words
WHITESPACE = [" ", "  ", "   ", "\t", "\n", "\n\n", " \n ", "\t\n", "  leading spaces",
              " one leading", "trailing ", "trailing   ", "a  b   c    d", "x\n\n  y\t\tz",
              "\n\nafter newlines", "tab\tinside", "    indented\n    code\n",
              "mixed \t \n end  "]


@pytest.mark.parametrize("name", [n for n in FAMILIES if n in ("mistral_v0_3", "phi3_5",
                                                                "gemma2", "gemma3")])
def test_sentencepiece_families_split_whitespace_as_sentencepiece(family, name):
    """Plain text (no special tokens) as the model's own SentencePiece model encodes it, whose
    tokens llama.cpp reproduces on the converted file."""
    folder, llm = family(name)
    sp, _ = sentencepiece(folder)
    for text in WHITESPACE:
        assert llm.engine.tokenizer.encode(text, add_special_tokens=False) == sp.encode(text), (
            repr(text))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_tokens_equal_transformers(family, name):
    """Llama 3.2's rope from rope_freqs, Qwen2.5's YaRN, Phi-3.5's LongRoPE, SmolLM3's layers
    without rope, each as the converter wrote them."""
    folder, llm = family(name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = [llm.engine.tokenizer.encode(p) for p in PROMPTS]
    outputs = llm.generate([{"prompt_token_ids": i} for i in ids],
                           SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                           use_tqdm=False)
    for prompt, output in zip(ids, outputs):
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):]
        assert list(output.outputs[0].token_ids) == expected.tolist()
    assert_no_leak(llm)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_chat_stops_at_the_end_of_its_turn(family, name):
    """Each end-of-turn token, forced by a logit bias, ends the reply (finish_reason "stop")
    with nothing of it in the text."""
    _, llm = family(name)
    f, tokenizer = FAMILIES[name], llm.engine.tokenizer
    for text in (f.end_of_turn, *f.stops):
        (token,) = tokenizer.convert_tokens_to_ids([text])
        (output,) = llm.chat([[{"role": "user", "content": "Hi"}]],
                             SamplingParams(max_tokens=8, logit_bias={token: 100.0}),
                             use_tqdm=False)
        sample = output.outputs[0]
        assert (sample.finish_reason, list(sample.token_ids), sample.text) == ("stop", [token], "")
