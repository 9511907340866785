"""A ``conveyor serve`` subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from conveyor.bench.stress import parse_metrics
from conveyor.process import free_port

SERVE = [sys.executable, "-m", "conveyor.cli", "serve"]
# Small enough for 2 CPU cores; the pool holds 512 x 16 tokens.
COMMON_ARGS = ["--num-kv-blocks", "512", "--max-model-len", "1024"]


class ServerProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        env = dict(os.environ, HF_HUB_OFFLINE="1", **(env or {}))
        self.proc = subprocess.Popen([*SERVE, "--port", str(self.port), *COMMON_ARGS, *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        with open(self._log.name) as f:
            return f.read()

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()[-4000:]}")

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self._log.name)
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
