"""``conveyor bench simulate``: ``bench serve``'s workload through the real scheduler in virtual
time, on this machine's fitted step cost or a named accelerator's roofline.

The same flags as ``bench serve`` for the traffic (or ``--trace``, a recorded one) and as
``conveyor serve`` for batching; one run per ``--policy`` x ``--max-num-seqs``; the same report,
result JSON and plots as ``bench serve`` and ``bench compare``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import time

from conveyor.bench.compare import (
    DEFAULT_KV_MEMORY,
    add_batching_args,
    format_table,
    policy_ratios,
    write_summary,
)
from conveyor.bench.cost_model import FittedCost
from conveyor.bench.datasets import read_jsonl
from conveyor.bench.metrics import parse_goodput
from conveyor.bench.roofline import RooflineCost, accelerator, model_config
from conveyor.bench.serve import (
    add_save_detailed_arg,
    add_workload_args,
    arrival_gaps,
    build_workload,
    parse_selection,
    report,
    save_result,
    saved,
)
from conveyor.bench.simulated_engine import EngineSettings, SimulatedRequest, Simulator
from conveyor.core.scheduler import SchedulerConfig
from conveyor.model.config import ModelConfig

TRACE_BLOCK_TOKENS = 512  # tokens each of a Mooncake trace's hash_ids stands for


def add_cost_args(p: argparse.ArgumentParser) -> None:
    """Which step-cost model stands in for the forward pass."""
    g = p.add_argument_group("step cost")
    g.add_argument("--cost-model", default=None, metavar="FILE",
                   help="this machine's fitted step cost (from `conveyor bench profile`)")
    g.add_argument("--accelerator", default=None,
                   help="a roofline instead: H100-SXM (H100), H100-PCIe, H200, A100-80GB (A100), "
                        "A100-40GB, L40S, L4")
    g.add_argument("--model-config", default=None,
                   help="for --accelerator: llama-3-8b, llama-3-70b, smollm2-135m, or a model "
                        "file or folder (default: --model's)")
    g.add_argument("--compute-efficiency", type=float, default=0.6,
                   help="share of the peak bf16 FLOP/s a step reaches")
    g.add_argument("--bandwidth-efficiency", type=float, default=0.8,
                   help="share of the peak memory bandwidth a step reaches")
    g.add_argument("--step-overhead-ms", type=float, default=1.0,
                   help="fixed time of every step")
    g.add_argument("--request-overhead-ms", type=float, default=0.01,
                   help="per request in a step")
    g.add_argument("--weight-bits", type=int, default=16,
                   help="bits a weight the model reads (16: bfloat16, 4: Q4)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the accelerator's memory for weights and KV (vLLM's)")


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="replay a recorded trace instead (JSONL as Mooncake's: timestamp in ms, "
                        "input_length, output_length, optional hash_ids of 512-token blocks); "
                        "all its rows")
    add_batching_args(p)
    p.add_argument("--policy", "--policies", dest="policies", nargs="+", default=["continuous"],
                   choices=["static", "continuous"],
                   help="the batching policies simulated")
    p.add_argument("--max-num-seqs", type=int, nargs="+", default=[64],
                   help="batch sizes: one run each, per policy")
    p.add_argument("--save-result", action="store_true",
                   help="also save each run's result as `bench serve` does")
    p.add_argument("--result-filename", default=None, help="for --save-result of one run")
    add_save_detailed_arg(p)
    add_cost_args(p)


def step_cost(args: argparse.Namespace) -> FittedCost | RooflineCost:
    if (args.cost_model is None) == (args.accelerator is None):
        raise ValueError("give --cost-model FILE (from `conveyor bench profile`) or "
                         "--accelerator NAME, one of them")
    if args.cost_model is not None:
        return FittedCost.load(args.cost_model)
    return RooflineCost(accelerator(args.accelerator),
                        model_config(args.model_config or args.model), args.compute_efficiency,
                        args.bandwidth_efficiency, args.step_overhead_ms / 1e3,
                        args.request_overhead_ms / 1e3, args.weight_bits)


def simulated_model(args: argparse.Namespace, cost) -> ModelConfig:
    """The roofline's model, or the one the fitted cost was profiled on (read once: a GGUF's
    metadata takes seconds to parse)."""
    if isinstance(cost, RooflineCost):
        return cost.model
    from conveyor.model.loader import load_config

    return load_config(args.model or cost.source.get("model"))


def kv_pool(args: argparse.Namespace, cost, config: ModelConfig) -> tuple[int, int]:
    """Pages in the pool and max_model_len, as the engine would size them."""
    from conveyor.config import parse_memory

    if args.num_kv_blocks and args.kv_cache_memory:
        raise ValueError("give --num-kv-blocks or --kv-cache-memory, not both")
    if args.kv_cache_memory or not isinstance(cost, RooflineCost):
        memory = parse_memory(args.kv_cache_memory or DEFAULT_KV_MEMORY)
    else:
        memory = cost.kv_cache_bytes(args.gpu_memory_utilization)
    num_blocks = args.num_kv_blocks or memory // (cost.kv_bytes_per_token * args.block_size)
    max_len = args.max_model_len or min(config.max_position_embeddings,
                                        num_blocks * args.block_size)
    return num_blocks, max_len


def prompt_ids(tokenizer, endpoint: str, text: str) -> list[int]:
    """The prompt's token ids as the server makes them."""
    if endpoint == "/v1/chat/completions":
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(text)


def workload_requests(args: argparse.Namespace, tokenizer) -> list[SimulatedRequest]:
    """``bench serve``'s workload and arrival times (request i is sent after the first i gaps)."""
    workload = build_workload(args, tokenizer)
    gaps = arrival_gaps(len(workload), args.request_rate, args.burstiness, args.seed)
    out, t = [], 0.0
    for req, gap in zip(workload, gaps):
        out.append(SimulatedRequest(t, prompt_ids(tokenizer, args.endpoint, req.prompt),
                                    req.output_len))
        t += gap
    return out


def trace_requests(path: str, vocab_size: int, seed: int) -> list[SimulatedRequest]:
    """A Mooncake-style trace: blocks with the same hash id have the same tokens, so they share
    prefix pages; the rest of each prompt is its own."""
    rows = list(read_jsonl(
        path, '{"timestamp": ms, "input_length": n, "output_length": n}',
        lambda row: (float(row["timestamp"]) / 1e3, int(row["input_length"]),
                     int(row["output_length"]), [int(h) for h in row.get("hash_ids", [])])))
    if not rows:
        raise ValueError(f"{path}: no requests")
    start = min(r[0] for r in rows)
    rng = random.Random(seed)
    blocks: dict[int, list[int]] = {}
    out = []
    for t, n_in, n_out, hashes in rows:
        ids = []
        for h in hashes:
            if h not in blocks:
                blocks[h] = [rng.randrange(vocab_size) for _ in range(TRACE_BLOCK_TOKENS)]
            ids += blocks[h]
        ids = ids[:n_in] + [rng.randrange(vocab_size) for _ in range(n_in - len(ids))]
        out.append(SimulatedRequest(t - start, ids, n_out))
    return out


def simulate_run(args: argparse.Namespace, requests: list[SimulatedRequest], cost,
                 pool: tuple[int, int], policy: str, max_num_seqs: int,
                 max_num_batched_tokens: int, label: str) -> dict:
    """One configuration (``pool``: ``kv_pool``'s pages and max_model_len): its report printed,
    and the run as ``bench compare`` records one."""
    selected, percentiles = parse_selection(args)
    num_blocks, max_len = pool
    settings = EngineSettings(
        SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_len, policy,
                        args.scheduling_policy),
        num_blocks, args.block_size, args.kv_layout, args.enable_prefix_caching)
    print(f"\n### {label} (simulated: {cost.describe()}; {num_blocks} KV pages of "
          f"{args.block_size} tokens)", flush=True)
    started = time.perf_counter()
    sim = Simulator(settings, cost, args.max_concurrency).run(requests)
    wall = time.perf_counter() - started
    result = report(args, "simulated", sim.results, sim.duration, selected, percentiles,
                    parse_goodput(args.goodput), base_url=f"simulated: {cost.describe()}")
    print(f"simulated {len(requests)} requests, {len(sim.steps)} steps, "
          f"{sim.num_preemptions} preemptions in {wall:.2f} s of wall time")
    return {"label": label, "max_num_seqs": max_num_seqs, "result": result,
            "steps": [dataclasses.asdict(s) for s in sim.steps], "wall_seconds": wall}


def simulate(args: argparse.Namespace) -> dict:
    from conveyor.model.loader import load_tokenizer

    cost = step_cost(args)
    config = simulated_model(args, cost)
    pool = kv_pool(args, cost, config)
    if args.trace:
        requests = trace_requests(args.trace, config.vocab_size, args.seed)
        args.dataset_name = "trace"
    else:
        requests = workload_requests(args, load_tokenizer(args.tokenizer or args.model))
        if not args.ignore_eos:
            print("note: the simulator generates every request's max_tokens, as with "
                  "--ignore-eos", flush=True)
    os.makedirs(args.result_dir, exist_ok=True)
    runs = []
    for seqs in args.max_num_seqs:
        for policy in args.policies:
            label = f"{policy}/{seqs}"
            runs.append(simulate_run(args, requests, cost, pool, policy, seqs,
                                     args.max_num_batched_tokens, label))
            if args.save_result:
                save_result(args, saved(runs[-1]["result"], args.save_detailed),
                            f"simulate-{policy}-{seqs}.json")
    print("\n" + format_table(runs))
    ideal, predicted = policy_ratios(runs, [r.output_len for r in requests], args.max_num_seqs,
                                     "simulated")
    summary = {"cost_model": cost.describe(), "runs": runs, "ideal_ratio": ideal,
               "predicted_ratio": predicted}
    return write_summary(summary, args, "simulate.json")
