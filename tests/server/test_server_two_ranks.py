"""The server on 2 tensor-parallel ranks: the server tests that batch, stream and share prefixes
run again against it, and a dying worker takes it down."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

# The server tests that run again here against a 2-rank server (the `server` fixture below).
from test_server import (  # noqa: F401
    test_32_concurrent_streams_batch_together,
    test_chat_streamed_equals_non_streamed,
    test_completion_streamed_equals_non_streamed,
    test_disconnect_frees_pages,
    test_n2_and_several_prompts,
    test_repeated_prefix_is_served_from_the_cache,
)

from server_process import child_pids, running_server


# -- the server on 2 ranks ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    with running_server("--tensor-parallel-size", "2") as proc:
        yield proc


def test_the_server_says_it_runs_two_ranks(server):
    version = httpx.get(f"{server.base_url}/version").json()
    assert version["tensor_parallel_size"] == 2


def test_a_dead_worker_takes_the_server_down(server):
    """(Last: it ends the module's server.)"""
    (worker,) = child_pids(server.proc.pid, "spawn_main")
    os.kill(worker, signal.SIGKILL)
    assert server.proc.wait(30) == 1, server.log()[-3000:]  # down, not hung
    assert "tensor-parallel worker conveyor-tp1 exited with -9" in server.log()
