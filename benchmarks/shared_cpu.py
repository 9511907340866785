"""Decode time per token on an idle machine and with other processes keeping cores busy.

A greedy completion of --tokens tokens, alone, taking turns: idle, then with --hogs busy loops
(other processes, `while True: pass`) started a moment before; medians of --repeats. Once with
the engine's adaptive threads (the default) and once without (--no-adaptive-threads).

    .venv/bin/python benchmarks/shared_cpu.py [--model FILE] [--hogs 1] [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from conveyor import LLM, SamplingParams

PROMPT = "The capital of France is"


def time_per_token(llm: LLM, tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([PROMPT], params, use_tqdm=False)
    return (time.perf_counter() - start) / tokens


def measure(model: str | None, adaptive: bool, hogs: int, tokens: int, repeats: int) -> dict:
    llm = LLM(model=model, num_kv_blocks=64, adaptive_threads=adaptive)
    try:
        time_per_token(llm, tokens)  # warm-up
        runs: dict[str, list[float]] = {"idle": [], "busy": []}
        for _ in range(repeats):
            time.sleep(1.0)  # (the adaptive engine sees the idle machine again)
            runs["idle"].append(time_per_token(llm, tokens))
            busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(hogs)]
            try:
                time.sleep(1.0)
                runs["busy"].append(time_per_token(llm, tokens))
            finally:
                for hog in busy:
                    hog.kill()
                    hog.wait()
        return {k: statistics.median(v) for k, v in runs.items()}
    finally:
        llm.engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    p.add_argument("--hogs", type=int, default=1, help="busy processes beside the engine")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    print(f"{os.cpu_count()} CPUs, {args.hogs} busy process(es), {args.tokens} tokens, "
          f"medians of {args.repeats}")
    for adaptive in (True, False):
        m = measure(args.model, adaptive, args.hogs, args.tokens, args.repeats)
        print(f"adaptive threads {'on ' if adaptive else 'off'}: idle {m['idle'] * 1e3:.1f} "
              f"ms/token, busy {m['busy'] * 1e3:.1f} ms/token ({m['busy'] / m['idle']:.2f}x)")


if __name__ == "__main__":
    main()
