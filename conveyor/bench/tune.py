"""``conveyor bench tune --slo ttft_p95=2s``: sweep the batch limits under the same traffic and
recommend the setting with the highest throughput that meets the latency target."""

from __future__ import annotations

import argparse
import json
import os
import re

from conveyor.bench.compare import add_server_args, run_config, server_flags
from conveyor.bench.serve import add_workload_args, build_workload

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
    p.add_argument("--policy", default="continuous", choices=["continuous", "static"])
    p.add_argument("--max-num-seqs", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    p.add_argument("--max-num-batched-tokens-list", type=int, nargs="+", default=None,
                   help="also sweep the token budget over these values")


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
    workload = build_workload(args)
    budgets = args.max_num_batched_tokens_list or [args.max_num_batched_tokens]
    points = []
    for seqs in args.max_num_seqs:
        for budget in budgets:
            if budget < seqs:
                continue
            label = f"seqs={seqs}" + (f",tokens={budget}" if len(budgets) > 1 else "")
            run = run_config(args, workload, label, server_flags(args, args.policy, seqs, budget))
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
    summary = {"slo": args.slo, "points": points, "recommended": best, "message": message}
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wrote {path}, {plot}")
    return summary
