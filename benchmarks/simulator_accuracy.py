"""The simulator against the real thing: predicted vs measured ``bench serve`` runs, side by side.

For each ``--max-num-seqs`` and policy: start a server (``bench compare``'s: same KV memory, a
warm-up request), replay the seeded conversation workload against it ``--repeats`` times (each
from a cold prefix cache; the table compares with the runs' median and shows how far apart they
were), and replay the same workload through ``bench simulate``'s simulator on a fitted step cost.
``--fit live`` (default) fits each server's own steps of a calibration run served just before the
measured ones, as ``bench profile --base-url`` does: the same kind of traffic (the workload's
dataset and arrival rate) with another seed, as one would fit on yesterday's traffic to plan
today's. This VM's speed drifts by 10-15% within minutes, so a fit taken once, long before,
carries that drift into every prediction. ``--fit grid`` profiles the grid once, at the start
(``bench profile``: the engine alone, no HTTP), or takes ``--cost-model``. Prints predicted and
measured throughput and p50/p95 TTFT and E2EL with the error of each, and the continuous/static
ratios; saves every figure as JSON.

    .venv/bin/python benchmarks/simulator_accuracy.py --result-dir docs/results/simulator
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conveyor.bench.compare import run_config, server_flags  # noqa: E402
from conveyor.bench.cost_model import FittedCost, live_samples  # noqa: E402
from conveyor.bench.profile import live_server_samples, machine  # noqa: E402
from conveyor.bench.serve import benchmark, build_workload  # noqa: E402
from conveyor.bench.simulate import (add_simulate_args, kv_pool, simulate_run,  # noqa: E402
                                    workload_requests)
from conveyor.model.loader import load_config, load_tokenizer  # noqa: E402

FIGURES = (("output_throughput", "out tok/s"), ("median_ttft_ms", "p50 TTFT"),
           ("p95_ttft_ms", "p95 TTFT"), ("median_e2el_ms", "p50 E2EL"),
           ("p95_e2el_ms", "p95 E2EL"))


def bench_args(extra: list[str]) -> argparse.Namespace:
    """`bench simulate`'s flags with its defaults, and the servers' own (`bench compare`'s)."""
    p = argparse.ArgumentParser()
    add_simulate_args(p)
    args = p.parse_args(extra)
    args.dtype, args.threads, args.server_arg = "auto", None, []
    return args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fit", default="live", choices=["live", "grid"])
    p.add_argument("--cost-model", default=None,
                   help="with --fit grid: a fitted step cost (default: profile now)")
    p.add_argument("--calibration-prompts", type=int, default=60,
                   help="--fit live: requests in the calibration run")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=8.0)
    p.add_argument("--repeats", type=int, default=2,
                   help="measured runs per configuration, on the same server")
    p.add_argument("--max-num-seqs", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--policies", nargs="+", default=["static", "continuous"])
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--result-dir", default="simulator-accuracy")
    opts = p.parse_args()
    os.makedirs(opts.result_dir, exist_ok=True)
    grid_cost = None
    if opts.fit == "grid":
        cost_path = opts.cost_model or os.path.join(opts.result_dir, "step-cost.json")
        if opts.cost_model is None:
            subprocess.run([sys.executable, "-m", "conveyor.cli", "bench", "profile",
                            "--output", cost_path], check=True)
        grid_cost = FittedCost.load(cost_path)
    workload_flags = ["--dataset-name", "conversation", "--request-rate", str(opts.request_rate),
                      "--ignore-eos", "--disable-tqdm"]
    args = bench_args([*workload_flags, "--num-prompts", str(opts.num_prompts),
                       "--kv-cache-memory", opts.kv_cache_memory, "--result-dir", opts.result_dir])
    calibration_args = bench_args([*workload_flags, "--num-prompts",
                                   str(opts.calibration_prompts), "--seed", str(args.seed + 1)])
    tokenizer = load_tokenizer(None)
    workload = build_workload(args, tokenizer)
    calibration = build_workload(calibration_args, tokenizer)
    requests = workload_requests(args, tokenizer)
    config = load_config(None)
    rows = []
    for seqs in opts.max_num_seqs:
        for policy in opts.policies:
            label = f"{policy}/{seqs}"
            fits = []

            def calibrate(server) -> None:
                """Serve the calibration workload, then fit every step the server has taken."""
                calibration_args.base_url, calibration_args.model = server.base_url, None
                benchmark(calibration_args, calibration)
                samples, source, per_token = live_server_samples(server.base_url)
                fits.append(FittedCost.fit(samples, source, per_token))
                print(f"calibrated on {len(samples)} steps: {fits[-1].describe()}")

            measured = run_config(args, workload, label, server_flags(args, policy, seqs),
                                  before=calibrate if grid_cost is None else None,
                                  repeats=opts.repeats)
            runs = [measured, *measured["reruns"]]
            cost = grid_cost or fits[0]
            predicted = simulate_run(args, requests, cost, kv_pool(args, cost, config), policy,
                                     seqs, args.max_num_batched_tokens, label)["result"]
            # how the measured runs' own steps compare with the cost model (its error alone)
            steps = [s for run in runs for s in live_samples(run["steps"])]
            step_ratio = statistics.median(t / cost.step_seconds(shape) for shape, t in steps)
            figures = {k: [run["result"][k] for run in runs] for k, _ in FIGURES}
            rows.append({"label": label, "policy": policy, "max_num_seqs": seqs,
                         "cost_model": cost.describe(), "fit_samples": cost.num_samples,
                         "measured_step_over_model": step_ratio,
                         "predicted": {k: predicted[k] for k, _ in FIGURES},
                         "measured": {k: statistics.median(v) for k, v in figures.items()},
                         "measured_runs": figures,
                         "measured_spread": {k: max(v) / min(v) - 1 for k, v in figures.items()},
                         "measured_failed": sum(run["result"]["failed"] for run in runs)})
            print_table(rows)
    ratios = {}
    for seqs in opts.max_num_seqs:
        by = {r["policy"]: r for r in rows if r["max_num_seqs"] == seqs}
        if {"static", "continuous"} <= by.keys():
            ratios[seqs] = {kind: by["continuous"][kind]["output_throughput"]
                            / by["static"][kind]["output_throughput"]
                            for kind in ("predicted", "measured")}
            r = ratios[seqs]
            print(f"max_num_seqs {seqs}: continuous/static measured {r['measured']:.2f}, "
                  f"simulated {r['predicted']:.2f} ({r['measured'] / r['predicted']:.0%} of the "
                  f"simulator's)")
    with open(os.path.join(opts.result_dir, f"accuracy-{opts.fit}.json"), "w") as f:
        json.dump({"fit": opts.fit, "machine": machine(), "rows": rows, "ratios": ratios,
                   "num_prompts": opts.num_prompts, "request_rate": opts.request_rate,
                   "calibration_prompts": opts.calibration_prompts, "repeats": opts.repeats},
                  f, indent=1)


def print_table(rows: list[dict]) -> None:
    """Predicted vs the measured runs' median; ``repeats``: how far apart the measured runs were
    (the widest of the five figures' max/min - 1)."""
    head = (f"{'config':<16}{'steps':>8}{'repeats':>9}"
            + "".join(f"{name:>24}" for _, name in FIGURES))
    print("\n" + head + "\n" + f"{'':<16}{'/model':>8}{'apart':>9}"
          + "".join(f"{'pred / meas / err':>24}" for _ in FIGURES))
    for r in rows:
        cells = [f"{r['measured_step_over_model']:>8.2f}",
                 f"{max(r['measured_spread'].values()):>9.0%}"]
        for key, _ in FIGURES:
            pred, meas = r["predicted"][key], r["measured"][key]
            scale = 1 if key == "output_throughput" else 1e-3  # ms -> s
            cells.append(f"{pred * scale:>8.1f} {meas * scale:>7.1f} {pred / meas - 1:>+6.0%}")
        print(f"{r['label']:<16}{cells[0]}{cells[1]}" + "".join(f"{c:>24}" for c in cells[2:]))


if __name__ == "__main__":
    main()
