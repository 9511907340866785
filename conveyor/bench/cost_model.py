"""What a step costs, as a function of its shape: the simulator's stand-in for the forward pass.

A step's shape is what the scheduler decided (``SchedulerOutput``) and what ``/v1/engine/steps``
records: fresh decodes, prompt (or recompute) tokens, the KV positions its attention read and the
query-key pairs it computed. ``FittedCost`` is this machine's cost, measured (``conveyor bench
profile``) and fitted as

    seconds = fixed + per_decode x decodes + per_prefill_token x prompt tokens
              + per_context_token x KV positions read + per_attention_pair x query-key pairs

by least squares on relative error (a 10 ms step's 1 ms error counts as much as a 100 ms step's
10 ms), every coefficient kept >= 0. ``roofline.RooflineCost`` is a named accelerator's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

COST_FILE_VERSION = 1
TERMS = ("fixed", "per_decode", "per_prefill_token", "per_context_token", "per_attention_pair")


@dataclass(frozen=True)
class StepShape:
    num_seqs: int
    num_decode_tokens: int
    num_prefill_tokens: int
    num_context_tokens: int
    num_attention_pairs: int

    @classmethod
    def of(cls, out) -> StepShape:
        """From a ``SchedulerOutput`` (before the step advances its requests)."""
        return cls(len(out.scheduled), out.num_decode_tokens, out.num_prefill_tokens,
                   out.num_context_tokens, out.num_attention_pairs)

    @classmethod
    def of_record(cls, record: dict) -> StepShape:
        """From one of ``/v1/engine/steps``' records."""
        return cls(record["num_scheduled"], record["num_decode_tokens"],
                   record["num_prefill_tokens"], record["num_context_tokens"],
                   record["num_attention_pairs"])

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens

    def features(self) -> tuple[float, ...]:
        """The terms of ``FittedCost``'s form, in ``TERMS`` order."""
        return (1.0, self.num_decode_tokens, self.num_prefill_tokens, self.num_context_tokens,
                self.num_attention_pairs)


def nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |a x - b| with x >= 0: refit without the most negative coefficient until none is (the
    few terms here make this active-set loop exact enough and keep scipy out)."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return x


@dataclass(frozen=True)
class FittedCost:
    coefficients: dict[str, float]   # seconds per unit of each of TERMS
    source: dict                     # where the samples came from: machine, model, dtype, ...
    num_samples: int = 0
    median_relative_error: float = 0.0  # of the fit on its own samples
    kv_bytes_per_token: int | None = None  # of the profiled model at its dtype

    def step_seconds(self, shape: StepShape) -> float:
        return sum(self.coefficients[t] * f for t, f in zip(TERMS, shape.features()))

    @classmethod
    def fit(cls, samples: list[tuple[StepShape, float]], source: dict,
            kv_bytes_per_token: int | None = None) -> FittedCost:
        if len(samples) < len(TERMS):
            raise ValueError(f"fitting a step cost needs at least {len(TERMS)} steps, got "
                             f"{len(samples)}")
        a = np.array([s.features() for s, _ in samples], dtype=float)
        t = np.array([d for _, d in samples], dtype=float)
        if (t <= 0).any():
            raise ValueError("every step's duration must be positive")
        x = nonnegative_least_squares(a / t[:, None], np.ones(len(t)))
        error = np.abs(a @ x / t - 1)
        return cls(dict(zip(TERMS, map(float, x))), source, len(samples),
                   float(np.median(error)), kv_bytes_per_token)

    def describe(self) -> str:
        c = self.coefficients
        return (f"{c['fixed'] * 1e3:.2f} ms + {c['per_decode'] * 1e3:.3f} ms/decode + "
                f"{c['per_prefill_token'] * 1e3:.3f} ms/prompt token + "
                f"{c['per_context_token'] * 1e6:.3f} us/KV position + "
                f"{c['per_attention_pair'] * 1e9:.2f} ns/query-key pair")

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"version": COST_FILE_VERSION, "form": " + ".join(TERMS), **asdict(self)},
                      f, indent=1)

    @classmethod
    def load(cls, path: str) -> FittedCost:
        try:
            with open(path) as f:
                data = json.load(f)
            if data.get("version") != COST_FILE_VERSION or set(data["coefficients"]) != set(TERMS):
                raise ValueError("not a step-cost file of this version")
            return cls(data["coefficients"], data["source"], data["num_samples"],
                       data["median_relative_error"], data.get("kv_bytes_per_token"))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--cost-model {path}: {e} (write one with `conveyor bench "
                             f"profile`)") from None


def live_samples(records: list[dict]) -> list[tuple[StepShape, float]]:
    """A live server's ``/v1/engine/steps`` as fitting samples: each step that followed another
    with work left, timed from the end of that one to its own end, so that the server's own cost
    between steps (taking requests in, handing outputs over) is counted as the simulator counts
    it."""
    return [(StepShape.of_record(b), b["time"] - a["time"]) for a, b in zip(records, records[1:])
            if b["step"] == a["step"] + 1 and (a["num_running"] or a["num_waiting"])
            and b["num_scheduled"]]
