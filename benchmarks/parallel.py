"""One engine, tensor parallel and data parallel on the same machine, model and load, in one
run: output tok/s at a concurrency (default 32) for

    TP=1   one engine, every core's thread            conveyor serve --threads CORES
    TP=2   two ranks (gloo), cores / 2 threads each    conveyor serve -tp 2
    DP=2   two replicas, cores / 2 threads each        conveyor serve -dp 2

and, for TP=2, the share of its steps rank 0 spends inside the all-reduces, and in every
collective (with the plan's broadcast and the logits' gather), from ``/v1/engine/steps``: the
transfer and the wait for the other rank. The configurations take
turns for ``--rounds`` rounds (timings here are noisy: medians are quoted).

    .venv/bin/python benchmarks/parallel.py --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from conveyor.bench.datasets import uniform_dataset
from conveyor.bench.serve import add_serve_args, benchmark, save_result, served_model
from conveyor.model.loader import default_model_path, load_tokenizer
from conveyor.process import ConveyorServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
CORES = os.cpu_count() or 1
CONFIGS = {"TP=1": ["--threads", str(CORES)], "TP=2": ["-tp", "2"], "DP=2": ["-dp", "2"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_serve_args(p)
    p.add_argument("--gguf", default=None, help="model file (default: the default model)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--input-range", type=int, nargs=2, default=[40, 220])
    p.add_argument("--output-range", type=int, nargs=2, default=[16, 256])
    p.add_argument("--flags", default="--max-num-seqs 32", help="for every configuration")
    p.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    args = p.parse_args()
    gguf = args.gguf or default_model_path()
    args.num_prompts = 64 if args.num_prompts == 100 else args.num_prompts
    args.ignore_eos = args.disable_tqdm = True
    args.max_concurrency = args.concurrency
    save, args.save_result = args.save_result, False  # (the rows, at the end: not each run)
    workload = uniform_dataset(load_tokenizer(gguf), args.num_prompts, args.seed,
                               tuple(args.input_range), tuple(args.output_range))
    rows = []
    for rnd in range(args.rounds):
        for name in args.only:
            log = os.path.join(tempfile.gettempdir(), f"parallel-{name}.log")
            with ConveyorServer(["--model", gguf, *args.flags.split(), *CONFIGS[name]],
                                log) as server:
                args.base_url, args.model = server.base_url, served_model(server.base_url)
                server.warm_up(args.model)
                since = server.steps()["next"]
                print(f"--- round {rnd + 1}, {name}, concurrency {args.concurrency}", flush=True)
                r = benchmark(args, workload)
                steps = server.steps(since)["steps"]
                busy = sum(s["duration"] for s in steps)
                reducing = sum(s["all_reduce_seconds"] for s in steps)
                talking = sum(s["communication_seconds"] for s in steps)
                rows.append({"config": name, "round": rnd + 1,
                             "output_throughput": r["output_throughput"],
                             "mean_tpot_ms": r["mean_tpot_ms"], "completed": r["completed"],
                             "failed": r["failed"], "steps": len(steps),
                             # (DP=2: replica 0's steps only, through the front)
                             "all_reduce_share": reducing / busy if busy else 0.0,
                             "communication_share": talking / busy if busy else 0.0,
                             "mean_step_ms": 1e3 * busy / len(steps) if steps else 0.0})

    print(f"\n{'config':<8}{'round':>6}{'out tok/s':>11}{'mean TPOT':>11}{'steps':>7}"
          f"{'step':>9}{'all-reduce':>12}{'all comms':>11}{'done':>6}{'failed':>7}")
    for r in rows:
        print(f"{r['config']:<8}{r['round']:>6}{r['output_throughput']:>11.1f}"
              f"{r['mean_tpot_ms']:>9.1f}ms{r['steps']:>7}{r['mean_step_ms']:>7.1f}ms"
              f"{r['all_reduce_share']:>12.1%}{r['communication_share']:>11.1%}"
              f"{r['completed']:>6}{r['failed']:>7}")
    medians = {name: statistics.median(r["output_throughput"] for r in rows
                                       if r["config"] == name) for name in args.only}
    base = medians.get("TP=1")
    for name, tok in medians.items():
        ratio = f", {tok / base:.2f}x TP=1" if base and name != "TP=1" else ""
        print(f"median {name}: {tok:.1f} output tok/s{ratio}")
    if save:
        save_result(args, rows, "parallel.json")


if __name__ == "__main__":
    main()
