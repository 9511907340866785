"""The server's settings (beside the engine's ``EngineConfig``): the ``conveyor serve`` flags."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from conveyor.server.reasoning import PARSERS
from conveyor.settings import check_choices, setting

API_KEY_ENV = "CONVEYOR_API_KEY"  # the key out of `ps`
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
METRICS_PREFIXES = ("conveyor", "vllm")  # (server/metrics.py)


@dataclass
class ServerConfig:
    host: str = setting("127.0.0.1", "the address to listen on")
    port: int = setting(8000, "the port to listen on")
    served_model_name: list[str] | None = setting(
        None, "model name(s) the API answers to (default: the model's own)")
    max_queue_len: int | None = setting(
        None, "answer 503 when this many requests wait (default: no limit)")
    max_concurrent_requests: int | None = setting(
        None, "answer 429 when this many HTTP requests are in flight (TGI's; default: no limit)")
    request_timeout: float | None = setting(
        None, "end a request that runs longer (408); a request's own `timeout` may be shorter "
              "(default: none)", metavar="SECONDS")
    max_body_bytes: int | None = setting(
        None, "answer 413 to a larger request body (default: 16 MiB)")
    api_key: str | None = setting(
        None, "require 'Authorization: Bearer KEY' on every route but /health and /metrics (or "
              "set CONVEYOR_API_KEY, which keeps it out of ps)")
    dashboard_public: bool = setting(
        False, "serve the dashboard (it shows prompts) without a key on a non-loopback host")
    reasoning_parser: str | None = setting(
        None, "a reasoning model's <think>...</think> goes to the chat message's "
              "reasoning_content (default: none, all is content)", choices=PARSERS)
    allowed_origins: list[str] | None = setting(
        None, "origins whose browser pages may call the API (CORS), given one by one or as "
              "vLLM's JSON list (default: every origin, as vLLM)", metavar="ORIGIN")
    allowed_methods: list[str] | None = setting(
        None, "HTTP methods those pages may use (default: all)", metavar="METHOD")
    allowed_headers: list[str] | None = setting(
        None, "request headers those pages may send (default: all)", metavar="HEADER")
    allow_credentials: bool = setting(False, "let those pages send cookies and credentials")
    max_logprobs: int = setting(
        20, "the most logprobs (completions), top_logprobs (chat) or prompt_logprobs a request "
            "may ask for (vLLM's)")
    enable_log_requests: bool = setting(
        False, "log a line for each finished request (tokens, queue, prefill and decode time)")
    uvicorn_log_level: str = setting("info", "uvicorn's log level (its access log is at info)",
                                     choices=UVICORN_LOG_LEVELS)
    metrics_prefix: str = setting(
        "conveyor", "/metrics names' prefix: vllm gives vLLM's names (vllm:num_requests_running, "
                    "...), so that its Grafana dashboards and routers read them",
        choices=METRICS_PREFIXES)
    replica_url: list[str] | None = setting(
        None, "route also to this running `conveyor serve` (another machine's, say) as a "
              "data-parallel replica; repeatable. --data-parallel-size counts every replica, "
              "local and by URL (as vLLM's counts every node's): the front starts the rest "
              "locally, none when it is 1. The front tokenizes with --model's tokenizer (no "
              "weights loaded); each URL must serve that model (its name checked at start)",
        metavar="http://HOST:PORT", repeat=True)

    def __post_init__(self) -> None:
        check_choices(self)
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            setattr(self, name, _json_or_items(name, getattr(self, name)))
        if self.max_logprobs < 0:
            raise ValueError(f"--max-logprobs must be >= 0, got {self.max_logprobs}")
        for name in ("max_queue_len", "max_concurrent_requests", "max_body_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"--request-timeout must be > 0, got {self.request_timeout}")
        if self.api_key == "":
            raise ValueError("--api-key must not be empty")
        if self.replica_url is not None:
            for url in self.replica_url:
                if not re.fullmatch(r"https?://[^/\s]+/?", url):
                    raise ValueError(f"--replica-url must be http://HOST:PORT, got {url!r}")
            self.replica_url = [url.rstrip("/") for url in self.replica_url]

    def resolved_api_key(self) -> str | None:
        """--api-key, else the API_KEY_ENV variable, else None (no key)."""
        return self.api_key or os.environ.get(API_KEY_ENV) or None


def _json_or_items(name: str, items: list[str] | None) -> list[str]:
    """A CORS list as given: items, or vLLM's one JSON list (``'["http://a"]'``); None: all."""
    if items is None:
        return ["*"]
    if len(items) == 1 and items[0].lstrip().startswith("["):
        try:
            items = json.loads(items[0])
        except json.JSONDecodeError as e:
            raise ValueError(f"--{name.replace('_', '-')}: not a JSON list: {e}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError(f"--{name.replace('_', '-')} must be a list of strings")
    return items
