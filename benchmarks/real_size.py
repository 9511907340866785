"""Conveyor against llama.cpp's ``llama-server`` on one real-size GGUF (a shaped file from
``shaped_gguf.py``): the traffic of issue 32's bars, both servers on the same file, one after the
other, in one run.

- ``c1``: 8 requests one at a time, outputs of 128 tokens: mean TPOT;
- ``c32``: 32 requests at once (prompts 40-800 tokens, outputs 64-128), greedy: output tok/s;
- ``c32-sampled``: the same at temperature 0.8, top_p 0.95;
- ``c4-long``: 8 requests four at a time, prompts of 1600-2100 tokens, outputs of 16: mean TTFT.

Every request ignores EOS; neither server caches prompts (llama-server ``--no-cache-prompt``,
Conveyor ``--no-enable-prefix-caching``), so each computes every prompt. ``--also-conveyor FLAGS``
adds Conveyor with other flags to the same run (e.g. ``--activation-quant int8``), after the
first, as ``conveyor #2`` and on.

    .venv/bin/python benchmarks/real_size.py --gguf llama-3.2-1b-Q4_K_M.gguf \\
        --llama-server ~/peers/llama/.../llama-server --save-result --result-dir docs/results/x
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

from peer import LlamaServer

from conveyor.bench.datasets import uniform_dataset
from conveyor.bench.serve import add_serve_args, benchmark, save_result, served_model
from conveyor.model.loader import load_tokenizer
from conveyor.process import ConveyorServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# name: (requests, concurrency, prompt tokens, output tokens, sampling)
SCENARIOS = {
    "c1": (8, 1, (40, 220), (128, 128), {}),
    "c32": (32, 32, (40, 800), (64, 128), {}),
    "c32-sampled": (32, 32, (40, 800), (64, 128), {"temperature": 0.8, "top_p": 0.95}),
    "c4-long": (8, 4, (1600, 2100), (16, 16), {}),
}
FIGURES = {"c1": "mean_tpot_ms", "c32": "output_throughput",
           "c32-sampled": "output_throughput", "c4-long": "mean_ttft_ms"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_serve_args(p)
    p.add_argument("--gguf", required=True)
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER")
                   or shutil.which("llama-server"))
    p.add_argument("--llama-flags",
                   default="-np 32 -kvu -c 73728 -t 2 --no-cache-prompt --no-repack")
    p.add_argument("--conveyor-flags",
                   default="--max-num-seqs 32 --kv-cache-memory 3GiB --no-enable-prefix-caching")
    p.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    p.add_argument("--also-conveyor", action="append", default=[], metavar="FLAGS",
                   help="flags of a further Conveyor configuration in the same run")
    p.add_argument("--only", nargs="+", choices=["llama-server", "conveyor"], default=None)
    args = p.parse_args()
    wanted = args.only or ["llama-server", "conveyor"]
    others = [f"conveyor #{i}" for i in range(2, 2 + len(args.also_conveyor))]
    wanted += others if "conveyor" in wanted else []
    if "llama-server" in wanted and not args.llama_server:
        p.error("no llama-server: pass --llama-server PATH or set LLAMA_SERVER (or --only)")
    args.ignore_eos = args.disable_tqdm = True
    tokenizer = load_tokenizer(args.gguf)
    workloads = {name: uniform_dataset(tokenizer, n, args.seed, prompts, outputs)
                 for name, (n, _, prompts, outputs, _) in SCENARIOS.items()}
    tmp = tempfile.gettempdir()
    servers = {
        "llama-server": lambda: LlamaServer(args.llama_server, args.gguf, args.llama_flags.split(),
                                            os.path.join(tmp, "real-size-llama-server.log")),
        "conveyor": lambda: ConveyorServer(["--model", args.gguf, *args.conveyor_flags.split()],
                                           os.path.join(tmp, "real-size-conveyor.log")),
        **{name: (lambda flags=flags, i=i: ConveyorServer(
            ["--model", args.gguf, *flags.split()], os.path.join(tmp, f"real-size-conveyor{i}.log")))
           for i, (name, flags) in enumerate(zip(others, args.also_conveyor), 2)},
    }
    rows = []
    for name in wanted:
        with servers[name]() as server:
            args.base_url, args.model = server.base_url, served_model(server.base_url)
            server.warm_up(args.model)
            for scenario in args.scenarios:
                _, concurrency, _, _, sampling = SCENARIOS[scenario]
                args.max_concurrency = concurrency
                args.temperature = sampling.get("temperature", 0.0)
                args.top_p = sampling.get("top_p")
                print(f"--- {name}, {scenario}", flush=True)
                r = benchmark(args, workloads[scenario])
                rows.append({"server": name, "scenario": scenario, **{k: r[k] for k in (
                    "output_throughput", "mean_tpot_ms", "median_tpot_ms", "mean_ttft_ms",
                    "median_ttft_ms", "completed", "failed", "duration")}})
    print(f"\n{'server':<14}{'scenario':<13}{'out tok/s':>10}{'mean TPOT':>11}{'mean TTFT':>11}"
          f"{'done':>6}{'failed':>8}")
    for r in rows:
        print(f"{r['server']:<14}{r['scenario']:<13}{r['output_throughput']:>10.1f}"
              f"{r['mean_tpot_ms']:>9.1f}ms{r['mean_ttft_ms']:>9.0f}ms{r['completed']:>6}"
              f"{r['failed']:>8}")
    by = {(r["server"], r["scenario"]): r for r in rows}
    for scenario in args.scenarios:
        for name in ["conveyor", *others]:
            mine, peer = by.get((name, scenario)), by.get(("llama-server", scenario))
            if mine and peer:
                key = FIGURES[scenario]
                print(f"{scenario}: {key} {name}/llama-server = {mine[key] / peer[key]:.2f}x")
    if args.save_result:
        save_result(args, rows, "real-size.json")


if __name__ == "__main__":
    main()
