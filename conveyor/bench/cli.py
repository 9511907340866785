"""``conveyor bench serve|compare|tune|simulate|profile|overload|soak``."""

from __future__ import annotations

from conveyor.bench.compare import add_compare_args, compare
from conveyor.bench.profile import add_profile_args, profile
from conveyor.bench.serve import add_serve_args, benchmark
from conveyor.bench.simulate import add_simulate_args, simulate
from conveyor.bench.stress import add_overload_args, add_soak_args, overload, soak
from conveyor.bench.tune import add_tune_args, tune
from conveyor.settings import DefaultsHelp


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
             "sweep max-num-seqs and recommend one for a latency target"),
            ("simulate", add_simulate_args, simulate,
             "the same workload through the real scheduler in virtual time (fitted step cost "
             "or an accelerator's roofline)"),
            ("profile", add_profile_args, profile,
             "measure this machine's step cost (or read a live server's) and fit it for "
             "simulate"),
            ("overload", add_overload_args, overload,
             "far more streams than seats at once: each completes or is refused quickly"),
            ("soak", add_soak_args, soak,
             "many short mixed requests, with disconnects and bad ones: nothing lost")):
        parser = kinds.add_parser(name, help=help_text, formatter_class=DefaultsHelp)
        add_args(parser)
        parser.set_defaults(handler=handler)
