"""The `conveyor generate` command: it generates, and bad input is one line on stderr, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

CLI = [sys.executable, "-m", "conveyor.cli"]


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, env=env)


def test_generate_prints_text_and_counts():
    res = run("generate", "--max-tokens", "6", "--ignore-eos", "--num-kv-blocks", "64",
              "The capital of France is")
    assert res.returncode == 0, res.stderr
    assert "[6 tokens, finish: length]" in res.stdout
    assert "1 requests, 6 tokens" in res.stdout


def test_bad_input_is_one_line_and_exit_2():
    res = run("generate", "--model", "/nowhere/model.gguf")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("conveyor: error:") and "/nowhere" in lines[0]
    res = run("generate", "--num-kv-blocks", "4", "--max-model-len", "4096")
    assert res.returncode == 2 and "does not fit" in res.stderr
