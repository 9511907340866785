"""Prefix caching on vs off: 64 requests sharing a 512-token system prompt, each followed by its own
32-token question, sent at once to the same server configuration with and without caching.

Prints mean TTFT, output throughput and the prompt tokens each server actually computed (from
its per-step record), plus the prefix-cache counters from /metrics.

    .venv/bin/python benchmarks/prefix_caching.py
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile

import httpx

from conveyor.bench.datasets import BenchRequest
from conveyor.bench.serve import add_serve_args, benchmark, served_model
from conveyor.model.loader import load_tokenizer
from conveyor.process import ConveyorServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def workload(tokenizer, num: int, system_len: int, question_len: int, output_len: int,
             seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    words = ("batch page token cache queue request model server prompt latency throughput "
             "memory step decode prefill schedule").split()

    def text_of(n_tokens: int) -> str:
        text = ""
        while len(tokenizer.encode(text, add_special_tokens=False)) < n_tokens:
            text += " " + rng.choice(words)
        ids = tokenizer.encode(text, add_special_tokens=False)[:n_tokens]
        return tokenizer.decode(ids)

    system = text_of(system_len)
    out = []
    for i in range(num):
        prompt = system + f"\nQuestion {i}:" + text_of(question_len)
        out.append(BenchRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)),
                                output_len))
    return out


def prometheus_value(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_serve_args(p)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--server-model", default=None, help="model path for the servers")
    args = p.parse_args()
    args.num_prompts = 64 if args.num_prompts == 100 else args.num_prompts
    args.ignore_eos = True
    requests = workload(load_tokenizer(args.tokenizer), args.num_prompts, args.system_len,
                        args.question_len, args.output_len, args.seed)
    flags = ["--kv-cache-memory", "512MiB", "--max-num-seqs", "64"]
    if args.server_model:
        flags += ["--model", args.server_model]
    rows = {}
    for caching in ("on", "off"):
        extra = [] if caching == "on" else ["--no-enable-prefix-caching"]
        log = os.path.join(tempfile.gettempdir(), f"conveyor-prefix-{caching}.log")
        with ConveyorServer(flags + extra, log) as server:
            model = served_model(server.base_url)
            server.warm_up(model)
            first = server.steps()["next"]
            args.base_url, args.model = server.base_url, model
            result = benchmark(args, requests)
            steps = server.steps(first)["steps"]
            metrics = httpx.get(server.base_url + "/metrics").text
        rows[caching] = {
            "mean_ttft_ms": result["mean_ttft_ms"], "output_throughput": result["output_throughput"],
            "prefill_tokens": sum(s["num_prefill_tokens"] for s in steps),
            "queries": prometheus_value(metrics, "conveyor:prefix_cache_queries_total"),
            "hits": prometheus_value(metrics, "conveyor:prefix_cache_hits_total"),
            "failed": result["failed"]}
    print(f"\n{'caching':<9}{'mean TTFT':>12}{'out tok/s':>11}{'prefill tokens':>16}"
          f"{'cache queries':>15}{'cache hits':>12}{'failed':>8}")
    for name, r in rows.items():
        print(f"{name:<9}{r['mean_ttft_ms']:>10.0f}ms{r['output_throughput']:>11.1f}"
              f"{r['prefill_tokens']:>16d}{r['queries']:>15.0f}{r['hits']:>12.0f}{r['failed']:>8d}")
    on, off = rows["on"], rows["off"]
    print(f"mean TTFT off/on = {off['mean_ttft_ms'] / on['mean_ttft_ms']:.2f}x; output throughput "
          f"on/off = {on['output_throughput'] / off['output_throughput']:.2f}x; prefill tokens "
          f"computed off/on = {off['prefill_tokens'] / max(1, on['prefill_tokens']):.1f}x")


if __name__ == "__main__":
    main()
