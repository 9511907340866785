"""``conveyor bench serve``: replay a workload against any OpenAI-compatible server.

Flag names and metric definitions follow vLLM's ``vllm bench serve``, so results compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time

import httpx
import numpy as np
from tqdm import tqdm

from conveyor.bench.client import ENDPOINTS, RequestResult, send_request
from conveyor.bench.datasets import (BenchRequest, conversation_dataset, jsonl_dataset,
                                     random_dataset)
from conveyor.bench.metrics import METRICS, compute_metrics, format_report, parse_goodput

# a result's lists with an entry per request (as vLLM's bench serve names them)
PER_REQUEST = ("input_lens", "output_lens", "ttfts", "e2els", "itls", "errors")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The flags that define the traffic (shared by serve, compare and tune)."""
    p.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS,
                   help="the route every request goes to")
    p.add_argument("--tokenizer", default=None,
                   help="GGUF file or HF folder for counting tokens (default: the default model)")
    p.add_argument("--num-prompts", type=int, default=100,
                   help="requests in the run")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 is Poisson, < 1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="the most requests in flight at once (default: no limit)")
    p.add_argument("--dataset-name", default="random", choices=["random", "conversation", "jsonl"],
                   help="random: token ids of --random-*-len; conversation: built-in chats; "
                        "jsonl: --dataset-path")
    p.add_argument("--dataset-path", default=None, help="JSONL file for --dataset-name jsonl")
    p.add_argument("--random-input-len", type=int, default=256,
                   help="prompt tokens a request (random dataset)")
    p.add_argument("--random-output-len", type=int, default=128,
                   help="output tokens a request asks for")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn from len * [1 - r, 1 + r]")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate every asked token, past the end of text")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's (vLLM's default for the benchmark: 0, greedy)")
    p.add_argument("--top-p", type=float, default=None,
                   help="every request's top_p (default: the server's)")
    p.add_argument("--top-k", type=int, default=None,
                   help="every request's top_k (default: the server's)")
    p.add_argument("--min-p", type=float, default=None,
                   help="every request's min_p (default: the server's)")
    p.add_argument("--seed", type=int, default=0,
                   help="the workload's and the arrivals' random seed")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="the metrics reported with percentiles (ttft, tpot, itl, e2el)")
    p.add_argument("--metric-percentiles", default="50,90,95,99",
                   help="the percentiles reported")
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000")
    p.add_argument("--disable-tqdm", action="store_true",
                   help="no progress bar")


def server_url(text: str) -> str:
    """A server's root URL; a trailing ``/v1`` (the OpenAI client's base URL, a common slip)
    and slashes are dropped, as the routes are added to it."""
    url = text.rstrip("/")
    return url.removesuffix("/v1").rstrip("/")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, type=server_url,
                   help="the server's root (a trailing /v1 is accepted); default: --host and "
                        "--port")
    p.add_argument("--host", default="127.0.0.1", help="the server's host (vLLM's)")
    p.add_argument("--port", type=int, default=8000, help="the server's port (vLLM's)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    add_workload_args(p)
    p.add_argument("--save-result", action="store_true",
                   help="write the result as JSON (vLLM's bench serve format)")
    p.add_argument("--result-dir", default=".",
                   help="where --save-result writes")
    p.add_argument("--result-filename", default=None,
                   help="the JSON's name (default: bench-DATE.json)")
    add_save_detailed_arg(p)


def add_save_detailed_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--save-detailed", action="store_true",
                   help="the saved JSON keeps each request's lengths, latencies and error "
                        "(vLLM's), and bench compare's and simulate's each step's record")


def saved(result: dict, detailed: bool) -> dict:
    """A run's result as saved: vLLM drops the per-request lists unless ``--save-detailed``."""
    return result if detailed else {k: v for k, v in result.items() if k not in PER_REQUEST}


def build_workload(args: argparse.Namespace, tokenizer=None) -> list[BenchRequest]:
    from conveyor.model.loader import load_tokenizer

    tokenizer = tokenizer or load_tokenizer(args.tokenizer)
    if args.dataset_name == "conversation":
        return conversation_dataset(tokenizer, args.num_prompts, args.seed)
    if args.dataset_name == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset-name jsonl needs --dataset-path")
        return jsonl_dataset(tokenizer, args.dataset_path, args.num_prompts,
                             args.random_output_len)
    return random_dataset(tokenizer, args.num_prompts, args.seed, args.random_input_len,
                          args.random_output_len, args.random_range_ratio)


def parse_selection(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[float, ...]]:
    selected = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    unknown = set(selected) - set(METRICS)
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {sorted(unknown)} (known: {METRICS})")
    try:
        percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    except ValueError:
        raise ValueError(f"--metric-percentiles {args.metric_percentiles!r} is not a list of "
                         f"numbers") from None
    if not all(0 < p < 100 for p in percentiles):
        raise ValueError("--metric-percentiles must be in (0, 100)")
    return selected, percentiles


def request_fields(args: argparse.Namespace) -> dict:
    """The sampling fields every request carries: temperature, the filters given, and
    ``ignore_eos`` (vLLM's, llama.cpp's and Conveyor's extra field)."""
    fields = {"temperature": args.temperature}
    for name in ("top_p", "top_k", "min_p"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if args.ignore_eos:
        fields["ignore_eos"] = True
    return fields


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait after each request: gamma gaps with mean 1/rate (Poisson at shape 1)."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n).tolist()


async def run_load(base_url: str, endpoint: str, model: str, workload: list[BenchRequest],
                   gaps: list[float], max_concurrency: int | None, fields: dict,
                   show_progress: bool = True) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(6 * 3600.0, connect=30.0)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(workload), disable=not show_progress, desc="requests")

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        async def one(req: BenchRequest) -> RequestResult:
            if semaphore is None:
                result = await send_request(client, base_url, endpoint, model, req, fields)
            else:
                async with semaphore:
                    result = await send_request(client, base_url, endpoint, model, req, fields)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for req, gap in zip(workload, gaps):
            tasks.append(asyncio.create_task(one(req)))
            if gap:
                await asyncio.sleep(gap)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def served_model(base_url: str) -> str:
    """The server's first model; OSError (one line) where nothing there answers as an
    OpenAI-compatible server."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        resp = httpx.get(url, timeout=30)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise OSError(f"no OpenAI-compatible server answers at {url}: "
                      f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


def benchmark(args: argparse.Namespace, workload: list[BenchRequest] | None = None) -> dict:
    """Run the load, print vLLM's report and return the result dict (also saved if asked)."""
    selected, percentiles = parse_selection(args)
    slos = parse_goodput(args.goodput)
    workload = workload if workload is not None else build_workload(args)
    if args.base_url is None:
        args.base_url = f"http://{args.host}:{args.port}"
    model = args.model or served_model(args.base_url)
    gaps = arrival_gaps(len(workload), args.request_rate, args.burstiness, args.seed)
    results, duration = asyncio.run(run_load(args.base_url, args.endpoint, model, workload, gaps,
                                             args.max_concurrency, request_fields(args),
                                             not args.disable_tqdm))
    result = report(args, model, results, duration, selected, percentiles, slos)
    if args.save_result:
        save_result(args, saved(result, args.save_detailed), f"bench-{result['date']}.json")
    return result


def report(args: argparse.Namespace, model: str, results: list[RequestResult], duration: float,
           selected: tuple[str, ...], percentiles: tuple[float, ...], slos: dict[str, float],
           base_url: str | None = None) -> dict:
    """Print vLLM's report of a run and return its result dict (vLLM's JSON keys)."""
    metrics = compute_metrics(results, duration, selected, percentiles, slos)
    print(format_report(metrics, selected, percentiles))
    errors = sorted({r.error for r in results if not r.success})
    for e in errors[:5]:
        print(f"  failure: {e}")
    return {
        "date": time.strftime("%Y%m%d-%H%M%S"), "base_url": base_url or args.base_url,
        "endpoint": args.endpoint, "model": model, "num_prompts": len(results),
        "dataset_name": args.dataset_name, "request_rate": args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos, "sampling": request_fields(args),
        "goodput_slos_ms": slos, **metrics.summary,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results], "e2els": [r.latency for r in results],
        "itls": [r.itl for r in results], "errors": [r.error for r in results],
    }


def save_result(args: argparse.Namespace, result, default_name: str) -> None:
    """As JSON under ``--result-dir``, named ``--result-filename`` or ``default_name``."""
    os.makedirs(args.result_dir, exist_ok=True)
    path = os.path.join(args.result_dir, args.result_filename or default_name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"result saved to {path}")

