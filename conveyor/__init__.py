"""Conveyor: continuous batching over a paged KV cache."""

from conveyor.kernels import isa

isa.cap_torch_dispatch()  # before torch is imported: CONVEYOR_CPU_ISA caps its dispatch too

# ruff: noqa: E402

from conveyor.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from conveyor.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestMetrics", "__version__"]


def __getattr__(name: str):
    """``LLM`` on first use (it brings torch), so that ``conveyor --help`` starts at once."""
    if name == "LLM":
        from conveyor.llm import LLM

        return LLM
    raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
