"""Decode steps replayed from CUDA graphs, as vLLM does: a step of n single-token queries is
padded to the next size of a ladder (1, 2, 4, then every 8), and the graph captured at that size
the first time it is needed replays the whole network, attention metadata included, in one
launch. Without graphs a GPU step is hundreds of kernel launches from Python, each costing more
than its work at these sizes.

Padding rows are queries of their own at position 0 on a scratch page that no request holds
(the page past the pool's): they write their K/V there and read only it, so they touch no
request's pages, and their outputs are dropped. The inputs live in fixed buffers, rewritten
before each replay; where graphs are not captured (``capture`` False: the CPU, in tests) the
same padded buffers run eagerly, so the padding is what the tests check.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from conveyor.worker.step_plan import StepPlan

# (token ids, rope rows, KV slots, positions, block tables [rows, width], -1 padded) -> hidden
DecodeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                      torch.Tensor]


def graph_sizes(max_rows: int) -> list[int]:
    """vLLM's ladder of capture sizes: 1, 2, 4, then each multiple of 8 below ``max_rows``, and
    ``max_rows`` itself last."""
    return [s for s in (1, 2, 4, *range(8, max_rows, 8)) if s < max_rows] + [max_rows]


def padded_size(rows: int, sizes: list[int]) -> int | None:
    """The smallest size that holds ``rows``; None past the largest (the step runs eagerly)."""
    i = bisect.bisect_left(sizes, rows)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    def __init__(self, step: DecodeStep, max_rows: int, max_pages: int, scratch_page: int,
                 block_size: int, device: torch.device, capture: bool) -> None:
        """max_pages: the most pages a request's table holds (the tables' width);
        scratch_page: a page of the caches outside the pool."""
        self.step, self.sizes, self.capture = step, graph_sizes(max_rows), capture
        self.block_size, self.scratch_page = block_size, scratch_page
        self.ids, self.rope_rows, self.slots = (torch.zeros(max_rows, dtype=torch.long,
                                                            device=device) for _ in range(3))
        self.positions = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.tables = torch.full((max_rows, max_pages), -1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None  # the graphs' shared memory pool

    def run(self, plan: StepPlan) -> torch.Tensor | None:
        """The hidden states of a step of single-token queries only, or None where it has more
        rows than the largest size (it then runs eagerly)."""
        n = len(plan.ids)
        size = padded_size(n, self.sizes)
        if size is None or plan.prefills:
            return None
        width = self.tables.shape[1]
        positions, _, tables = plan.sequences(self.block_size, width)
        scratch = [self.scratch_page] + [-1] * (width - 1)
        self._fill(self.ids, plan.ids, 0, size)
        self._fill(self.rope_rows, plan.rope_rows, 0, size)
        self._fill(self.slots, plan.slots, self.scratch_page * self.block_size, size)
        self._fill(self.positions, positions, 0, size)
        self.tables[:size].copy_(torch.tensor(tables + [scratch] * (size - n),
                                              dtype=torch.int32), non_blocking=True)
        if not self.capture:
            return self.step(*self._inputs(size))[:n]
        if size not in self._graphs:
            self._graphs[size] = self._capture(size)
        graph, hidden = self._graphs[size]
        graph.replay()
        return hidden[:n]

    @staticmethod
    def _fill(buffer: torch.Tensor, values, pad_value: int, size: int) -> None:
        data = list(values) + [pad_value] * (size - len(values))
        buffer[:size].copy_(torch.tensor(data, dtype=buffer.dtype), non_blocking=True)

    def _inputs(self, size: int) -> tuple[torch.Tensor, ...]:
        return (self.ids[:size], self.rope_rows[:size], self.slots[:size],
                self.positions[:size], self.tables[:size])

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The step at ``size`` rows captured (after warm-up runs on a side stream, which
        compile the kernels and settle the allocator); the buffers hold this step's inputs, so
        the warm-up only rewrites its K/V in place."""
        inputs = self._inputs(size)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = self.step(*inputs)
        self._pool = graph.pool()
        return graph, hidden
