"""Faults injected on purpose, to prove that one request's failure stays its own.

Off unless ``CONVEYOR_FAULT_INJECTION`` is set (tests set it in a server's environment; production
never does). Its value is comma-separated ``kind:marker`` pairs: a request whose prompt text
contains ``marker`` meets the fault ``kind``:

- ``sample``: its row of the sampler raises;
- ``detokenize``: its detokenizer raises on its first token;
- ``nan_logits``: its row of logits becomes NaN before sampling;
- ``engine``: the engine thread itself dies when the request arrives (a supervisor's test).
"""

from __future__ import annotations

import os

ENV = "CONVEYOR_FAULT_INJECTION"
KINDS = ("sample", "detokenize", "nan_logits", "engine")


class InjectedFault(RuntimeError):
    """A fault this module raised on purpose."""


class EngineKilled(BaseException):
    """Escapes every ``except Exception``: what a bug that kills the engine thread looks like."""


def _parse(spec: str) -> dict[str, str]:
    faults = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, sep, marker = item.partition(":")
        if not sep or kind not in KINDS or not marker:
            raise ValueError(f"{ENV}: expected kind:marker with kind in {KINDS}, got {item!r}")
        faults[kind] = marker
    return faults


FAULTS = _parse(os.environ.get(ENV, ""))


def fault_for(prompt: str | None) -> str | None:
    """The fault a request with this prompt text meets, if any."""
    if not FAULTS or prompt is None:
        return None
    return next((kind for kind, marker in FAULTS.items() if marker in prompt), None)
