"""Tensor-parallel ranks on torch.distributed (gloo on CPUs, NCCL on CUDA GPUs).

Rank 0 is the engine: it runs the scheduler and block pool, sends each step's plan to the other
ranks and samples. The others hold their shard of the weights and KV pages (the same page ids)
and run every plan through their layers, meeting rank 0 at each all-reduce. By default rank 0
starts them as local processes; under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` set) every rank runs the same command and those above 0 become workers.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401  (before any group: see TensorParallel)
import torch.multiprocessing as mp

from conveyor.config import EngineConfig
from conveyor.process import free_port

logger = logging.getLogger("conveyor")

# A collective waits this long for a rank that is alive but stuck (a dead one is seen at once:
# its sockets close).
TIMEOUT = timedelta(seconds=300)


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class TensorParallel:
    """This process's rank in the tensor-parallel group and the group's collectives, with
    counts of the all-reduces (the figures the step timings and tests read)."""

    def __init__(self, rank: int, world_size: int, init_method: str, device: torch.device,
                 workers: list[mp.Process] | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.device = device
        self.workers = workers or []
        self.num_all_reduces = 0
        self.all_reduce_bytes = 0
        self.all_reduce_seconds = 0.0
        self.communication_seconds = 0.0  # every collective: all-reduces, logits, plans
        # torch.distributed.nn.functional binds the group that exists when it is first imported
        # as its functions' default (transformers' loader imports it); bound to ours, it kept
        # the group and its gloo threads alive past close, and a thread still freeing its last
        # collective while the interpreter shut down aborted the process ("terminate called
        # without an active exception"). Imported above, before any group, it binds none.
        dist.init_process_group(_backend(device), init_method=init_method, rank=rank,
                                world_size=world_size, timeout=TIMEOUT)
        self._closed = False

    @classmethod
    def start(cls, config: EngineConfig,
              worker: Callable[[EngineConfig, int, str, int], None]) -> TensorParallel:
        """Rank 0's group: join torchrun's ranks, or start the workers as local processes
        running ``worker(config, rank, init_method, threads)`` (``rank.run_worker``)."""
        world = config.tensor_parallel_size
        device = config.torch_device()
        if launched_by_torchrun():
            if int(os.environ["WORLD_SIZE"]) != world:
                raise ValueError(f"WORLD_SIZE {os.environ['WORLD_SIZE']} is not "
                                 f"--tensor-parallel-size {world}")
            set_threads(config, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
            return cls(0, world, config.distributed_init_method or "env://",
                       rank_device(device, 0))
        init = config.distributed_init_method or f"tcp://127.0.0.1:{free_port()}"
        threads = set_threads(config, world)
        spawn = mp.get_context("spawn")
        workers = [spawn.Process(target=worker, args=(config, rank, init, threads),
                                 name=f"conveyor-tp{rank}", daemon=True)
                   for rank in range(1, world)]
        for w in workers:
            w.start()
        logger.info("tensor parallel: %d ranks (%s over %s), %d threads each", world,
                    _backend(device), init, threads)
        return cls(0, world, init, rank_device(device, 0), workers)

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum ``x`` over the ranks, in place (the row-parallel linears' partial sums)."""
        start = time.perf_counter()
        dist.all_reduce(x)
        spent = time.perf_counter() - start
        self.all_reduce_seconds += spent
        self.communication_seconds += spent
        self.num_all_reduces += 1
        self.all_reduce_bytes += x.numel() * x.element_size()

    def gather(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Every rank's columns of ``x`` (``widths[r]`` of them on rank r) side by side on rank
        0; None on the others. (Padded to the widest: gather takes one shape.)"""
        start = time.perf_counter()
        wide = max(widths)
        x = torch.nn.functional.pad(x, (0, wide - x.shape[1])).contiguous()
        parts = [torch.empty_like(x) for _ in widths] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        self.communication_seconds += time.perf_counter() - start
        return None if parts is None else torch.cat(
            [p[:, :w] for p, w in zip(parts, widths)], dim=1)

    def send(self, message: Any) -> None:
        """From rank 0 to every rank (a step's plan, the pool's size; None: stop)."""
        start = time.perf_counter()
        dist.broadcast_object_list([message], src=0, device=self._object_device())
        self.communication_seconds += time.perf_counter() - start

    def receive(self) -> Any:
        box = [None]
        dist.broadcast_object_list(box, src=0, device=self._object_device())
        return box[0]

    def barrier(self) -> None:
        dist.barrier()

    def _object_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None

    # -- life ----------------------------------------------------------------------------------
    def watch(self, on_death: Callable[[str], None], every: float = 0.5) -> None:
        """Call ``on_death(reason)`` once, from a thread, if a local worker process ends."""

        def poll() -> None:
            while not self._closed:
                for w in self.workers:
                    if w.exitcode is not None and not self._closed:
                        on_death(f"tensor-parallel worker {w.name} exited with {w.exitcode}")
                        return
                time.sleep(every)

        threading.Thread(target=poll, name="conveyor-tp-watch", daemon=True).start()

    def close(self) -> None:
        """Tell the workers to stop and wait for them; the process group is gone after."""
        if self._closed:
            return
        self._closed = True
        if all(w.exitcode is None for w in self.workers):
            try:
                if self.rank == 0:
                    self.send(None)
                # every rank at its close before any leaves: a rank that destroys its group
                # and exits while another is still in a collective aborts that one (gloo)
                self.barrier()
            except RuntimeError:  # a rank is gone already
                pass
        for w in self.workers:
            w.join(10)
            if w.exitcode is None:
                w.kill()
        dist.destroy_process_group()


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    if device.type != "cuda":
        return device
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def set_threads(config: EngineConfig, local_ranks: int) -> int:
    """--threads, or the machine's cores shared among its ranks."""
    threads = config.threads or max(1, (os.cpu_count() or 1) // local_ranks)
    torch.set_num_threads(threads)
    return threads
