"""The `conveyor generate` command: it generates, and bad input is one line on stderr, exit 2;
`conveyor env` says what this machine gets. What needs a process of its own (a generation, the
environment it reads, a missing compiler) runs the command; the rest calls its main()."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conveyor.cli import VLLM_ONLY_FLAGS, main

CLI = [sys.executable, "-m", "conveyor.cli"]


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture
def cli(capsys):
    """cli(*args) -> (exit code, stdout, stderr) of main(args), in this process."""

    def call(*args: str) -> tuple[int, str, str]:
        try:
            main(list(args))
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        out, err = capsys.readouterr()
        return code, out, err

    return call


def test_generate_prints_text_and_counts():
    res = run("generate", "--max-tokens", "6", "--ignore-eos", "--num-kv-blocks", "64",
              "The capital of France is")
    assert res.returncode == 0, res.stderr
    assert "[6 tokens, finish: length]" in res.stdout
    assert "1 requests, 6 tokens" in res.stdout


def test_bad_input_is_one_line_and_exit_2(cli):
    code, _, err = cli("generate", "--model", "/nowhere/model.gguf")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("conveyor: error:") and "/nowhere" in lines[0]
    code, _, err = cli("generate", "--num-kv-blocks", "4", "--max-model-len", "4096")
    assert code == 2 and "does not fit" in err


def test_env_says_the_tier_dtype_and_kernels():
    from conveyor.kernels import isa

    cpu = isa.current()
    res = run("env")
    assert res.returncode == 0, res.stderr
    assert f"cpu tier: {cpu.describe()}" in res.stdout
    assert f"dtype {'bfloat16' if cpu.native_bf16 else 'float32'} (auto:" in res.stdout
    # the default activations (auto): int8 on the K-quants at avx2 (repacked) and avx512
    numerics = {"avx2": "int8 activations on the K-quants (auto), the K-quants repacked in "
                        "groups of 8 rows, ",
                "avx512": "int8 activations on the K-quants (auto), "}.get(cpu.tier, "")
    assert f"kernels: C kernels, {numerics}CPU tier {cpu.tier}" in res.stdout
    assert "batch invariance: off unless --batch-invariant\n" in res.stdout
    forced = subprocess.run([*CLI, "env"], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, HF_HUB_OFFLINE="1", CONVEYOR_CPU_ISA="generic"))
    assert "cpu tier: generic (forced by CONVEYOR_CPU_ISA=generic" in forced.stdout
    assert "dtype float32 (auto: the CPU has no bfloat16 arithmetic)" in forced.stdout
    off = subprocess.run([*CLI, "env"], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, HF_HUB_OFFLINE="1", CONVEYOR_CPU_KERNELS="off"))
    assert "kernels: plain PyTorch (CONVEYOR_CPU_KERNELS=off)" in off.stdout
    assert "--batch-invariant (which needs the CPU kernels: not here)" in off.stdout


def test_without_a_working_compiler_the_pytorch_path_runs(tmp_path):
    """No compiler (or a build error) is one warning, then plain PyTorch: never a crash."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", CC=str(tmp_path / "no-such-cc"),
               XDG_CACHE_HOME=str(tmp_path))
    res = subprocess.run([*CLI, "generate", "--max-tokens", "4", "--ignore-eos",
                          "--num-kv-blocks", "64", "The capital of France is"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    assert "[4 tokens, finish: length]" in res.stdout
    warnings = [line for line in res.stderr.splitlines() if "CPU kernels" in line]
    assert len(warnings) == 1 and "running plain PyTorch" in warnings[0]


def test_version_and_errors_under_the_subcommand(cli):
    code, out, _ = cli("--version")
    assert code == 0 and out.startswith("conveyor ")
    code, _, err = cli("serve", "--no-such-flag")
    assert code == 2 and "unrecognized arguments: --no-such-flag" in err
    assert "usage: conveyor serve" in err
    code, _, err = cli("bench", "serve", "--no-such-flag")
    assert code == 2 and "usage: conveyor bench serve" in err


def test_serve_takes_the_model_as_its_first_argument(tmp_path, cli):
    """As vLLM's `serve MODEL`; the flag stays, and the two may not disagree."""
    from conveyor.cli import build_parser

    args = build_parser().parse_args(["serve", "some.gguf", "--port", "9"])
    assert args.model_tag == "some.gguf" and args.model is None
    code, _, err = cli("serve", str(tmp_path / "a.gguf"), "--model", str(tmp_path / "b.gguf"))
    assert code == 2 and "the model is given twice" in err
    code, _, err = cli("serve", str(tmp_path / "missing.gguf"))
    assert code == 2 and "missing.gguf" in err.splitlines()[-1]


def test_bench_without_a_server_is_one_line(cli):
    """No server (or a --base-url with the client's /v1, accepted): one line, exit 2."""
    from conveyor.bench.serve import server_url

    assert server_url("http://h:1/v1/") == server_url("http://h:1/") == "http://h:1"
    code, _, err = cli("bench", "serve", "--base-url", "http://127.0.0.1:9/v1",
                       "--num-prompts", "1")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("conveyor: error: no OpenAI-compatible server answers at "
                               "http://127.0.0.1:9/v1/models")
    # vLLM's --host and --port say the same
    code, _, err = cli("bench", "serve", "--host", "127.0.0.1", "--port", "9", "--num-prompts", "1")
    assert code == 2 and "answers at http://127.0.0.1:9/v1/models" in err


def test_serve_accepts_vllm_only_flags_with_a_line_each(tmp_path, cli):
    """A vLLM launch line's flags for what Conveyor does its own way start it unchanged (here
    up to the missing model), each said on stderr; a flag Conveyor does not know is still an
    error naming it."""
    missing = str(tmp_path / "missing.gguf")
    code, _, err = cli("serve", missing, "--trust-remote-code", "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes", "--disable-log-requests",
                       "--tool-call-parser=llama3_json")
    lines = err.strip().splitlines()
    assert code == 2 and "missing.gguf" in lines[-1]  # got as far as loading the model
    for flag in ("--trust-remote-code", "--enable-auto-tool-choice", "--tool-call-parser",
                 "--disable-log-requests"):
        assert any(line.startswith(f"conveyor: {flag} (vLLM's) accepted: ") for line in lines)
    assert not any("hermes" in line or "llama3_json" in line for line in lines)
    code, _, err = cli("serve", missing, "--trust-remote-code", "--no-such-vllm-flag")
    assert code == 2 and "unrecognized arguments: --no-such-vllm-flag" in err
    code, out, _ = cli("serve", "--help")
    listed = "".join(out.split())  # (help wraps its lines, at spaces and hyphens)
    assert code == 0 and "vLLM'sflags,accepted" in listed
    for flag, (_, line) in VLLM_ONLY_FLAGS.items():
        assert flag in listed and "".join(line.split()) in listed, flag


def test_cors_lists_take_vllms_json_or_items():
    from conveyor.server.config import ServerConfig

    assert ServerConfig().allowed_origins == ["*"]
    assert ServerConfig(allowed_origins=['["http://a.test", "http://b.test"]']).allowed_origins \
        == ["http://a.test", "http://b.test"]
    assert ServerConfig(allowed_methods=["GET", "POST"]).allowed_methods == ["GET", "POST"]
    with pytest.raises(ValueError, match="--allowed-headers: not a JSON list"):
        ServerConfig(allowed_headers=["[oops"])


def test_help_and_version_import_no_torch():
    """The CLI's parsers (every flag's help and default) load without torch, so `--help` and
    `--version` answer at once (torch alone takes seconds to import)."""
    probe = ("import sys; from conveyor.cli import build_parser; build_parser(); "
             "import conveyor; conveyor.__version__; print('torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr


def test_vllm_runner_is_conveyors_task():
    from conveyor.cli import _without_vllm_only_flags, build_parser

    argv = _without_vllm_only_flags(["m.gguf", "--runner", "pooling", "--port", "9"])
    assert argv == ["m.gguf", "--task", "embed", "--port", "9"]
    assert build_parser().parse_args(["serve", *argv]).task == "embed"
    assert _without_vllm_only_flags(["--runner=generate"]) == ["--task", "generate"]
    assert _without_vllm_only_flags(["--runner", "auto"]) == []
    assert _without_vllm_only_flags(["--runner", "draft"]) == ["--runner", "draft"]  # refused


def test_every_flag_has_help_and_shows_its_default():
    import argparse

    from conveyor.cli import build_parser

    def flags(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    yield from flags(child, [*path, name])
            elif action.option_strings and not isinstance(
                    action, (argparse._HelpAction, argparse._VersionAction)):
                yield " ".join(path), parser, action

    seen = 0
    for command, parser, action in flags(build_parser(), []):
        seen += 1
        assert action.help, f"conveyor {command} {action.option_strings[0]} has no help"
        if action.default not in (None, False, argparse.SUPPRESS):
            shown = parser.formatter_class("x")._get_help_string(action) \
                if parser.formatter_class is not argparse.HelpFormatter else action.help
            assert "default" in shown, f"conveyor {command} {action.option_strings[0]}"
    assert seen > 200
