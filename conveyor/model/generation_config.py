"""A model's own sampling defaults, as vLLM's ``--generation-config auto`` applies them to the
requests that leave them unset: a folder's ``generation_config.json`` (the values that differ
from transformers' defaults, as its ``to_diff_dict`` gives them) or a GGUF's
``general.sampling.*`` keys (llama.cpp's converter writes them from the same file)."""

from __future__ import annotations

import json
import os

GENERATION_CONFIGS = ("auto", "vllm")  # or a folder holding generation_config.json
# generation_config.json's name -> SamplingParams' name, and transformers' default for it
_FOLDER_KEYS = {"temperature": ("temperature", 1.0), "top_p": ("top_p", 1.0),
                "top_k": ("top_k", 50), "min_p": ("min_p", None),
                "repetition_penalty": ("repetition_penalty", 1.0)}
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}


def sampling_defaults(source: str, model_path: str) -> dict[str, float | int]:
    """SamplingParams keywords the model sets: ``source`` auto (the model's own), vllm (none:
    the API's defaults), or a folder."""
    if source == "vllm":
        return {}
    folder = model_path if source == "auto" else source
    if source != "auto" and not os.path.isfile(os.path.join(folder, "generation_config.json")):
        raise ValueError(f"--generation-config: no generation_config.json in {source!r} "
                         f"(auto: the model's own; vllm: none)")
    if os.path.isfile(folder) and folder.endswith(".gguf"):
        from conveyor.model.gguf_file import read_gguf

        reader = read_gguf(folder)
        return {name: reader.value(key) for key, name in _GGUF_KEYS.items()
                if reader.value(key) is not None}
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        given = json.load(f)
    return {name: given[key] for key, (name, default) in _FOLDER_KEYS.items()
            if given.get(key) is not None and given[key] != default}
