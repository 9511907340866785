"""``conveyor serve``: load the engine, start its thread, serve HTTP until told to stop.

On SIGTERM or SIGINT uvicorn stops accepting, lets running requests finish (at most
``GRACEFUL_SHUTDOWN_S``), then the engine thread stops and the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal

import uvicorn

from conveyor.cli import engine_config
from conveyor.engine.engine import LLMEngine
from conveyor.server.app import build_app
from conveyor.server.engine_thread import EngineThread
from conveyor.server.metrics import ServerMetrics
from conveyor.server.serving import ServerState

GRACEFUL_SHUTDOWN_S = 30


def _ready_message(state: ServerState, args: argparse.Namespace) -> str:
    engine = state.engine
    kv = engine.scheduler.kv
    cfg = engine.config
    return (f"ready on http://{args.host}:{args.port}: model {state.model_name} "
            f"({engine.model_path}), dtype {str(engine.dtype).removeprefix('torch.')} "
            f"({engine.dtype_reason}), {engine.runner.kernel_path}, "
            f"{kv.pool.num_blocks} KV pages x {kv.block_size} tokens = "
            f"{kv.num_tokens_capacity} tokens ({engine.kv_cache_bytes / 2**20:.0f} MiB), "
            f"KV layout {cfg.kv_layout}, policy {cfg.policy}, scheduling "
            f"{cfg.scheduling_policy}, prefix caching "
            f"{'on' if cfg.enable_prefix_caching else 'off'}, max_num_seqs {cfg.max_num_seqs}, "
            f"max_num_batched_tokens {cfg.max_num_batched_tokens}, "
            f"max_model_len {engine.max_model_len}, max_queue_len {args.max_queue_len}; "
            f"live view: http://{args.host}:{args.port}/dashboard")


def serve(args: argparse.Namespace) -> None:
    if args.max_queue_len is not None and args.max_queue_len < 1:
        raise ValueError(f"--max-queue-len must be >= 1, got {args.max_queue_len}")
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = engine_config(args)
    engine_thread = EngineThread(lambda: LLMEngine(config), args.max_queue_len)
    engine = engine_thread.engine
    names = args.served_model_name or [engine.model_name]
    state = ServerState(engine, engine_thread, ServerMetrics(names[0]), names)
    app = build_app(state, _ready_message(state, args))
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level="info",
                                           timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    # uvicorn re-raises the signal it drained on; absorbing that re-raise makes the exit 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    state.engine_thread.start(state.metrics)
    server.run()  # the app's lifespan stops the engine thread on the way out
