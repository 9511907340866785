"""``conveyor bench serve|compare|tune``."""

from __future__ import annotations

from conveyor.bench.compare import add_compare_args, compare
from conveyor.bench.serve import add_serve_args, benchmark
from conveyor.bench.tune import add_tune_args, tune


def add_bench_parser(sub) -> None:
    """Each subcommand's parser carries its ``handler``."""
    bench = sub.add_parser("bench", help="serving benchmarks")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    for name, add_args, handler, help_text in (
            ("serve", add_serve_args, benchmark,
             "load-test any OpenAI-compatible server (vLLM's bench serve flags)"),
            ("compare", add_compare_args, compare,
             "the same workload against Conveyor per policy / max-num-seqs"),
            ("tune", add_tune_args, tune,
             "sweep max-num-seqs and recommend one for a latency target")):
        parser = kinds.add_parser(name, help=help_text)
        add_args(parser)
        parser.set_defaults(handler=handler)
