"""How far ``--quantization`` moves a Hugging Face folder's greedy output from transformers'.

The folder's model in float32 (transformers, with its KV cache) against Conveyor on the same
folder with no quantization (the reference path: the block linears read its rows as stored) and
with each ``--quantization``: per prompt, how many of the first ``--tokens`` greedy tokens agree
before the first difference, and the share of prompts identical throughout.

    .venv/bin/python benchmarks/quantization_agreement.py --model /path/to/hf-folder
"""

from __future__ import annotations

import argparse
import statistics

import torch
import transformers

from conveyor import LLM, SamplingParams
from conveyor.bench.datasets import uniform_dataset
from conveyor.config import QUANTIZATIONS
from conveyor.model.loader import load_tokenizer


@torch.inference_mode()
def transformers_greedy(model, prompt: list[int], tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


def agreement(ours: list[int], ref: list[int]) -> int:
    """Tokens equal before the first difference."""
    return next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face folder")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--quantization", nargs="+", default=list(QUANTIZATIONS))
    args = p.parse_args()
    tokenizer = load_tokenizer(args.model)
    workload = uniform_dataset(tokenizer, args.num_prompts, 0, (16, 200),
                               (args.tokens, args.tokens))
    prompts = [tokenizer.encode(r.prompt) for r in workload]
    hf = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    refs = [transformers_greedy(hf, prompt, args.tokens) for prompt in prompts]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    print(f"{args.num_prompts} prompts, {args.tokens} greedy tokens each, against transformers "
          f"(float32)")
    print(f"{'quantization':<14}{'identical':>10}{'median agree':>14}{'mean agree':>12}"
          f"{'first token':>13}")
    for quantization in [None, *args.quantization]:
        llm = LLM(model=args.model, dtype="float32", quantization=quantization)
        outs = llm.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)
        agree = [agreement(o.outputs[0].token_ids, ref) for o, ref in zip(outs, refs)]
        print(f"{quantization or 'none':<14}{sum(a == args.tokens for a in agree):>6}/"
              f"{len(agree):<3}{statistics.median(agree):>14}{statistics.mean(agree):>12.1f}"
              f"{sum(a > 0 for a in agree):>9}/{len(agree)}")
        del llm


if __name__ == "__main__":
    main()
