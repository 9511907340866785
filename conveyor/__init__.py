"""Conveyor: continuous batching over a paged KV cache."""

from conveyor.kernels import isa

isa.cap_torch_dispatch()  # before torch is imported: CONVEYOR_CPU_ISA caps its dispatch too

# ruff: noqa: E402

from conveyor.llm import LLM
from conveyor.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from conveyor.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestMetrics", "__version__"]
