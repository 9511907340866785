"""llguidance against xgrammar on the default model's tokenizer: what picking one rested on.

For each schema of the battery: compile time (a fresh compiler, the tokenizer's conversion
apart), then a walk of ``--steps`` tokens where each step fills the token bitmask and takes the
allowed token with the highest seeded random logit (compact JSON: no free whitespace, so the
walk fills the schema instead of spaces). Prints per-backend median and max compile time and
median and p99 mask time. xgrammar is not a dependency (it pulls triton, ~1 GB, on Linux
x86-64): install it into a scratch environment to compare; a backend that does not import is
skipped.

    .venv/bin/python benchmarks/grammar_backends.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def llguidance_backend(tokenizer, vocab: int, eos: list[int]):
    import llguidance
    import llguidance.hf

    start = time.perf_counter()
    llg = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
    setup = time.perf_counter() - start

    def compile_schema(schema):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        matcher = llguidance.LLMatcher(llg, grammar, log_level=0)
        return (lambda mask: matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4),
                matcher.consume_token, matcher.is_stopped)
    return setup, compile_schema


def xgrammar_backend(tokenizer, vocab: int, eos: list[int]):
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab,
                                                   stop_token_ids=eos)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - start

    def compile_schema(schema):
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        matcher = xgrammar.GrammarMatcher(compiled)
        return (lambda mask: matcher.fill_next_token_bitmask(mask), matcher.accept_token,
                matcher.is_terminated)
    return setup, compile_schema


def measure(backend, schemas, vocab: int, steps: int, seed: int) -> dict:
    compiles, masks = [], []
    mask = torch.empty(1, (vocab + 31) // 32, dtype=torch.int32)
    shifts = torch.arange(32, dtype=torch.int32)
    for i, schema in enumerate(schemas):
        start = time.perf_counter()
        fill, consume, done = backend(schema)
        compiles.append(time.perf_counter() - start)
        gen = torch.Generator().manual_seed(seed + i)
        for _ in range(steps):
            start = time.perf_counter()
            fill(mask)
            masks.append(time.perf_counter() - start)
            allowed = ((mask.unsqueeze(-1) >> shifts) & 1).view(-1)[:vocab].bool()
            logits = torch.randn(vocab, generator=gen).masked_fill(~allowed, float("-inf"))
            if not consume(int(logits.argmax())) or done():
                break
    masks.sort()
    return {"compile_median_ms": statistics.median(compiles) * 1e3,
            "compile_max_ms": max(compiles) * 1e3,
            "mask_median_us": statistics.median(masks) * 1e6,
            "mask_p99_us": masks[int(0.99 * (len(masks) - 1))] * 1e6, "mask_fills": len(masks)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from conveyor.bench.schemas import BATTERY
    from conveyor.model.loader import load_model

    loaded = load_model(None)
    vocab, eos = loaded.config.vocab_size, sorted(loaded.eos_token_ids)
    schemas = [schema for _, schema, _ in BATTERY]
    for name, make in (("llguidance", llguidance_backend), ("xgrammar", xgrammar_backend)):
        try:
            setup, backend = make(loaded.tokenizer, vocab, eos)
        except ImportError as e:
            print(f"{name}: skipped ({e})")
            continue
        r = measure(backend, schemas, vocab, args.steps, args.seed)
        print(f"{name}: tokenizer {setup * 1e3:.0f} ms; compile median "
              f"{r['compile_median_ms']:.2f} ms, max {r['compile_max_ms']:.2f} ms "
              f"({len(schemas)} schemas); mask median {r['mask_median_us']:.1f} us, p99 "
              f"{r['mask_p99_us']:.1f} us ({r['mask_fills']} fills)")


if __name__ == "__main__":
    main()
