"""Hub repo ids as vLLM takes them (conveyor/model/hub.py), from a local cache laid out as
huggingface_hub writes it (models--ORG--NAME/{refs,snapshots}); offline, as the tests run."""

from __future__ import annotations

import os

import pytest
from huggingface_hub import constants
from tiny_models import make_tiny_checkpoint

from conveyor.llm import LLM
from conveyor.model.hub import resolve_model
from conveyor.model.loader import default_model_path


def cached_repo(cache, repo: str, files: dict[str, str], revision: str = "main",
                commit: str = "0" * 40) -> str:
    """A snapshot of ``repo`` at ``commit`` named by ``revision``: each file a link to
    ``files[name]`` (the cache's own snapshots link into its blobs)."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / revision).write_text(commit)
    for name, source in files.items():
        os.symlink(source, snapshot / name)
    return str(snapshot)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_a_cached_folder_repo_loads_by_its_id_and_is_named_by_it(cache, tmp_path):
    checkpoint = str(tmp_path / "tiny")
    make_tiny_checkpoint(checkpoint, "llama")
    snapshot = cached_repo(cache, "org/tiny", {f: os.path.join(checkpoint, f)
                                               for f in os.listdir(checkpoint)})
    assert resolve_model("org/tiny") == snapshot
    llm = LLM(model="org/tiny", dtype="float32", num_kv_blocks=16)
    assert llm.engine.model_name == "org/tiny" and llm.engine.model_path == snapshot


def test_a_revision_picks_its_snapshot(cache):
    gguf = default_model_path()
    cached_repo(cache, "org/g", {"m.gguf": gguf})
    tagged = cached_repo(cache, "org/g", {"m.gguf": gguf}, "v2", "1" * 40)
    assert resolve_model("org/g", revision="v2") == os.path.join(tagged, "m.gguf")


def test_a_gguf_repo_gives_its_one_file_or_the_one_picked(cache):
    gguf = default_model_path()
    one = cached_repo(cache, "org/one", {"model.Q4_1.gguf": gguf})
    assert resolve_model("org/one") == os.path.join(one, "model.Q4_1.gguf")
    many = cached_repo(cache, "org/many", {"a.gguf": gguf, "b.gguf": gguf})
    assert resolve_model("org/many:b.gguf") == os.path.join(many, "b.gguf")
    with pytest.raises(ValueError, match=r"pick one as org/many:FILE.gguf \(a.gguf, b.gguf\)"):
        resolve_model("org/many")


def test_an_id_not_cached_offline_says_how_to_fetch_it(cache):
    with pytest.raises(FileNotFoundError, match="org/missing is not in the local Hugging Face "
                                                "cache .* HF_HUB_OFFLINE is set: fetch it with "
                                                "`hf download org/missing`"):
        resolve_model("org/missing")
    with pytest.raises(FileNotFoundError, match="`hf download org/missing x.gguf`"):
        resolve_model("org/missing:x.gguf")


def test_paths_pass_through_and_take_no_revision(tmp_path):
    assert resolve_model(None) is None
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model("no-slash-name") == "no-slash-name"  # the loader says it is missing
    with pytest.raises(ValueError, match="--revision is for a Hugging Face repo id"):
        resolve_model(str(tmp_path), revision="main")
