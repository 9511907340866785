"""Serving metrics exactly as vLLM's ``bench serve`` defines them.

- TTFT: send to first streamed text.
- TPOT (per request): (latency - TTFT) / (output tokens - 1), for requests with > 1 token.
- ITL: every gap between consecutive streamed text chunks, pooled over requests.
- E2EL: send to end of stream.
- Goodput: completed requests meeting every given SLO (ms), per second of benchmark.
Percentiles are numpy's (linear interpolation); times are reported in ms.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from conveyor.bench.client import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "e2el:3000"] -> {"ttft": 500.0, "e2el": 3000.0} (milliseconds)."""
    slos = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in GOODPUT_METRICS or not value:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {GOODPUT_METRICS}, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of ms") from None
        if slos[name] <= 0:
            raise ValueError(f"--goodput {item!r}: the target must be positive")
    return slos


def request_tpot(r: RequestResult) -> float | None:
    if r.output_tokens <= 1:
        return None
    return (r.latency - r.ttft) / (r.output_tokens - 1)


@dataclass
class BenchmarkMetrics:
    summary: dict        # the scalar figures, vLLM's JSON keys
    samples: dict        # per-metric lists of values in ms, for plots


def compute_metrics(results: list[RequestResult], duration: float,
                    selected: tuple[str, ...] = METRICS,
                    percentiles: tuple[float, ...] = (50, 90, 95, 99),
                    goodput: dict[str, float] | None = None) -> BenchmarkMetrics:
    ok = [r for r in results if r.success]
    values = {
        "ttft": [r.ttft * 1000 for r in ok],
        "tpot": [t * 1000 for r in ok if (t := request_tpot(r)) is not None],
        "itl": [g * 1000 for r in ok for g in r.itl],
        "e2el": [r.latency * 1000 for r in ok],
    }
    good = 0
    for r in ok:
        measured = {"ttft": r.ttft * 1000, "tpot": (request_tpot(r) or 0.0) * 1000,
                    "e2el": r.latency * 1000}
        if all(measured[k] <= v for k, v in (goodput or {}).items()):
            good += 1
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    summary = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if goodput else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    for name in selected:
        v = np.array(values[name]) if values[name] else np.zeros(1)
        summary[f"mean_{name}_ms"] = float(v.mean())
        summary[f"median_{name}_ms"] = float(np.median(v))
        summary[f"std_{name}_ms"] = float(v.std())
        for p in percentiles:
            summary[f"p{p:g}_{name}_ms"] = float(np.percentile(v, p))
    return BenchmarkMetrics(summary, values)


def format_report(m: BenchmarkMetrics, selected: tuple[str, ...],
                  percentiles: tuple[float, ...]) -> str:
    s = m.summary
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Benchmark duration (s):", f"{s['duration']:.2f}"),
            ("Total input tokens:", s["total_input_tokens"]),
            ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}")]
    if s["request_goodput"] is not None:
        rows.append(("Request goodput (req/s):", f"{s['request_goodput']:.2f}"))
    rows += [("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
             ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{k:<44}{v:>16}" for k, v in rows]
    for name in selected:
        lines.append("{s:{c}^60}".format(s=f" {METRIC_NAMES[name]} ", c="-"))
        lines.append(f"{'Mean ' + name.upper() + ' (ms):':<44}{s[f'mean_{name}_ms']:>16.2f}")
        lines.append(f"{'Median ' + name.upper() + ' (ms):':<44}{s[f'median_{name}_ms']:>16.2f}")
        for p in percentiles:
            lines.append(f"{f'P{p:g} ' + name.upper() + ' (ms):':<44}{s[f'p{p:g}_{name}_ms']:>16.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)
