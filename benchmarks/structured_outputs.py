"""Structured outputs: schema validity over the battery, the cost of constraining a full batch,
and grammar compile times, in one run.

1. Validity: every schema of ``conveyor.bench.schemas.BATTERY`` asked ``--samples`` times (one
   greedy, the rest sampled at temperature 1), all in one batch; each output parsed and checked
   with ``jsonschema`` (formats included).
2. Cost: ``--num-prompts`` battery requests at ``--max-num-seqs`` (the engine's concurrency),
   constrained, then the same prompts unconstrained with EOS ignored and each request's
   max_tokens set to the length its constrained twin produced: the same tokens to compute, with
   and without grammars. Alternated ``--repeats`` times; output tok/s and the ratio's median.
3. Compile: a fresh compiler over the battery's schemas (the tokenizer's one-off conversion
   apart), median and max; the cache's hit rate over the cost runs.

    .venv/bin/python benchmarks/structured_outputs.py --samples 8 --num-prompts 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def validity(llm, samples: int) -> tuple[int, int, list[str]]:
    import jsonschema

    from conveyor import SamplingParams
    from conveyor.bench.schemas import BATTERY
    from conveyor.sampling_params import StructuredOutputsParams

    convs, params, names = [], [], []
    for name, schema, ask in BATTERY:
        for i in range(samples):
            convs.append([{"role": "user", "content": f"{ask} Answer in JSON."}])
            params.append(SamplingParams(
                temperature=0 if i == 0 else 1.0, seed=i, max_tokens=400,
                structured_outputs=StructuredOutputsParams(json=schema)))
            names.append((name, schema))
    outs = llm.chat(convs, params, use_tqdm=False)
    failures = []
    for (name, schema), out in zip(names, outs):
        text = out.outputs[0].text
        try:
            jsonschema.validate(json.loads(text), schema,
                                format_checker=jsonschema.FormatChecker())
        except (ValueError, jsonschema.ValidationError) as e:
            failures.append(f"{name} ({out.outputs[0].finish_reason}): {e}: {text[:80]!r}")
    return len(outs) - len(failures), len(outs), failures


def cost(llm, num_prompts: int, repeats: int) -> list[tuple[float, float]]:
    """(constrained, unconstrained) output tok/s per repeat."""
    from conveyor import SamplingParams
    from conveyor.bench.schemas import BATTERY
    from conveyor.sampling_params import StructuredOutputsParams

    convs, constrained = [], []
    for i in range(num_prompts):
        _, schema, ask = BATTERY[i % len(BATTERY)]
        convs.append([{"role": "user", "content": f"{ask} Answer in JSON."}])
        constrained.append(SamplingParams(temperature=1.0, seed=i, max_tokens=400,
                                          structured_outputs=StructuredOutputsParams(
                                              json=schema)))
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.chat(convs, constrained, use_tqdm=False)
        with_grammar = time.perf_counter() - start
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
                 for i, n in enumerate(lengths)]
        start = time.perf_counter()
        again = llm.chat(convs, plain, use_tqdm=False)
        without = time.perf_counter() - start
        assert [len(o.outputs[0].token_ids) for o in again] == lengths
        runs.append((sum(lengths) / with_grammar, sum(lengths) / without))
    return runs


def compile_times(engine) -> tuple[float, list[float]]:
    from conveyor.bench.schemas import BATTERY
    from conveyor.core.grammar import GrammarCompiler
    from conveyor.sampling_params import StructuredOutputsParams

    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size,
                               engine.eos_token_ids)
    start = time.perf_counter()
    compiler.llg_tokenizer()
    conversion = time.perf_counter() - start
    for _, schema, _ in BATTERY:
        compiler.compile(StructuredOutputsParams(json=schema))
    return conversion, compiler.stats.compile_seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--samples", type=int, default=8, help="per schema, for validity")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    from conveyor import LLM
    from conveyor.bench.schemas import BATTERY

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_model_len=2048, threads=args.threads)
    conversion, seconds = compile_times(llm.engine)
    print(f"model {llm.engine.model_name}, dtype {str(llm.engine.dtype)[6:]}, "
          f"{llm.engine.runner.kernel_path}")
    print(f"compile: {len(seconds)} schemas, median {statistics.median(seconds) * 1e3:.2f} ms, "
          f"max {max(seconds) * 1e3:.2f} ms (tokenizer conversion, once: "
          f"{conversion * 1e3:.0f} ms)")

    valid, total, failures = validity(llm, args.samples)
    print(f"validity: {valid}/{total} outputs valid ({len(BATTERY)} schemas x {args.samples} "
          f"samples, 1 greedy + {args.samples - 1} sampled at temperature 1)")
    for f in failures:
        print("  invalid:", f)

    before = llm.engine.grammars.stats.matchers, llm.engine.grammars.stats.compiles
    runs = cost(llm, args.num_prompts, args.repeats)
    stats = llm.engine.grammars.stats
    matchers, compiles = stats.matchers - before[0], stats.compiles - before[1]
    for i, (c, u) in enumerate(runs):
        print(f"cost run {i}: constrained {c:.1f} tok/s, unconstrained {u:.1f} tok/s, "
              f"ratio {c / u:.3f}")
    print(f"cost: median ratio {statistics.median(c / u for c, u in runs):.3f} at "
          f"max_num_seqs {args.max_num_seqs}, {args.num_prompts} requests; grammar cache: "
          f"{matchers} matchers, {compiles} compiles, hit rate "
          f"{1 - compiles / matchers if matchers else 0:.3f}")


if __name__ == "__main__":
    main()
