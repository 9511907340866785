"""``conveyor bench tune --slo ttft_p95=2s``: sweep the batch limits under the same traffic and
recommend the setting with the highest throughput that meets the latency target; with
``--simulate``, each setting runs in ``bench simulate``'s simulator instead of on a server (this
machine's fitted step cost, or ``--accelerator``'s roofline): seconds instead of minutes each."""

from __future__ import annotations

import argparse
import json
import os
import re

from conveyor.bench.compare import add_server_args, run_config, server_flags
from conveyor.bench.serve import add_workload_args, build_workload
from conveyor.bench.simulate import (add_cost_args, kv_pool, simulate_run, simulated_model,
                                    step_cost, workload_requests)

_SLO = re.compile(r"(ttft|tpot|e2el|itl)_p(\d+(?:\.\d+)?)=(\d+(?:\.\d+)?)(ms|s)")


def parse_slo(text: str) -> tuple[str, str, float]:
    """"ttft_p95=2s" -> ("ttft", "95", 2000.0): metric, percentile, target in ms."""
    m = _SLO.fullmatch(text.strip())
    if not m:
        raise ValueError(f"--slo {text!r} is not like ttft_p95=2s, e2el_p95=10s or tpot_p95=80ms")
    metric, pct, value, unit = m.groups()
    pct = f"{float(pct):g}"
    if not 0 < float(pct) < 100:
        raise ValueError(f"--slo {text!r}: the percentile must be in (0, 100)")
    return metric, pct, float(value) * (1000 if unit == "s" else 1)


def add_tune_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    add_server_args(p)
    p.add_argument("--slo", required=True, help="ttft_p95=2s, e2el_p95=10s or tpot_p95=80ms")
    p.add_argument("--policy", default="continuous", choices=["continuous", "static"],
                   help="the batching policy tuned")
    p.add_argument("--max-num-seqs", type=int, nargs="+", default=[4, 8, 16, 32, 64],
                   help="the batch sizes tried")
    p.add_argument("--max-num-batched-tokens-list", type=int, nargs="+", default=None,
                   help="also sweep the token budget over these values")
    p.add_argument("--simulate", action="store_true",
                   help="run each setting in the simulator (give --cost-model or --accelerator)")
    add_cost_args(p)


def recommend(points: list[dict], target_ms: float, name: str) -> tuple[dict, str]:
    meeting = [p for p in points if p["latency_ms"] <= target_ms]
    if meeting:
        best = max(meeting, key=lambda p: p["throughput"])
        return best, (f"recommended: {best['label']}: {best['throughput']:.1f} output tok/s with "
                      f"{name} {best['latency_ms']:.0f} ms <= {target_ms:.0f} ms")
    best = min(points, key=lambda p: p["latency_ms"])
    over = best["latency_ms"] - target_ms
    return best, (f"no setting meets {name} <= {target_ms:.0f} ms; the closest is {best['label']} "
                  f"at {best['latency_ms']:.0f} ms, {over:.0f} ms ({over / target_ms:.0%}) over, "
                  f"with {best['throughput']:.1f} output tok/s")


def tune(args: argparse.Namespace) -> dict:
    from conveyor.bench.plots import plot_tune

    metric, pct, target_ms = parse_slo(args.slo)
    if metric not in args.percentile_metrics.split(","):
        args.percentile_metrics += f",{metric}"
    if pct not in [f"{float(p):g}" for p in args.metric_percentiles.split(",")]:
        args.metric_percentiles += f",{pct}"
    os.makedirs(args.result_dir, exist_ok=True)
    if args.simulate:
        from conveyor.model.loader import load_tokenizer

        cost = step_cost(args)
        pool = kv_pool(args, cost, simulated_model(args, cost))
        requests = workload_requests(args, load_tokenizer(args.tokenizer or args.model))

        def run_setting(label: str, seqs: int, budget: int) -> dict:
            return simulate_run(args, requests, cost, pool, args.policy, seqs, budget, label)
    else:
        if args.cost_model or args.accelerator:
            raise ValueError("--cost-model and --accelerator are for --simulate")
        workload = build_workload(args)

        def run_setting(label: str, seqs: int, budget: int) -> dict:
            return run_config(args, workload, label, server_flags(args, args.policy, seqs, budget))
    budgets = args.max_num_batched_tokens_list or [args.max_num_batched_tokens]
    points = []
    for seqs in args.max_num_seqs:
        for budget in budgets:
            if budget < seqs:
                continue
            label = f"seqs={seqs}" + (f",tokens={budget}" if len(budgets) > 1 else "")
            run = run_setting(label, seqs, budget)
            points.append({"label": label, "max_num_seqs": seqs, "max_num_batched_tokens": budget,
                           "throughput": run["result"]["output_throughput"],
                           "latency_ms": run["result"][f"p{pct}_{metric}_ms"],
                           "failed": run["result"]["failed"]})
    name = f"{metric}_p{pct}"
    print(f"\n{'setting':<24}{'out tok/s':>11}{name + ' (ms)':>16}")
    for p in points:
        print(f"{p['label']:<24}{p['throughput']:>11.1f}{p['latency_ms']:>16.0f}")
    best, message = recommend(points, target_ms, name)
    print(message)
    plot = plot_tune(points, name, target_ms, args.result_dir)
    path = os.path.join(args.result_dir, "tune.json")
    summary = {"slo": args.slo, "points": points, "recommended": best, "message": message,
               "simulated": cost.describe() if args.simulate else None}
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wrote {path}, {plot}")
    return summary
