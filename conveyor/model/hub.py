"""Model ids as vLLM takes them: a Hugging Face repo id (``org/name``) is found in the local
Hub cache (``huggingface_hub``'s layout under ``HF_HOME`` or ``HF_HUB_CACHE``) or downloaded
through ``huggingface_hub`` when the network allows it; ``org/name:file.gguf`` picks one GGUF
of a repo. Offline (``HF_HUB_OFFLINE=1``) and not cached is one line that says how to fetch it.
"""

from __future__ import annotations

import os
import re

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# what a folder's model takes from its repo (a repo's GGUFs are many and large: one is picked)
FOLDER_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def resolve_model(model: str | None, revision: str | None = None) -> str | None:
    """A local path for ``model``: itself if it exists (or is no repo id; None, the default
    model, stays None), else the repo's folder (or its picked GGUF) in the Hub cache,
    downloaded if it is not there yet."""
    if model is None:
        return None
    repo, _, filename = model.partition(":")
    if os.path.exists(model) or not REPO_ID.fullmatch(repo):
        if revision is not None:
            raise ValueError(f"--revision is for a Hugging Face repo id; {model} is a path")
        return model
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = constants.HF_HUB_OFFLINE
    try:
        if filename:
            return hf_hub_download(repo, filename, revision=revision, local_files_only=offline)
        folder = snapshot_download(repo, revision=revision, allow_patterns=FOLDER_FILES,
                                   local_files_only=offline)
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
        raise FileNotFoundError(
            f"{model}{'@' + revision if revision else ''} is not in the local Hugging Face "
            f"cache ({constants.HF_HUB_CACHE}) and {why}: fetch it with `hf download {repo}"
            f"{' ' + filename if filename else ''}`, or give a path") from None
    if not os.path.isfile(os.path.join(folder, "config.json")):
        ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return os.path.join(folder, ggufs[0])
        raise ValueError(f"{repo} has no config.json" + (
            f" and several GGUFs: pick one as {repo}:FILE.gguf ({', '.join(ggufs)})" if ggufs
            else f": for a GGUF repo, pick a file as {repo}:FILE.gguf"))
    return folder
