"""Offline throughput: continuous vs static batching vs transformers' generate, in one run.

The same seeded requests (random prompt tokens, 32-512 long; output lengths 16-512 from a
log-normal with a heavy tail; EOS ignored so every request runs to its own length) go through
``LLM.generate`` with each policy and through transformers' ``generate`` in static batches of
``--max-num-seqs``, where a batch runs until its longest request is done. Throughput counts only
the tokens each request asked for.

    .venv/bin/python benchmarks/offline_throughput.py --num-prompts 128 --max-num-seqs 32
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import time

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_requests(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(32, 512))]
        length = int(min(512, max(16, rng.lognormvariate(math.log(64), 0.9))))
        out.append((prompt, length))
    return out


def run_conveyor(requests, policy: str, args) -> float:
    from conveyor import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, policy=policy, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, threads=args.threads,
              kv_cache_memory=args.kv_cache_memory, device=args.device)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in requests]
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4)] * 2, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert tokens == sum(m for _, m in requests)
    preemptions = sum(o.metrics.num_preemptions for o in outputs)
    print(f"  conveyor {policy:10s}: {tokens} tokens in {elapsed:7.1f} s = "
          f"{tokens / elapsed:7.1f} tok/s ({preemptions} preemptions)", flush=True)
    del llm
    gc.collect()
    return tokens / elapsed


@torch.inference_mode()
def run_transformers(requests, args) -> float:
    import transformers

    from conveyor.config import EngineConfig
    from conveyor.model.loader import default_model_path

    path = args.model or default_model_path()
    config = EngineConfig(dtype=args.dtype, device=args.device)
    device = config.torch_device()
    dtype = config.torch_dtype(None, device)  # Conveyor's
    if path.endswith(".gguf"):
        kw = dict(gguf_file=os.path.basename(path))
        path = os.path.dirname(path)
    else:
        kw = {}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                              **kw).to(device).eval()
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    tokens, elapsed = 0, 0.0
    for i in range(0, len(requests), args.max_num_seqs):
        batch = requests[i:i + args.max_num_seqs]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        longest = max(m for _, m in batch)
        start = time.perf_counter()
        model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                       max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                       pad_token_id=pad)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed += time.perf_counter() - start
        tokens += sum(m for _, m in batch)
    print(f"  transformers static : {tokens} tokens in {elapsed:7.1f} s = "
          f"{tokens / elapsed:7.1f} tok/s", flush=True)
    return tokens / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-transformers", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    requests = make_requests(args.num_prompts, args.seed, vocab=49152)
    outs = np.array([m for _, m in requests])
    ins = np.array([len(p) for p, _ in requests])
    print(f"{len(requests)} requests, prompt tokens mean {ins.mean():.0f} (32-512), output tokens "
          f"mean {outs.mean():.0f} median {np.median(outs):.0f} max {outs.max()}, "
          f"batch {args.max_num_seqs}, dtype {args.dtype}, torch threads {torch.get_num_threads()}")
    cont = run_conveyor(requests, "continuous", args)
    static = run_conveyor(requests, "static", args)
    print(f"continuous / static        = {cont / static:.2f}x")
    if not args.skip_transformers:
        hf = run_transformers(requests, args)
        print(f"continuous / transformers  = {cont / hf:.2f}x")
        print(f"static / transformers      = {static / hf:.2f}x")


if __name__ == "__main__":
    main()
