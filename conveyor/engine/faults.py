"""Faults injected on purpose, to prove that one request's failure stays its own.

Off unless ``CONVEYOR_FAULT_INJECTION`` is set (tests set it in a server's environment; production
never does): then, and only then, ``install`` wraps a loaded engine's request intake, its
sampler and its per-token output step; nothing else in the engine knows of faults. The value is
comma-separated ``kind:marker`` pairs: a request whose prompt text contains ``marker`` meets the
fault ``kind``:

- ``sample``: its row of the sampler fails;
- ``detokenize``: its output step raises on its first token;
- ``nan_logits``: its row of logits becomes NaN before sampling;
- ``engine``: the engine thread itself dies when the request arrives (a supervisor's test).
"""

from __future__ import annotations

import math
import os
from typing import Any

from conveyor.worker.sampler import SampleResult

ENV = "CONVEYOR_FAULT_INJECTION"
KINDS = ("sample", "detokenize", "nan_logits", "engine")


class InjectedFault(RuntimeError):
    """A fault this module raised on purpose."""


class EngineKilled(BaseException):
    """Escapes every ``except Exception``: what a bug that kills the engine thread looks like."""


def parse(spec: str) -> dict[str, str]:
    """{kind: marker} from the variable's value."""
    faults = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, sep, marker = item.partition(":")
        if not sep or kind not in KINDS or not marker:
            raise ValueError(f"{ENV}: expected kind:marker with kind in {KINDS}, got {item!r}")
        faults[kind] = marker
    return faults


class _FaultySampler:
    """The sampler, with the marked requests' rows made NaN or failed."""

    def __init__(self, sampler: Any, marked: dict[str, str]) -> None:
        self._sampler, self._marked = sampler, marked

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sampler, name)

    def __call__(self, logits, requests, grammar=None) -> list[SampleResult]:
        kinds = [self._marked.get(r.request_id) for r in requests]
        if "nan_logits" in kinds:
            logits = logits.clone()
            logits[[i for i, k in enumerate(kinds) if k == "nan_logits"]] = math.nan
        results = self._sampler(logits, requests, grammar)
        for i, kind in enumerate(kinds):
            if kind == "sample":
                results[i] = SampleResult(results[i].token_id, error="sampling failed: fault "
                                          f"injected into the sampling of {requests[i]}")
        return results


def install(engine: Any) -> None:
    """Wraps a loaded ``LLMEngine`` for the faults the environment asks for; does nothing
    without them."""
    faults = parse(os.environ.get(ENV, ""))
    if not faults:
        return
    marked: dict[str, str] = {}  # sample id -> the fault it meets
    add_request, advance = engine.add_request, engine.output_processor._advance

    def faulty_add_request(request_id, prompt, params, *args, **kwargs) -> None:
        text, ids = engine.inputs.tokenize(prompt)  # (add_request checks the request)
        text = engine.tokenizer.decode(ids) if text is None else text
        kind = next((k for k, marker in faults.items() if marker in text), None)
        if kind == "engine":
            raise EngineKilled(f"fault injected: the engine dies on request {request_id}")
        add_request(request_id, prompt, params, *args, **kwargs)
        if kind is not None:
            marked.update({s.request.request_id: kind
                           for s in engine.output_processor.states[request_id].samples})

    def faulty_advance(request, sample, result, now) -> None:
        if marked.get(request.request_id) == "detokenize":
            raise InjectedFault(f"fault injected into the detokenizer of {request}")
        advance(request, sample, result, now)

    engine.add_request = faulty_add_request
    engine.output_processor._advance = faulty_advance
    engine.runner.sampler = _FaultySampler(engine.runner.sampler, marked)
