"""A tensor-parallel rank above 0: its shard of the model, then rank 0's steps until told to
stop (``tensor_parallel`` has the group and its collectives)."""

from __future__ import annotations

import os

import torch

from conveyor.config import EngineConfig
from conveyor.logs import configure_logging
from conveyor.model.hub import resolve_model
from conveyor.model.loader import load_model
from conveyor.worker.runner import ModelRunner
from conveyor.worker.tensor_parallel import TensorParallel, rank_device, set_threads


def run_worker(config: EngineConfig, rank: int | None = None, init_method: str | None = None,
               threads: int | None = None) -> None:
    """A rank above 0: its shard of the model, then every step's plan until told to stop.
    Without arguments, the rank and group come from torchrun's environment."""
    configure_logging()
    device = config.torch_device()
    if rank is None:
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        set_threads(config, int(os.environ.get("LOCAL_WORLD_SIZE",
                                                config.tensor_parallel_size)))
        init_method = config.distributed_init_method or "env://"
    else:
        local_rank = rank
        torch.set_num_threads(threads)
    group = TensorParallel(rank, config.tensor_parallel_size, init_method,
                           rank_device(device, local_rank))
    loaded = load_model(resolve_model(config.model, config.revision), config.quantization)
    setup = group.receive()
    try:
        runner = ModelRunner(loaded.config, loaded.weights, quantized=loaded.quantized,
                             device=group.device, seed=config.seed, block_size=config.block_size,
                             tensor_parallel=group, **setup)
    except ValueError:  # a model the shards cannot take: rank 0 says why, from the same plan
        raise SystemExit(1) from None
    del loaded
    group.barrier()  # ready: rank 0 waits for every rank
    while (plan := group.receive()) is not None:
        runner.follow(plan)
    group.close()
