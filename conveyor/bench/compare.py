"""``conveyor bench compare``: the same seeded workload against Conveyor in several configurations.

Each configuration gets its own server (same model, same KV memory), a warm-up request, then the
workload; the table, a JSON file and PNG plots come out, with the ideal static/continuous ratio
computed from the workload's own output lengths as the ceiling to judge the measured one by.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os

from conveyor.bench.launcher import ConveyorServer
from conveyor.bench.serve import add_workload_args, benchmark, build_workload, served_model


def add_server_args(p: argparse.ArgumentParser) -> None:
    """What every started server shares."""
    p.add_argument("--model", default=None, help="model path for the servers (default model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-memory", default="1GiB", help="the same KV memory for every run")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--server-arg", action="append", default=[],
                   help="an extra flag for every server, e.g. --server-arg=--block-size=32")
    p.add_argument("--result-dir", default="bench-results")


def add_compare_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    add_server_args(p)
    p.add_argument("--policies", nargs="+", default=["static", "continuous"],
                   choices=["static", "continuous"])
    p.add_argument("--max-num-seqs", type=int, nargs="+", default=[32])


def server_flags(args: argparse.Namespace, policy: str, max_num_seqs: int,
                 max_num_batched_tokens: int | None = None) -> list[str]:
    flags = ["--dtype", args.dtype, "--kv-cache-memory", str(args.kv_cache_memory),
             "--policy", policy, "--max-num-seqs", str(max_num_seqs),
             "--max-num-batched-tokens", str(max_num_batched_tokens or args.max_num_batched_tokens)]
    if args.model:
        flags += ["--model", args.model]
    if args.max_model_len:
        flags += ["--max-model-len", str(args.max_model_len)]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    for extra in args.server_arg:
        flags += extra.split("=", 1) if extra.startswith("--") and "=" in extra else [extra]
    return flags


def run_config(args: argparse.Namespace, workload, label: str, flags: list[str]) -> dict:
    """One server, one warm-up, one measured run; the result plus the steps it took."""
    log = os.path.join(args.result_dir, f"server-{label.replace('/', '-')}.log")
    print(f"\n### {label}: conveyor serve {' '.join(flags)}", flush=True)
    with ConveyorServer(flags, log) as server:
        model = served_model(server.base_url)
        server.warm_up(model)
        first_step = server.steps()["next"]
        run_args = copy.copy(args)
        run_args.base_url, run_args.model, run_args.save_result = server.base_url, model, False
        result = benchmark(run_args, workload)
        steps = server.steps(first_step)["steps"]
    return {"label": label, "flags": flags, "result": result, "steps": steps}


def ideal_ratio(output_lens: list[int], max_num_seqs: int) -> float:
    """Decode steps of a static batcher (each batch as long as its longest request) over those of
    an always-full continuous batcher, for requests taken in order."""
    static = sum(max(output_lens[i:i + max_num_seqs])
                 for i in range(0, len(output_lens), max_num_seqs))
    continuous = max(math.ceil(sum(output_lens) / max_num_seqs), max(output_lens))
    return static / continuous


def format_table(runs: list[dict]) -> str:
    head = (f"{'config':<18}{'req/s':>8}{'out tok/s':>11}{'mean TTFT':>11}{'p95 TTFT':>10}"
            f"{'mean TPOT':>11}{'p95 E2EL':>10}{'preempt':>9}{'failed':>8}")
    lines = [head, "-" * len(head)]
    for r in runs:
        s = r["result"]
        preempt = sum(step["num_preemptions"] for step in r["steps"])
        lines.append(f"{r['label']:<18}{s['request_throughput']:>8.2f}"
                     f"{s['output_throughput']:>11.1f}{s['mean_ttft_ms'] / 1e3:>10.2f}s"
                     f"{s['p95_ttft_ms'] / 1e3:>9.2f}s{s['mean_tpot_ms']:>9.1f}ms"
                     f"{s['p95_e2el_ms'] / 1e3:>9.2f}s{preempt:>9d}{s['failed']:>8d}")
    return "\n".join(lines)


def compare(args: argparse.Namespace) -> dict:
    from conveyor.bench.plots import plot_latency_cdfs, plot_occupancy, plot_throughput

    if "95" not in args.metric_percentiles.split(","):
        args.metric_percentiles += ",95"  # the table shows p95
    os.makedirs(args.result_dir, exist_ok=True)
    workload = build_workload(args)
    runs = []
    for seqs in args.max_num_seqs:
        for policy in args.policies:
            label = f"{policy}/{seqs}"
            run = run_config(args, workload, label, server_flags(args, policy, seqs))
            run["max_num_seqs"] = seqs
            runs.append(run)

    print("\n" + format_table(runs))
    output_lens = [r.output_len for r in workload]
    summary = {"runs": runs, "ideal_ratio": {}}
    for seqs in args.max_num_seqs:
        by_policy = {r["label"].split("/")[0]: r for r in runs if r["max_num_seqs"] == seqs}
        ideal = ideal_ratio(output_lens, seqs)
        summary["ideal_ratio"][seqs] = ideal
        line = f"max_num_seqs {seqs}: ideal static/continuous step ratio {ideal:.2f}"
        if {"static", "continuous"} <= by_policy.keys():
            measured = (by_policy["continuous"]["result"]["output_throughput"]
                        / by_policy["static"]["result"]["output_throughput"])
            summary.setdefault("measured_ratio", {})[seqs] = measured
            line += f"; measured continuous/static {measured:.2f} ({measured / ideal:.0%} of ideal)"
        print(line)
    plots = [plot_throughput(runs, args.result_dir), plot_latency_cdfs(runs, args.result_dir),
             plot_occupancy(runs, args.result_dir)]
    path = os.path.join(args.result_dir, "compare.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    print("wrote " + ", ".join([path, *plots]))
    summary["files"] = [path, *plots]
    return summary
