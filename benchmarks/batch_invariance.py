"""Batch invariance (``--batch-invariant``): what it costs, and the new-user check it is for.

1. The new-user check: the same seeded request sent twice, the second reusing the first one's
   cached prompt pages (prefix caching on, the default): how many of 4 pairs are identical,
   without and with the flag.
2. Throughput, without and with the flag, alternated (``--repeats`` runs each), in one process:
   ``--num-prompts`` requests at once with ``--max-num-seqs`` running, random prompt tokens of
   ``--prompt-len`` and ``--output-len`` greedy (or ``--temperature``) tokens each, EOS
   ignored. Prints output tok/s for each run, the medians and their ratio.

    .venv/bin/python benchmarks/batch_invariance.py --model 1b.gguf --max-num-seqs 32
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PAIRS = ["Write a short poem about the sea and the wind over the harbour at night.",
         "Explain how a paged KV cache works in an inference server, step by step.",
         "List three facts about the planet Mars and why they matter for explorers.",
         "Tell me a story about a cat who learns to play the piano in a small town."]


def seeded_pairs(llm) -> int:
    """Pairs of the same seeded request, one after the other, with identical tokens."""
    from conveyor import SamplingParams

    same = 0
    for prompt in PAIRS:
        params = SamplingParams(temperature=0.8, seed=1234, max_tokens=48)
        a, b = (llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
                for _ in range(2))
        same += a == b
    return same


def throughput(llm, args, vocab: int) -> float:
    from conveyor import SamplingParams

    rng = random.Random(args.seed)
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.prompt_len)]}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=args.temperature, seed=None, max_tokens=args.output_len,
                            ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-pairs", action="store_true", help="throughput only")
    args = p.parse_args()

    from conveyor import LLM

    def engine(invariant: bool) -> LLM:
        return LLM(args.model, batch_invariant=invariant, max_num_seqs=args.max_num_seqs,
                   max_model_len=args.prompt_len + args.output_len + 64)

    rates = {False: [], True: []}
    for _ in range(args.repeats):
        for invariant in (False, True):
            llm = engine(invariant)
            vocab = llm.engine.runner.config.vocab_size
            llm.generate([{"prompt_token_ids": [100] * 8}], use_tqdm=False)  # warm-up
            rates[invariant].append(throughput(llm, args, vocab))
            print(f"batch_invariant={invariant!s:5}: {rates[invariant][-1]:7.1f} output tok/s",
                  flush=True)
            del llm
            gc.collect()
    off, on = (statistics.median(rates[k]) for k in (False, True))
    print(f"medians: off {off:.1f}, on {on:.1f} tok/s; on / off = {on / off:.3f}")
    if not args.skip_pairs:
        for invariant in (False, True):
            llm = engine(invariant)
            print(f"seeded pairs identical, prefix caching on, batch_invariant={invariant}: "
                  f"{seeded_pairs(llm)} of {len(PAIRS)}", flush=True)
            del llm
            gc.collect()


if __name__ == "__main__":
    main()
