"""A ``conveyor serve`` subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from conveyor.bench.stress import parse_metrics
from conveyor.process import ConveyorServer

# Small enough for 2 CPU cores; the pool holds 512 x 16 tokens.
COMMON_ARGS = ["--num-kv-blocks", "512", "--max-model-len", "1024"]


class ServerProcess(ConveyorServer):
    """``conveyor serve`` with the tests' pool, started at once, its log in a temporary file."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        log.close()
        super().__init__([*COMMON_ARGS, *args], log.name, startup_timeout=180.0)
        self._env = env or {}
        self.start()

    def environment(self) -> dict[str, str]:
        return dict(super().environment(), **self._env)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def terminate(self) -> int:
        """Stop it (SIGTERM, then SIGKILL after a minute); its exit status."""
        self.__exit__(None, None, None)
        os.unlink(self.log_path)
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        """Samples by name (labels summed over), e.g. ``conveyor:num_requests_running``."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=5.0).text
        return parse_metrics(text)


def child_pids(pid: int, cmdline_part: str = "") -> list[int]:
    """The process's children whose command line contains ``cmdline_part`` (read from /proc,
    so no procps is needed)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(c) for c in f.read().split()]
    found = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if cmdline_part.encode() in f.read():
                found.append(child)
    return found


@contextmanager
def running_server(*args: str, **kw) -> Iterator[ServerProcess]:
    """A ready server for the duration of the block (a module fixture's body)."""
    proc = ServerProcess(*args, **kw)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.terminate()
