"""What sampling costs a decode step: the sampler on a step's real logits (the default model, 32
requests decoding), greedy and under each rule, against the greedy step itself.

    .venv/bin/python benchmarks/sampler_cost.py --batch 32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from conveyor.config import EngineConfig
from conveyor.engine.engine import LLMEngine
from conveyor.sampling_params import SamplingParams
from conveyor.worker.sampler import Sampler

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 0.8, top_p 0.95": dict(temperature=0.8, top_p=0.95),
    "temperature 1.0": dict(temperature=1.0),
    "top_k 40": dict(temperature=0.8, top_k=40),
    "min_p 0.05": dict(temperature=0.8, min_p=0.05),
    "top_k 40, top_p 0.9, min_p 0.05": dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05),
    "seeded, top_p 0.95": dict(temperature=0.8, top_p=0.95, seed=1),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=args.batch,
                                    enable_prefix_caching=False))
    corpus = ["The history of", "def main():", "Once upon a time", "The best way to learn",
              "In 1905, Einstein", "import numpy as np", "Water boils at", "The capital of"]
    for i in range(args.batch):
        engine.add_request(str(i), f"{corpus[i % len(corpus)]} ({i})",
                           SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    captured = {}
    call = Sampler.__call__

    def capture(self, logits, requests, grammar=None):
        captured["logits"], captured["requests"] = logits.clone(), list(requests)
        return call(self, logits, requests, grammar)

    Sampler.__call__ = capture
    step_times = []
    for _ in range(24):  # the prompts, then decodes of all rows: the greedy step's time
        t = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t)
    Sampler.__call__ = call
    step = statistics.median(step_times[-16:])
    logits, requests = captured["logits"], captured["requests"]
    sampler = engine.runner.sampler
    print(f"{len(requests)} rows x {logits.shape[1]} logits; greedy decode step (the sampler "
          f"in it): {1e3 * step:.1f} ms median; {torch.get_num_threads()} threads")
    print(f"{'setting':38s} {'ms':>7s} {'of a greedy step':>17s}")
    for name, fields in SETTINGS.items():
        for r in requests:
            r.sampling_params = SamplingParams(max_tokens=64, **fields)
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            sampler(logits, requests)
            times.append(time.perf_counter() - t)
        ms = 1e3 * statistics.median(times)
        print(f"{name:38s} {ms:7.2f} {ms / (1e3 * step):17.1%}")


if __name__ == "__main__":
    main()
