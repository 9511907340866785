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

from conveyor.bench.serve import (add_save_detailed_arg, add_workload_args, benchmark,
                                  build_workload, saved, served_model)
from conveyor.process import ConveyorServer

DEFAULT_KV_MEMORY = "1GiB"  # for each server started: the same for every run, whatever is free


def add_batching_args(p: argparse.ArgumentParser) -> None:
    """The model and the engine's batching and KV settings every run shares (``conveyor serve``'s
    flags)."""
    p.add_argument("--model", default=None, help="model path for the servers (default model)")
    p.add_argument("--kv-cache-memory", default=None,
                   help=f"the same KV memory for every run (default {DEFAULT_KV_MEMORY}; "
                        f"simulated on an accelerator: what its memory leaves)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pages, instead")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the servers' context length (default: the model's, as the pool allows)")
    p.add_argument("--kv-layout", default="paged", choices=["paged", "contiguous"],
                   help="paged pages, or a contiguous reservation per request")
    p.add_argument("--enable-prefix-caching", default=True, action=argparse.BooleanOptionalAction,
                   help="reuse the pages of shared prompt prefixes")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="the servers' queue order")
    p.add_argument("--result-dir", default="bench-results",
                   help="where each run's JSON and the plots go")


def add_server_args(p: argparse.ArgumentParser) -> None:
    """What every started server shares."""
    add_batching_args(p)
    p.add_argument("--dtype", default="auto",
                   help="the servers' dtype")
    p.add_argument("--threads", type=int, default=None,
                   help="the servers' compute threads (default: the cores)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="an extra flag for every server, e.g. --server-arg=--quantization=q8_0")


def add_compare_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    add_server_args(p)
    p.add_argument("--policies", nargs="+", default=["static", "continuous"],
                   choices=["static", "continuous"],
                   help="the batching policies compared")
    p.add_argument("--max-num-seqs", type=int, nargs="+", default=[32],
                   help="batch sizes: one run each, per policy")
    add_save_detailed_arg(p)


def server_flags(args: argparse.Namespace, policy: str, max_num_seqs: int,
                 max_num_batched_tokens: int | None = None) -> list[str]:
    flags = ["--dtype", args.dtype, "--policy", policy, "--max-num-seqs", str(max_num_seqs),
             "--max-num-batched-tokens", str(max_num_batched_tokens or args.max_num_batched_tokens),
             "--block-size", str(args.block_size), "--kv-layout", args.kv_layout,
             "--scheduling-policy", args.scheduling_policy]
    if args.num_kv_blocks:
        flags += ["--num-kv-blocks", str(args.num_kv_blocks)]
    else:
        flags += ["--kv-cache-memory", str(args.kv_cache_memory or DEFAULT_KV_MEMORY)]
    if not args.enable_prefix_caching:
        flags.append("--no-enable-prefix-caching")
    if args.model:
        flags += ["--model", args.model]
    if args.max_model_len:
        flags += ["--max-model-len", str(args.max_model_len)]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    for extra in args.server_arg:
        flags += extra.split("=", 1) if extra.startswith("--") and "=" in extra else [extra]
    return flags


def run_config(args: argparse.Namespace, workload, label: str, flags: list[str],
               before=None, repeats: int = 1) -> dict:
    """One server, one warm-up, then ``repeats`` measured runs of the workload, each from a cold
    prefix cache; the first run's result plus the steps it took, and the later runs as
    ``reruns``. ``before(server)``, if given, runs between the warm-up and the first run."""
    log = os.path.join(args.result_dir, f"server-{label.replace('/', '-')}.log")
    print(f"\n### {label}: conveyor serve {' '.join(flags)}", flush=True)
    runs = []
    with ConveyorServer(flags, log) as server:
        model = served_model(server.base_url)
        server.warm_up(model)
        if before is not None:
            before(server)
        run_args = copy.copy(args)
        run_args.base_url, run_args.model, run_args.save_result = server.base_url, model, False
        for _ in range(repeats):
            server.reset_prefix_cache()
            first_step = server.steps()["next"]
            result = benchmark(run_args, workload)
            runs.append({"result": result, "steps": server.steps(first_step)["steps"]})
    return {"label": label, "flags": flags, **runs[0], "reruns": runs[1:]}


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


def policy_ratios(runs: list[dict], output_lens: list[int], max_num_seqs: list[int],
                  verb: str) -> tuple[dict, dict]:
    """Per max_num_seqs: the workload's ideal static/continuous step ratio and, where both
    policies ran, the continuous/static throughput ratio (printed as ``verb``)."""
    ideal, ratio = {}, {}
    for seqs in max_num_seqs:
        by_policy = {r["label"].split("/")[0]: r for r in runs if r["max_num_seqs"] == seqs}
        ideal[seqs] = ideal_ratio(output_lens, seqs)
        line = f"max_num_seqs {seqs}: ideal static/continuous step ratio {ideal[seqs]:.2f}"
        if {"static", "continuous"} <= by_policy.keys():
            ratio[seqs] = (by_policy["continuous"]["result"]["output_throughput"]
                           / by_policy["static"]["result"]["output_throughput"])
            line += (f"; {verb} continuous/static {ratio[seqs]:.2f} "
                     f"({ratio[seqs] / ideal[seqs]:.0%} of ideal)")
        print(line)
    return ideal, ratio


def compare(args: argparse.Namespace) -> dict:
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
    ideal, measured = policy_ratios(runs, [r.output_len for r in workload], args.max_num_seqs,
                                    "measured")
    summary = {"runs": runs, "ideal_ratio": ideal, "measured_ratio": measured}
    return write_summary(summary, args, "compare.json")


def write_summary(summary: dict, args: argparse.Namespace, name: str) -> dict:
    """The runs' plots and the summary as JSON, into ``--result-dir``: each run's steps and
    per-request lists only with ``--save-detailed`` (they are what the plots drew)."""
    from conveyor.bench.plots import plot_latency_cdfs, plot_occupancy, plot_throughput

    runs, result_dir = summary["runs"], args.result_dir
    plots = [plot_throughput(runs, result_dir), plot_latency_cdfs(runs, result_dir),
             plot_occupancy(runs, result_dir)]
    path = os.path.join(result_dir, name)
    with open(path, "w") as f:
        json.dump(summary if args.save_detailed else {**summary, "runs": [_brief(r) for r in runs]},
                  f)  # no indent: the C encoder, for many thousand steps
    print("wrote " + ", ".join([path, *plots]))
    summary["files"] = [path, *plots]
    return summary


def _brief(run: dict) -> dict:
    """A run as saved without ``--save-detailed``."""
    out = {k: v for k, v in run.items() if k != "steps"}
    out["result"] = saved(run["result"], False)
    if "reruns" in run:
        out["reruns"] = [_brief(r) for r in run["reruns"]]
    return out
