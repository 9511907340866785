"""``conveyor bench profile``: measure this machine's step cost and fit the simulator's model of it.

Either over a grid, in this process (``--batch-sizes`` requests at each of ``--context-lens``:
their prompt steps, ``--decode-steps`` decode steps, then one step each with a prompt of each of
``--prefill-chunks`` tokens joining the decodes; greedy, as ``bench serve`` asks), or from a live
server's ``/v1/engine/steps`` (``--base-url``: whatever traffic it has served, with the server's
own time between steps, which the grid's engine alone does not pay). Every step taken is a
sample; the fit's form is ``cost_model.FittedCost``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import random

import httpx
from tqdm import tqdm

from conveyor.bench.cost_model import FittedCost, StepShape, live_samples


def add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None,
                   help="fit a live server's recorded steps instead of measuring here")
    p.add_argument("--model", default=None, help="model to measure (default model)")
    p.add_argument("--dtype", default="auto",
                   help="the model's dtype")
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads (default: the cores)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="the step budget: prompts are chunked as the served engine chunks them")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                   help="decode batches timed")
    p.add_argument("--context-lens", type=int, nargs="+", default=[32, 128, 512],
                   help="context lengths of the decode batches")
    p.add_argument("--prefill-chunks", type=int, nargs="+", default=[16, 128, 512],
                   help="prompt chunk lengths timed")
    p.add_argument("--decode-steps", type=int, default=4,
                   help="steps timed at each point")
    p.add_argument("--seed", type=int, default=0,
                   help="the prompts' random seed")
    p.add_argument("--output", default="step-cost.json",
                   help="the fitted cost model's file (for bench simulate --cost-model)")


def machine() -> str:
    """The CPU's model name (what the figures are from)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def grid_samples(args: argparse.Namespace) -> tuple[list, dict, int]:
    """Steps of an engine in this process over the grid."""
    from conveyor.config import EngineConfig
    from conveyor.engine.engine import LLMEngine
    from conveyor.kernels import isa
    from conveyor.sampling_params import SamplingParams
    from conveyor.worker.runner import kv_bytes_per_block

    batches, chunks = sorted(args.batch_sizes), sorted(args.prefill_chunks)
    longest = max(args.context_lens) + args.decode_steps + len(chunks) + 2
    engine = LLMEngine(EngineConfig(
        model=args.model, dtype=args.dtype, threads=args.threads,
        max_num_seqs=batches[-1] + 1, max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=(batches[-1] * longest + chunks[-1]) // 16 + batches[-1] + 2,
        max_model_len=max(longest, chunks[-1] + 1), enable_prefix_caching=False))
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    ids = iter(range(10**9))

    def add(prompt_len: int, max_tokens: int) -> str:
        rid = f"p{next(ids)}"
        engine.add_request(rid, [rng.randrange(vocab) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                          temperature=0.0))  # greedy, as bench serve asks
        return rid

    def run(rids: list[str]) -> None:
        """Step until each of ``rids`` has a token (or has finished)."""
        pending = set(rids)
        while pending:
            pending -= {o.request_id for o in engine.step()}

    run([add(8, 1)])  # warm-up, not a sample
    first = engine.num_steps
    grid = [(context, batch) for context in args.context_lens for batch in batches]
    for context, batch in tqdm(grid, desc="profile (context, batch) points", unit="point"):
        rids = [add(context, args.decode_steps + len(chunks) + 2) for _ in range(batch)]
        run(rids)
        for _ in range(args.decode_steps):
            engine.step()
        for n in chunks:
            run([add(n, 1)])
        for rid in rids:
            engine.abort_request(rid)
    samples = [(StepShape.of_record(dataclasses.asdict(r)), r.duration)
               for r in engine.steps_since(first) if r.num_scheduled]
    source = {"from": "grid", "machine": machine(), "cpu_isa": isa.current().describe(),
              "model": engine.model_path, "dtype": str(engine.dtype).removeprefix("torch."),
              "threads": args.threads, "kernels": engine.runner.kernel_path}
    per_token = kv_bytes_per_block(engine.model_config, 1, engine.kv_dtype)
    engine.shutdown()
    return samples, source, per_token


def live_server_samples(base_url: str) -> tuple[list, dict, int]:
    """The steps a live server has recorded, and what they ran."""
    import torch

    from conveyor.model.loader import load_config
    from conveyor.worker.runner import kv_bytes_per_block

    base = base_url.rstrip("/")
    steps = httpx.get(base + "/v1/engine/steps", params={"since": 0}, timeout=60)
    steps.raise_for_status()
    version = httpx.get(base + "/version", timeout=30).json()
    model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["root"]
    source = {"from": base + "/v1/engine/steps", "machine": version["cpu_isa_reason"],
              "model": model, "dtype": version["dtype"], "kernels": version["kernels"]}
    per_token = kv_bytes_per_block(load_config(model), 1,
                                   getattr(torch, version["kv_cache_dtype"]),
                                   version["tensor_parallel_size"])
    return live_samples(steps.json()["steps"]), source, per_token


def profile(args: argparse.Namespace) -> FittedCost:
    if args.base_url:
        samples, source, per_token = live_server_samples(args.base_url)
    else:
        samples, source, per_token = grid_samples(args)
    cost = FittedCost.fit(samples, source, per_token)
    print(f"fitted {cost.num_samples} steps ({source['from']}): step = {cost.describe()}; "
          f"median error {cost.median_relative_error:.1%}")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    cost.save(args.output)
    print(f"wrote {args.output}")
    return cost
