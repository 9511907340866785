"""``conveyor bench serve|compare|tune``."""

from __future__ import annotations

import argparse


def add_bench_parser(sub) -> None:
    from conveyor.bench.compare import add_compare_args
    from conveyor.bench.serve import add_serve_args
    from conveyor.bench.tune import add_tune_args

    bench = sub.add_parser("bench", help="serving benchmarks")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    add_serve_args(kinds.add_parser(
        "serve", help="load-test any OpenAI-compatible server (vLLM's bench serve flags)"))
    add_compare_args(kinds.add_parser(
        "compare", help="the same workload against Conveyor per policy / max-num-seqs"))
    add_tune_args(kinds.add_parser(
        "tune", help="sweep max-num-seqs and recommend one for a latency target"))


def run_bench(args: argparse.Namespace) -> None:
    if args.bench_command == "serve":
        from conveyor.bench.serve import benchmark
        benchmark(args)
    elif args.bench_command == "compare":
        from conveyor.bench.compare import compare
        compare(args)
    else:
        from conveyor.bench.tune import tune
        tune(args)
