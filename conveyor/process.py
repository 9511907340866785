"""Start and stop a Conveyor server for one benchmark configuration."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server in a child process on a free loopback port; a context manager that waits for
    /health. Subclasses say how to start it."""

    def __init__(self, log_path: str | None, startup_timeout: float = 600.0) -> None:
        """log_path None: the server writes to this process's stdout and stderr."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        return dict(os.environ, HF_HUB_OFFLINE="1")

    def __enter__(self) -> "ServerProcess":
        self.start()
        self.wait_ready()
        return self

    def start(self) -> None:
        self._log = None if self.log_path is None else open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command(), stdout=self._log, env=self.environment(),
                                     stderr=None if self._log is None else subprocess.STDOUT)

    def wait_ready(self) -> None:
        """Until /health answers 200; raises if the server exits or the time runs out."""
        cmd = self.proc.args
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = "(its log is above)"
                if self._log is not None:
                    self._log.close()
                    with open(self.log_path) as f:
                        tail = f.read()[-2000:]
                raise RuntimeError(f"{' '.join(cmd)} exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(f"{cmd[0]} did not become healthy in {self.startup_timeout} s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()

    def warm_up(self, model: str) -> None:
        """One short request, so first-call costs stay out of the measurement."""
        httpx.post(self.base_url + "/v1/completions", timeout=300,
                   json={"model": model, "prompt": "Hello", "max_tokens": 4}).raise_for_status()


class ConveyorServer(ServerProcess):
    """``conveyor serve`` with the given flags."""

    def __init__(self, flags: list[str], log_path: str, startup_timeout: float = 600.0) -> None:
        super().__init__(log_path, startup_timeout)
        self.flags = flags

    def command(self) -> list[str]:
        return [sys.executable, "-m", "conveyor.cli", "serve", "--port", str(self.port),
                *self.flags]

    def reset_prefix_cache(self) -> None:
        """Forget the cached pages (the server must be idle), so a run starts cold."""
        httpx.post(self.base_url + "/reset_prefix_cache", timeout=60).raise_for_status()

    def steps(self, since: int = 0) -> dict:
        """The server's per-step record from step ``since`` on."""
        resp = httpx.get(f"{self.base_url}/v1/engine/steps", params={"since": since}, timeout=60)
        resp.raise_for_status()
        return resp.json()
