"""Shared fixtures: the default GGUF model and tiny random HF checkpoints."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import openai
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests must never reach the Hugging Face hub
# `make test` runs a pytest-xdist worker per core (docs/testing.md): each worker, and every
# server or rank it starts, computes on one thread, or the workers' thread teams would fight
# over the cores. (Before torch is imported, which reads it once.)
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
sys.path.insert(0, os.path.dirname(__file__))  # lets test files `from tiny_models import ...`

from tiny_models import make_tiny_checkpoint  # noqa: E402

from conveyor.model.loader import LoadedModel, default_model_path, load_model  # noqa: E402


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """The default SmolLM2 GGUF, loaded once per session (a few seconds)."""
    return load_model(None)


@pytest.fixture
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """Factory: tiny_checkpoint(arch, **config_overrides) -> folder path of a fresh tiny checkpoint."""

    def build(arch: str, **overrides: Any) -> str:
        return make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **overrides)

    return build


@pytest.fixture(scope="session")
def default_server():
    """One server on the default model with the default flags, for every test module whose
    requests need nothing else (each takes it as its ``server``)."""
    from server_process import running_server

    with running_server() as proc:
        yield proc


# A module that defines a ``server`` fixture (a running ServerProcess) gets these two.
@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id
