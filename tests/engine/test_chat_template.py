"""--chat-template (vLLM's flag): a file or the template itself replaces the model's, and is
sandboxed as the model's own; --tokenizer: another model's tokenizer and template."""

from __future__ import annotations

import pytest
from tiny_models import TINY_VOCAB, make_tiny_checkpoint, make_tiny_model, write_gguf

from conveyor.llm import LLM

MINE = "{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny"))
    make_tiny_checkpoint(path, "llama")
    return path


def rendered(llm: LLM) -> list[int]:
    return llm.engine.inputs.apply_chat_template([{"role": "user", "content": "Hi"}], False)


@pytest.mark.parametrize("as_file", [False, True])
def test_the_given_template_replaces_the_models(folder, tmp_path, as_file):
    given = MINE
    if as_file:
        (tmp_path / "t.jinja").write_text(MINE)
        given = str(tmp_path / "t.jinja")
    llm = LLM(model=folder, dtype="float32", num_kv_blocks=16, chat_template=given)
    tokenizer = llm.engine.tokenizer
    assert rendered(llm) == tokenizer.encode("[user|Hi]", add_special_tokens=False)
    plain = LLM(model=folder, dtype="float32", num_kv_blocks=16)
    assert rendered(plain) != rendered(llm)


def test_a_value_that_is_neither_file_nor_template_is_refused(folder):
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        LLM(model=folder, dtype="float32", num_kv_blocks=16, chat_template="no/such.jinja")


def test_a_given_template_is_sandboxed_as_the_models(folder):
    with pytest.raises(ValueError, match="was refused: it tried to reach Python internals"):
        LLM(model=folder, dtype="float32", num_kv_blocks=16,
            chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")


def test_another_tokenizer_replaces_the_models(folder, tmp_path):
    from conveyor.model.loader import load_tokenizer

    # a GGUF whose tokenizer is a small vocabulary of its own, not the folder's
    other_path = write_gguf(str(tmp_path / "other.gguf"),
                            make_tiny_model("llama", vocab_size=len(TINY_VOCAB)), tokenizer=True)
    other = load_tokenizer(other_path)
    llm = LLM(model=folder, dtype="float32", num_kv_blocks=16, tokenizer=other_path)
    text = "the cat"
    assert llm.engine.tokenizer.encode(text) == other.encode(text)
    own = LLM(model=folder, dtype="float32", num_kv_blocks=16).engine.tokenizer
    assert own.encode(text) != other.encode(text)
