"""What a narrow KV cache (``--kv-cache-dtype int8``, or float16 for a float32 model) saves: the
pool's bytes a token, and decode speed where reading the cache is a step's largest cost (many
requests with long prompts).

For each KV dtype, in one run: ``--batch`` requests of ``--context`` random prompt tokens are
prefilled (timed), then ``--steps`` decode steps of all of them are timed (the median step gives
tokens a second). Rounds alternate the dtypes so that the machine's drift falls on both.
With ``--kernel``, instead, the decode attention kernel alone on random caches of the
Llama-3.2-1B shape (32 query and 8 KV heads of 64), in the tier's dtype: milliseconds a layer
in each storage it reads.

    .venv/bin/python benchmarks/kv_cache_dtype.py --model 1b.gguf --batch 32 --context 2048
    .venv/bin/python benchmarks/kv_cache_dtype.py --model 1b.gguf --kv float32 float16 int8
    .venv/bin/python benchmarks/kv_cache_dtype.py --kernel --batch 32 --context 2048
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conveyor import SamplingParams  # noqa: E402
from conveyor.config import KV_CACHE_DTYPES, EngineConfig  # noqa: E402
from conveyor.engine.engine import LLMEngine  # noqa: E402
from conveyor.kernels import isa  # noqa: E402
from conveyor.kernels.library import cpu_kernels  # noqa: E402
from conveyor.model.kv_cache import stored  # noqa: E402
from conveyor.worker.runner import kv_bytes_per_block  # noqa: E402


def run(args: argparse.Namespace, kv: str) -> dict:
    # the first requests decode while the last ones prefill (one prompt a step): every request
    # must still be running, all of them decode rows, through the timed steps
    outputs = args.batch + args.steps + 8
    pages = args.batch * (-(-(args.context + outputs) // 16))
    engine = LLMEngine(EngineConfig(
        model=args.model, kv_cache_dtype=kv, max_num_seqs=args.batch,
        max_num_batched_tokens=2048, enable_prefix_caching=False, num_kv_blocks=pages,
        max_model_len=args.context + outputs, threads=args.threads))
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    for i in range(args.batch):
        engine.add_request(str(i), torch.randint(100, vocab, (args.context,),
                                                 generator=gen).tolist(),
                           SamplingParams(temperature=0, max_tokens=outputs,
                                          ignore_eos=True))
    start = time.perf_counter()
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    prefill = time.perf_counter() - start
    times = []
    for _ in range(args.steps):
        assert len(engine.scheduler.running) == args.batch, "a timed step without every request"
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    step = statistics.median(times)
    result = {"kv_cache_dtype": kv, "kv_storage": str(engine.kv_dtype).removeprefix("torch."),
              "kv_bytes_per_token": kv_bytes_per_block(engine.model_config, 1, engine.kv_dtype),
              "prefill_s": round(prefill, 2), "prompt_tok_s": round(
                  args.batch * args.context / prefill, 1),
              "decode_step_ms": round(step * 1e3, 2), "decode_tok_s": round(args.batch / step, 1)}
    engine.shutdown()
    print(json.dumps(result), flush=True)
    return result


def kernel(args: argparse.Namespace, repeats: int = 5) -> None:
    """The decode attention kernel alone, on the machine's tier in its dtype (bfloat16 where it
    computes it, else float32), reading caches of that dtype, float16 (of float32) and int8."""
    heads, kv_heads, dim, block_size = 32, 8, 64, 16
    dtype = torch.bfloat16 if isa.current().native_bf16 else torch.float32
    attend = cpu_kernels(torch.device("cpu"), dtype, dim).decode_attention
    pages = args.context // block_size
    gen = torch.Generator().manual_seed(0)
    wide = [torch.randn(args.batch * pages, block_size, kv_heads, dim, generator=gen).to(dtype)
            for _ in range(2)]
    tables = torch.randperm(args.batch * pages, generator=gen).view(args.batch, pages).int()
    lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    q = torch.randn(args.batch, heads, dim, generator=gen).to(dtype)
    out = torch.empty_like(q)
    storages = [dtype, torch.float16, torch.int8] if dtype == torch.float32 else [dtype, torch.int8]
    for _ in range(args.rounds):
        for storage in storages:
            name = str(storage).removeprefix("torch.")
            k, v = (stored(c, storage) for c in wide)
            attend(q, k, v, tables, lens, out)
            start = time.perf_counter()
            for _ in range(repeats):
                attend(q, k, v, tables, lens, out)
            ms = (time.perf_counter() - start) / repeats * 1e3
            print(f"{name:>8}: {ms:6.2f} ms a layer, {2 * k.nbytes / ms / 1e6:5.1f} GB/s read")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file or Hugging Face folder "
                   "(default: the default model)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=2048, help="prompt tokens a request")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--kv", nargs="+", default=["auto", "int8"], choices=KV_CACHE_DTYPES)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the figures here too")
    p.add_argument("--kernel", action="store_true", help="time the attention kernel alone")
    args = p.parse_args()
    if args.kernel:
        kernel(args)
        return
    print(f"cpu: {isa.current().describe()}; {torch.get_num_threads()} threads; model "
          f"{args.model or 'default'}; {args.batch} requests x {args.context} prompt tokens",
          flush=True)
    runs = [run(args, kv) for _ in range(args.rounds) for kv in args.kv]
    summary = {}
    for kv in args.kv:
        mine = [r for r in runs if r["kv_cache_dtype"] == kv]
        summary[kv] = {k: statistics.median(r[k] for r in mine)
                       for k in ("kv_bytes_per_token", "prompt_tok_s", "decode_tok_s")}
    base = summary[args.kv[0]]
    for kv, s in summary.items():
        print(f"{kv:>8}: {s['kv_bytes_per_token']:>7.0f} KV bytes a token "
              f"({s['kv_bytes_per_token'] / base['kv_bytes_per_token']:.2f}x), decode "
              f"{s['decode_tok_s']:>7.1f} tok/s ({s['decode_tok_s'] / base['decode_tok_s']:.2f}x), "
              f"prompts {s['prompt_tok_s']:>7.1f} tok/s "
              f"({s['prompt_tok_s'] / base['prompt_tok_s']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
