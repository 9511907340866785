"""Fewer compute threads while other processes keep this machine's cores busy.

The model's threads meet at a barrier after every kernel and PyTorch op. When another process
takes a core, one of two threads is off the CPU for whole scheduler slices and the other waits
at each barrier: a decode step took longer on two threads than it does on one
(docs/results/shared-cpu). So, about twice a second, the engine reads how much CPU time the
machine spent outside this process (Linux's /proc/stat and /proc/self/stat) and runs on the cores
that are left, between one thread and the configured count. Without /proc it never changes.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

INTERVAL_S = 0.5   # how often the machine's load is read
HEADROOM = 0.3     # a core counts as free while others use at most 70% of it


def threads_for(limit: int, cpus: int, others_busy: float) -> int:
    """The threads to run: the cores others leave free, at least 1 and at most `limit`.
    others_busy: cores' worth of CPU time other processes used over the last interval."""
    free = cpus - max(0.0, others_busy)
    return max(1, min(limit, math.floor(free + HEADROOM)))


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative seconds of CPU time: the whole machine's busy time, and this process's."""
    machine_busy: float
    own: float

    @staticmethod
    def read() -> CpuTimes | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
            with open("/proc/self/stat") as f:
                own = f.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            return None
        tick = os.sysconf("SC_CLK_TCK")
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        # own: utime and stime, fields 14 and 15 of the line (12 and 13 after the name)
        return CpuTimes((sum(fields[:8]) - idle) / tick, (int(own[11]) + int(own[12])) / tick)


# torch's thread count is the process's: what it was before a governor first lowered it, so
# that an engine built beside (or after) a lowered one starts from the real default
_unlowered: int | None = None


def default_threads() -> int:
    return _unlowered or torch.get_num_threads()


class ThreadGovernor:
    """Sets torch's thread count (which the CPU kernels take too) from the others' load."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        self.threads = limit
        self._last = CpuTimes.read()
        self._at = time.monotonic()

    def update(self) -> int:
        """Called once a step; re-reads the load once an interval. Returns the thread count."""
        now = time.monotonic()
        if self._last is None or now - self._at < INTERVAL_S:
            return self.threads
        times = CpuTimes.read()
        if times is None:
            return self.threads
        elapsed, last = now - self._at, self._last
        self._last, self._at = times, now
        others = ((times.machine_busy - last.machine_busy) - (times.own - last.own)) / elapsed
        threads = threads_for(self.limit, self.cpus, others)
        if threads != self.threads:
            logger.info("%d compute threads (was %d): other processes keep %.1f of %d cores busy",
                        threads, self.threads, others, self.cpus)
            self._set(threads)
        return threads

    def close(self) -> None:
        """The configured count back, for whatever runs next in this process."""
        self._set(self.limit)

    def _set(self, threads: int) -> None:
        global _unlowered
        if _unlowered is None:
            _unlowered = torch.get_num_threads()
        torch.set_num_threads(threads)
        self.threads = threads
