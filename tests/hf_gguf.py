"""transformers' own model and tokenizer of a GGUF, the reference the equivalence, logprob and
embedding tests compare with. Its GGUF loader reads the file's vocabulary through gguf-py for
tens of seconds a load, so the first load is saved (``save_pretrained``) under the test data
folder, keyed by the file's digest and transformers' version, and later ones read that."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile

import torch
import transformers

from converted_ggufs import DATA


def _folder(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return str(DATA / "hf-of-gguf" / f"{digest.hexdigest()[:16]}-{transformers.__version__}")


@functools.lru_cache(maxsize=None)
def hf_of_gguf(path: str, auto=transformers.AutoModelForCausalLM
               ) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """(model in float32, eval mode; tokenizer) as ``auto.from_pretrained(..., gguf_file=)``
    gives them; once a process (the equivalence reference takes the tokenizer after the
    model)."""
    folder = _folder(path)
    if not os.path.isdir(folder):
        directory, name = os.path.dirname(path), os.path.basename(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                                  dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        staging = tempfile.mkdtemp(dir=os.path.dirname(folder))
        # (its weights are plain float32 tensors; the mark of their GGUF origin only keeps
        # save_pretrained from writing them)
        model.hf_quantizer = model.config.quantization_config = None
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:  # (another test process may have saved it meanwhile: the same files)
            os.rename(staging, folder)
        except OSError:
            shutil.rmtree(staging)
    return (auto.from_pretrained(folder, dtype=torch.float32).eval(),
            transformers.AutoTokenizer.from_pretrained(folder))
