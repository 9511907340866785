"""The chat template is code from the model file: it renders in Jinja's sandbox, and a template
that reaches for Python internals is refused with one clear line, at load or per request."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
from tiny_models import make_tiny_checkpoint

from cli_output import error_lines
from conveyor.llm import LLM

ESCAPE = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
# harmless on a plain conversation, reaches for internals when a message asks it to
SLEEPER = ("{% for m in messages %}{% if m.content == 'open' %}{{ cycler.__init__.__globals__ }}"
           "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}")


def with_template(folder: str, template: str) -> str:
    make_tiny_checkpoint(folder, "llama")
    for path in glob.glob(os.path.join(folder, "chat_template.jinja")):
        os.unlink(path)
    config_path = os.path.join(folder, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["chat_template"] = template
    with open(config_path, "w") as f:
        json.dump(config, f)
    return folder


def test_a_template_that_escapes_the_sandbox_is_refused_at_load(tmp_path):
    folder = with_template(str(tmp_path / "escape"), ESCAPE)
    with pytest.raises(ValueError, match="chat template .* was refused: it tried to reach "
                                         "Python internals"):
        LLM(model=folder, dtype="float32", num_kv_blocks=16)
    done = subprocess.run([sys.executable, "-m", "conveyor.cli", "generate", "--model", folder,
                           "--max-tokens", "1", "--num-kv-blocks", "16"],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 2
    lines = error_lines(done.stderr)
    assert len(lines) == 1 and "was refused" in lines[0], done.stderr


def test_a_template_that_tries_on_one_request_fails_that_request_only(tmp_path):
    llm = LLM(model=with_template(str(tmp_path / "sleeper"), SLEEPER), dtype="float32",
              num_kv_blocks=16)
    with pytest.raises(ValueError, match="Python internals"):
        llm.engine.inputs.apply_chat_template([{"role": "user", "content": "open"}])
    ids = llm.engine.inputs.apply_chat_template([{"role": "user", "content": "hello"}])
    assert llm.get_tokenizer().decode(ids).startswith("user: hello")
