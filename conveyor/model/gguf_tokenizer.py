"""A GGUF's tokenizer and stop ids, from its ``tokenizer.*`` metadata.

The tokenizer is built with the tokenizers library as Hugging Face builds the tokenizer the file
was converted from: a byte-level BPE (``tokenizer.ggml.model`` gpt2) gets the pre-tokenizer its
``tokenizer.ggml.pre`` names (the regex, Qwen's NFC, Llama 3's whole-word lookup); a
SentencePiece vocabulary (llama) gets merges ranked by its pieces' scores, byte fallback and
the leading space ``add_space_prefix`` says. transformers' own GGUF conversion drops some of
this (docs/results/gguf-files). A pre-tokenizer not in ``_PRE_TOKENIZERS`` falls back to that
conversion, with a line in the log saying so.

The stop ids are llama.cpp's end-of-generation set: the metadata's eos/eot/eom plus the tokens it
recognises by their text, since converters rarely store the end-of-turn token.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass

import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre
from transformers.tokenization_utils_base import generate_merges

from conveyor.model.gguf_config import metadata_number
from conveyor.model.gguf_file import one_line, read_gguf
from conveyor.model.gguf_reader import GGUFFile

logger = logging.getLogger("conveyor")

# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The texts llama.cpp ends generation on wherever a vocabulary has them (llama-vocab.cpp's
# end-of-generation list, with the fill-in-the-middle pad/repo/separator tokens it adds).
END_OF_GENERATION = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>",
    "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>",
    "<end_of_utterance>", "</s>", "<eos>",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
    "<REPO>", "<reponame>", "<|file_sep|>",
})

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
           r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
           r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
           r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class _PreTokenizer:
    """How a byte-level BPE splits text before merging, as its tokenizer.json says."""

    regex: str | None = None     # a Split before the byte mapping; None: GPT-2's own regex
    digits: bool = False         # each digit alone first (SmolLM's)
    nfc: bool = False            # text NFC-normalized first (Qwen's)
    ignore_merges: bool = False  # a word in the vocabulary is one token (Llama 3's, Tekken's)


# tokenizer.ggml.pre -> its pipeline (llama.cpp's names for the same tokenizers)
_PRE_TOKENIZERS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe"), _PreTokenizer(_LLAMA3,
                                                                      ignore_merges=True)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _PreTokenizer(_QWEN2, nfc=True)),
    "tekken": _PreTokenizer(_TEKKEN, ignore_merges=True),
    "smollm": _PreTokenizer(digits=True),
    "gpt-2": _PreTokenizer(),
}


def gguf_stop_token_ids(reader: GGUFFile) -> list[int]:
    """Every id that ends generation, as llama.cpp finds them: eos, eot and eom from the
    metadata, then each token whose text is in ``END_OF_GENERATION``, where it is not a plain
    piece of text (Qwen's vocabulary spells ``</s>`` as one: llama.cpp stops there too)."""
    tokens = reader.value("tokenizer.ggml.tokens") or []
    types = reader.value("tokenizer.ggml.token_type") or [CONTROL] * len(tokens)
    ids = []
    for k in ("eos", "eot", "eom"):
        i = metadata_number(reader, f"tokenizer.ggml.{k}_token_id", None, zero=True)
        if i is not None and i >= len(tokens):
            raise ValueError(f"tokenizer.ggml.{k}_token_id {i} is past the vocabulary's "
                             f"{len(tokens)} tokens")
        ids.append(i)
    ids += [i for i, (text, kind) in enumerate(zip(tokens, types))
            if text in END_OF_GENERATION and kind != NORMAL]
    return list(dict.fromkeys(i for i in ids if i is not None))


def gguf_tokenizer(reader: GGUFFile) -> transformers.PreTrainedTokenizerFast | None:
    """The file's tokenizer, or None where its pre-tokenizer is not one Conveyor builds."""
    kind = reader.value("tokenizer.ggml.model")
    tokens: list[str] = reader.value("tokenizer.ggml.tokens") or []
    types: list[int] = reader.value("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for "
                         f"{len(tokens)} tokens")
    if kind == "gpt2":
        name = reader.value("tokenizer.ggml.pre", "default")
        if name not in _PRE_TOKENIZERS:
            logger.info("GGUF pre-tokenizer %r is not one Conveyor builds: transformers' GGUF "
                        "conversion makes the tokenizer", name)
            return None
        tokenizer, texts = _byte_level_bpe(reader, tokens, _PRE_TOKENIZERS[name]), tokens
        add_bos = reader.value("tokenizer.ggml.add_bos_token",
                               _PRE_TOKENIZERS[name].ignore_merges)  # (llama.cpp's default)
    elif kind == "llama":
        tokenizer, texts = _sentencepiece_bpe(reader, tokens, types)
        add_bos = reader.value("tokenizer.ggml.add_bos_token", True)
    else:
        logger.info("GGUF tokenizer model %r: transformers' GGUF conversion makes the "
                    "tokenizer", kind)
        return None
    tokenizer.add_tokens(_added_tokens(reader, kind, texts, types))
    ids = _special_ids(reader, len(texts))
    single, special = ["$A"], []
    for role, add in (("bos", add_bos), ("eos", reader.value("tokenizer.ggml.add_eos_token"))):
        if add and role in ids:
            text = texts[ids[role]]
            single = [text, *single] if role == "bos" else [*single, text]
            special.append((text, ids[role]))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=single + ["$B:1"], special_tokens=special)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, clean_up_tokenization_spaces=False,
        chat_template=reader.value("tokenizer.chat_template"),
        **{f"{role}_token": texts[i] for role, i in ids.items()})


def _byte_level_bpe(reader: GGUFFile, tokens: list[str], how: _PreTokenizer) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in reader.value("tokenizer.ggml.merges") or []]
    bpe = models.BPE(vocab=_vocab(tokens), merges=merges, ignore_merges=how.ignore_merges)
    tokenizer = Tokenizer(bpe)
    steps = [pre.Digits(individual_digits=True)] if how.digits else []
    if how.regex is not None:
        steps.append(pre.Split(Regex(how.regex), behavior="isolated"))
    steps.append(pre.ByteLevel(add_prefix_space=False, use_regex=how.regex is None))
    tokenizer.pre_tokenizer = steps[0] if len(steps) == 1 else pre.Sequence(steps)
    if how.nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(reader: GGUFFile, tokens: list[str], types: list[int]
                       ) -> tuple[Tokenizer, list[str]]:
    """SentencePiece's BPE as transformers converts it: merges ranked by the score of the
    piece they make, bytes as <0xNN> pieces, an unknown token; a space before the text's start
    where ``add_space_prefix`` (llama.cpp's default: yes), spaces as ▁. Also the pieces' texts
    (the tokens', ▁ restored)."""
    scores: list[float] = reader.value("tokenizer.ggml.scores") or [0.0] * len(tokens)
    if len(scores) != len(tokens):
        raise ValueError(f"tokenizer.ggml.scores has {len(scores)} entries for "
                         f"{len(tokens)} tokens")
    # The converter writes user-defined pieces with their ▁ as spaces, and scores them -1000;
    # their SentencePiece score, which ranks their merges first, is 0.
    pieces = [text.replace(" ", "▁") if t == USER_DEFINED else text
              for text, t in zip(tokens, types)]
    vocab = _vocab(pieces)
    scored = {p: s if t == NORMAL else 0.0 for p, s, t in zip(pieces, scores, types)
              if t in (NORMAL, USER_DEFINED)}
    merges = generate_merges(vocab, scored)
    unk = reader.value("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True,
                                     fuse_unk=True, unk_token=None if unk is None
                                     else pieces[unk]))
    prefix = reader.value("tokenizer.ggml.add_space_prefix", True)
    # Spaces as ▁, and where add_space_prefix a ▁ before each run of text: at the start and
    # after each special or user-defined token, as llama.cpp's SentencePiece tokenizer adds its
    # space prefix (and SentencePiece itself, to a text whole). Not the Metaspace pre-tokenizer:
    # it adds none to a text that begins with a space, nor after a special token.
    spaces = normalizers.Replace(" ", "▁")
    tokenizer.normalizer = (normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if prefix
                            else spaces)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] * prefix)
    return tokenizer, pieces


def _vocab(tokens: list[str]) -> dict[str, int]:
    """Each text's id (the first, where a vocabulary repeats a text)."""
    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):
        vocab.setdefault(text, i)
    return vocab


def _added_tokens(reader: GGUFFile, kind: str, texts: list[str], types: list[int]
                  ) -> list[AddedToken]:
    """Control and user-defined tokens, matched whole in the text before it is normalized
    (Gemma's runs of ▁ then only where the text has ▁s: its spaces reach those pieces by
    merges, as in Hugging Face's tokenizer). Phi-3's and Phi-3.5's control tokens swallow the
    whitespace after them, as their Hugging Face tokenizers have them: llama.cpp sets that by
    the model's name, here also by its SentencePiece vocabulary in a phi3 file (names like
    "Phi 3.5 Mini" miss llama.cpp's)."""
    name = (reader.value("general.name") or "").lower()
    phi3 = (any(n in name for n in ("phi-3", "phi3"))
            or kind == "llama" and reader.value("general.architecture") == "phi3")
    kept = {"<unk>", "<s>", "<|endoftext|>"}
    return [AddedToken(text, special=t != USER_DEFINED, normalized=False,
                       rstrip=phi3 and (t == CONTROL or text == "</s>") and text not in kept)
            for text, t in zip(texts, types) if t in (CONTROL, USER_DEFINED, UNKNOWN)]


def _special_ids(reader: GGUFFile, vocabulary: int) -> dict[str, int]:
    """bos/eos/unk/pad ids from the metadata (those in the vocabulary)."""
    keys = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}
    ids = {role: reader.value(f"tokenizer.ggml.{key}_token_id") for role, key in keys.items()}
    return {role: i for role, i in ids.items() if isinstance(i, int) and 0 <= i < vocabulary}


# Text that exercises merges, spaces, digits, unicode and special tokens.
_TOKENIZER_PROBE = "Hello world!  12345 naïve 🤗\n\n<|im_start|>user\tdef f(x): return x**2<|im_end|>"
_BUILD = 3  # (1: transformers' GGUF conversion) a change of the builder leaves old caches unread


def load_gguf_tokenizer(path: str) -> transformers.PreTrainedTokenizerBase:
    """The file's tokenizer (``gguf_tokenizer``), kept on disk keyed by the file's identity and
    this builder's version: a large vocabulary's merges take seconds to rank."""
    path = os.path.abspath(path)
    st = os.stat(path)
    key = hashlib.sha256(
        f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{transformers.__version__}\0{_BUILD}".encode()
    ).hexdigest()[:32]
    root = os.path.join(
        os.environ.get("CONVEYOR_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "conveyor"),
        "tokenizers",
    )
    cached = os.path.join(root, key)
    if os.path.isdir(cached):
        return transformers.AutoTokenizer.from_pretrained(cached, local_files_only=True)
    try:
        tokenizer = gguf_tokenizer(read_gguf(path)) or transformers.AutoTokenizer.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001
        # corrupted metadata leads to whatever it leads to: an IndexError for an id past the
        # vocabulary, a KeyError, a tokenizers error for a merge of no tokens...
        raise ValueError(f"{path}: no tokenizer can be built from its metadata: "
                         f"{one_line(e)}") from e
    _store(tokenizer, root, cached)
    return tokenizer


def _store(tokenizer: transformers.PreTrainedTokenizerBase, root: str, cached: str) -> None:
    """Save into a temp dir and rename it into place, so readers never see half a cache.

    Only a round trip that behaves identically is kept; a cache that cannot be written, or a
    tokenizer that cannot encode the probe text, is skipped.
    """
    try:
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
    except OSError:
        return
    try:
        tokenizer.save_pretrained(tmp)
        reloaded = transformers.AutoTokenizer.from_pretrained(tmp, local_files_only=True)
        same = (
            reloaded(_TOKENIZER_PROBE).input_ids == tokenizer(_TOKENIZER_PROBE).input_ids
            and reloaded.chat_template == tokenizer.chat_template
            and reloaded.eos_token_id == tokenizer.eos_token_id
            and reloaded.bos_token_id == tokenizer.bos_token_id
        )
        if same:
            os.rename(tmp, cached)  # fails if another process got there first: keep theirs
    except Exception:  # noqa: BLE001  (an OSError, or a vocabulary that cannot spell the probe)
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
