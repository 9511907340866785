"""What paging saves: the same conversation workload in the same KV memory, paged vs contiguous
(``--kv-layout contiguous``: each request reserves max_model_len tokens when admitted, as static
serving stacks do), offline through the engine, with prefix caching off in both.

Per layout it prints how many requests ran at once (mean over the steps where requests were kept
waiting, i.e. where memory or seats were the limit, and the peak), output tokens/s, preemptions,
and the KV waste averaged over steps: pages allocated but holding no token / pages allocated, and
the stricter token-level figure (token slots allocated but empty / allocated).

    .venv/bin/python benchmarks/kv_layout.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conveyor.bench.datasets import conversation_dataset  # noqa: E402
from conveyor.config import EngineConfig  # noqa: E402
from conveyor.core.kv_cache_manager import cdiv  # noqa: E402
from conveyor.engine.engine import LLMEngine  # noqa: E402
from conveyor.model.loader import load_tokenizer  # noqa: E402
from conveyor.sampling_params import SamplingParams  # noqa: E402


def run(layout: str, args, workload) -> dict:
    engine = LLMEngine(EngineConfig(
        model=args.model, dtype=args.dtype, num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, kv_layout=layout,
        enable_prefix_caching=False))
    for i, (ids, out_len) in enumerate(workload):
        engine.add_request(str(i), ids, SamplingParams(temperature=0, max_tokens=out_len,
                                                       ignore_eos=True))
    sched, bs = engine.scheduler, engine.scheduler.kv.block_size
    held_back, page_waste, token_waste = [], [], []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        allocated = sched.kv.pool.num_used_blocks
        if allocated:
            tokens = sum(r.num_computed_tokens for r in sched.running)
            pages = sum(cdiv(r.num_computed_tokens, bs) for r in sched.running)
            page_waste.append(1 - pages / allocated)
            token_waste.append(1 - tokens / (allocated * bs))
        if sched.waiting:
            held_back.append(len(sched.running))
    elapsed = time.perf_counter() - start
    output_tokens = sum(n for _, n in workload)
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks, "KV pages leaked"
    return {"layout": layout, "mean_running": statistics.mean(held_back) if held_back else 0.0,
            "peak_running": max(s.num_running for s in engine.steps),
            "tok_s": output_tokens / elapsed, "preemptions": sched.num_preemptions_total,
            "page_waste": statistics.mean(page_waste), "token_waste": statistics.mean(token_waste),
            "steps": engine.num_steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--num-kv-blocks", type=int, default=1024,
                   help="the shared budget: 1024 pages x 16 tokens = 8 regions of 2048")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    tokenizer = load_tokenizer(args.model)
    workload = []
    for req in conversation_dataset(tokenizer, args.num_prompts, args.seed):
        ids = tokenizer.encode(req.prompt, add_special_tokens=False)
        workload.append((ids, min(req.output_len, args.max_model_len - len(ids))))
    rows = [run(layout, args, workload) for layout in ("paged", "contiguous")]
    print(f"\n{args.num_prompts} conversation requests, {args.num_kv_blocks} KV pages "
          f"({args.num_kv_blocks * 16} tokens), max_model_len {args.max_model_len}, "
          f"max_num_seqs {args.max_num_seqs}")
    print(f"{'layout':<12}{'running (mean)':>15}{'peak':>6}{'out tok/s':>11}{'preempt.':>10}"
          f"{'page waste':>12}{'token waste':>13}{'steps':>7}")
    for r in rows:
        print(f"{r['layout']:<12}{r['mean_running']:>15.1f}{r['peak_running']:>6}"
              f"{r['tok_s']:>11.1f}{r['preemptions']:>10}{r['page_waste']:>11.1%}"
              f"{r['token_waste']:>12.1%}{r['steps']:>7}")
    paged, contiguous = rows
    print(f"requests at once, paged/contiguous: {paged['mean_running'] / contiguous['mean_running']:.2f}x "
          f"(peak {paged['peak_running'] / contiguous['peak_running']:.2f}x); output tok/s "
          f"{paged['tok_s'] / contiguous['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
