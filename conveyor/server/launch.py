"""``conveyor serve``: load the engine, start its thread, serve HTTP until told to stop.

On SIGTERM or SIGINT uvicorn stops accepting, lets running requests finish (at most
``GRACEFUL_SHUTDOWN_S``), then the engine thread stops and the process exits 0. If the engine
thread dies, every client gets an error, /health answers 503 and the process exits 1, for a
supervisor to restart it.
"""

from __future__ import annotations

import logging
import signal

import uvicorn

from conveyor.config import EngineConfig
from conveyor.engine.engine import LLMEngine
from conveyor.logs import configure_logging
from conveyor.server.access import DEFAULT_MAX_BODY_BYTES, is_loopback, with_cors
from conveyor.server.app import build_app
from conveyor.server.config import API_KEY_ENV, ServerConfig
from conveyor.server.engine_thread import EngineThread
from conveyor.server.metrics import ServerMetrics
from conveyor.server.reasoning import CLOSE, think_tag_ids
from conveyor.server.state import ServerState

GRACEFUL_SHUTDOWN_S = 30

logger = logging.getLogger("conveyor.server")


def _ready_message(state: ServerState, settings: ServerConfig) -> str:
    engine = state.engine
    kv = engine.scheduler.kv
    cfg = engine.config
    return (f"ready on http://{settings.host}:{settings.port}: model {state.model_name} "
            f"({engine.model_path}), dtype {str(engine.dtype).removeprefix('torch.')} "
            f"({engine.dtype_reason}), {engine.runner.kernel_path}, "
            f"{kv.pool.num_blocks} KV pages x {kv.block_size} tokens = "
            f"{kv.num_tokens_capacity} tokens ({engine.kv_cache_bytes / 2**20:.0f} MiB of "
            f"{str(engine.kv_dtype).removeprefix('torch.')}), "
            f"KV layout {cfg.kv_layout}, policy {cfg.policy}, scheduling "
            f"{cfg.scheduling_policy}, prefix caching "
            f"{'on' if cfg.enable_prefix_caching else 'off'}, batch invariance "
            f"{'on' if cfg.batch_invariant else 'off'}, max_num_seqs {cfg.max_num_seqs}, "
            f"max_num_batched_tokens {cfg.max_num_batched_tokens}, "
            f"max_model_len {engine.max_model_len}, max_queue_len {settings.max_queue_len}, "
            f"max_concurrent_requests {settings.max_concurrent_requests}, request_timeout "
            f"{settings.request_timeout}")


def _access_message(settings: ServerConfig, api_key: str | None, dashboard_open: bool) -> str:
    key = (f"API key required on every route but /health, /metrics and the dashboard's page (from "
           f"{'--api-key' if settings.api_key else API_KEY_ENV})" if api_key else "no API key")
    if api_key:
        page = "the dashboard's feeds need the key (open it as /dashboard#key=...)"
    elif dashboard_open:
        page = ("the dashboard is public (--dashboard-public)" if settings.dashboard_public
                else "the dashboard is served (loopback host)")
    else:
        page = ("the dashboard is off: it shows prompt text, and this host is not loopback "
                "(give --api-key or --dashboard-public)")
    return f"{key}; {page}: http://{settings.host}:{settings.port}/dashboard"


def run_server(config: EngineConfig, settings: ServerConfig) -> None:
    if config.data_parallel_size > 1 or settings.replica_url:
        from conveyor.server.data_parallel.front import run_front

        return run_front(config, settings)
    configure_logging()
    api_key = settings.resolved_api_key()
    dashboard_open = settings.dashboard_public or is_loopback(settings.host)
    server: uvicorn.Server | None = None

    def on_death() -> None:  # from the engine thread: stop serving, exit 1 below
        if server is not None:
            server.should_exit = True

    engine_thread = EngineThread(lambda: LLMEngine(config), settings.max_queue_len,
                                 settings.max_concurrent_requests, on_death,
                                 settings.enable_log_requests)
    engine = engine_thread.engine
    names = settings.served_model_name or [engine.model_name]
    aliases = () if settings.served_model_name else tuple(
        {config.model or engine.model_path, engine.model_path} - set(names))
    state = ServerState(engine, engine_thread, ServerMetrics(names[0], engine.max_model_len,
                                                            settings.metrics_prefix), names,
                        settings.request_timeout, settings.reasoning_parser, aliases,
                        settings.max_logprobs)
    if settings.reasoning_parser and think_tag_ids(engine.tokenizer)[1] is None:
        logger.warning("--reasoning-parser %s: %s is no token of this model's vocabulary, so "
                       "a constraint holds over the whole output, thinking included",
                       settings.reasoning_parser, CLOSE)
    app = build_app(state, f"{_ready_message(state, settings)}; "
                           f"{_access_message(settings, api_key, dashboard_open)}",
                    api_key, dashboard_open, settings.max_body_bytes or DEFAULT_MAX_BODY_BYTES)
    server = uvicorn.Server(uvicorn.Config(with_cors(app, settings), host=settings.host,
                                           port=settings.port,
                                           log_level=settings.uvicorn_log_level,
                                           timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    # uvicorn re-raises the signal it drained on; absorbing that re-raise makes the exit 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    state.engine_thread.start(state.metrics)
    server.run()  # the app's lifespan stops the engine thread on the way out
    if engine_thread.death is not None:
        logger.critical("exiting 1: %s", engine_thread.death)
        raise SystemExit(1)
