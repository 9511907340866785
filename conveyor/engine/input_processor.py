"""Input processing: a prompt (text, token ids, or a chat) into checked token ids, before the
engine queues anything; every refusal is a ValueError naming the problem."""

from __future__ import annotations

import inspect
import logging
import os

import jinja2
import transformers

from conveyor.core.grammar import GrammarCompiler
from conveyor.sampling_params import ParamError, SamplingParams

logger = logging.getLogger("conveyor")

Prompt = str | dict | list[int]
# (developer: OpenAI's newer name for system instructions, rendered as system)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _check_text(text: str, what: str) -> None:
    """JSON can carry lone surrogates (\\ud800), which are not text: the tokenizer refuses them
    with a TypeError deep inside."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate at character "
                         f"{e.start}") from e


# apply_chat_template's own arguments and what it hands the template itself: not variables a
# request may set
_TEMPLATE_ARGUMENTS = (frozenset(inspect.signature(
    transformers.PreTrainedTokenizerBase.apply_chat_template).parameters) - {"kwargs"}) | {
    "messages", "tools", "documents", "add_generation_prompt"}


def render_chat(tokenizer, model_name: str, messages: list[dict],
                add_generation_prompt: bool = True, tools: list[dict] | None = None,
                template_kwargs: dict | None = None, continue_final_message: bool = False) -> str:
    """The chat template is code from the model file: transformers renders it in Jinja's
    immutable sandbox, which refuses any reach into Python internals (SecurityError).
    ``template_kwargs``: more variables for the template (``enable_thinking``...).
    ``continue_final_message``: the last message is left open (no end of turn after it), so
    the model continues its text (a prefilled answer), as vLLM and transformers do."""
    clash = sorted(set(template_kwargs or {}) & _TEMPLATE_ARGUMENTS)
    if clash:
        raise ParamError("chat_template_kwargs",
                         f"chat_template_kwargs may not set {', '.join(clash)}")
    if continue_final_message and add_generation_prompt:
        raise ParamError("continue_final_message", "continue_final_message needs "
                         "add_generation_prompt to be false: the last message is continued, "
                         "not answered")
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(template_kwargs or {}))
    except jinja2.exceptions.SecurityError as e:
        raise ValueError(f"the chat template of {model_name} was refused: it tried "
                         f"to reach Python internals ({e})") from e
    except (jinja2.exceptions.TemplateError, TypeError) as e:
        raise ValueError(f"the chat template of {model_name} failed on these "
                         f"messages: {e}") from e


def chat_template_from(given: str) -> str:
    """--chat-template's value: a file's text, or the template itself (vLLM reads both)."""
    if os.path.isfile(given):
        with open(given, encoding="utf-8") as f:
            return f.read()
    if "{{" in given or "{%" in given:
        return given
    raise ValueError(f"--chat-template: {given!r} is neither a file nor a Jinja template")


def check_chat_template(tokenizer, model_name: str) -> None:
    """Render the template once at load: one that reaches for Python internals on a plain
    conversation is refused before anything is served."""
    if not tokenizer.chat_template:
        return
    try:
        render_chat(tokenizer, model_name, [{"role": "user", "content": "Hello"}])
    except ValueError as e:
        if isinstance(e.__cause__, jinja2.exceptions.SecurityError):
            raise
        logger.warning("%s", e)  # a template may legitimately refuse a bare conversation


class InputProcessor:
    def __init__(self, tokenizer, model_name: str, vocab_size: int, max_model_len: int,
                 kv_capacity: int, grammars: GrammarCompiler) -> None:
        """kv_capacity: the tokens the KV pool can ever hold (what n samples must fit in)."""
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv_capacity = kv_capacity
        self.grammars = grammars

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            _check_text(prompt, "prompt")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids'")
            ids = prompt["prompt_token_ids"]
        else:
            ids = prompt
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        return None, list(ids)

    def check_request(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Tokenize and validate; raises ValueError naming the problem."""
        text, ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ParamError("stop_token_ids", f"stop_token_ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias or {}):
            raise ParamError("logit_bias", f"logit_bias token ids must be in [0, {vocab})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ParamError(  # (the server names its own length limit's field)
                "max_tokens", f"prompt ({len(ids)} tokens) plus max_tokens "
                f"({params.max_tokens}) exceeds max_model_len ({self.max_model_len})")
        capacity = self.kv_capacity
        if params.n > 1 and params.n * (len(ids) + params.max_tokens) > capacity:
            raise ParamError(
                "n", f"n ({params.n}) x (prompt ({len(ids)} tokens) + max_tokens "
                f"({params.max_tokens})) exceeds what the KV pool can ever hold ({capacity} "
                f"tokens)")
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)
        return text, ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None,
                            template_kwargs: dict | None = None,
                            continue_final_message: bool = False) -> list[int]:
        """``tools``: OpenAI's tool definitions, for a template that renders them;
        ``template_kwargs``: more variables for the template; ``continue_final_message``: see
        ``render_chat``."""
        if not messages:
            raise ValueError("messages must not be empty")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
                raise ValueError(f"each message needs a role in {CHAT_ROLES}, got {m!r}")
            if not isinstance(m.get("content"), str):
                raise ValueError(f"message content must be a string, got {m.get('content')!r}")
            _check_text(m["content"], "message content")
        if not self.tokenizer.chat_template:
            raise ValueError(f"model {self.model_name} has no chat template")
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        return self.tokenizer.encode(
            render_chat(self.tokenizer, self.model_name, messages, add_generation_prompt, tools,
                        template_kwargs, continue_final_message),
            add_special_tokens=False)
