"""Where a decode step goes, at a given batch size, and how close its linears come to the machine.

Also measures the machine's float32 multiply-add peak at this CPU tier's vector width (12
chains of FMAs in registers on every thread) and prints the block linears' rate, and the whole
step's linear rate, as shares of it.

Fills a batch with ``--batch`` requests of ``--context`` prompt tokens, lets them all reach
decode, then times ``--steps`` decode steps through ``LLMEngine.step`` with each phase clocked:
scheduling, input preparation, the network (linears, attention and the rest, or, for a
decode-only step on the CPU, all layers in one kernel call), logits, sampling, and the engine's
own bookkeeping (advance, detokenize, outputs). In the same run it times the
model's own linear layers alone at the same M (``F.linear`` on its weights), so the step's
linear FLOPs can be set against the rate the linears reach by themselves: the steps come in
``--rounds`` rounds, each followed by the linears alone, and each round gives one ratio (this
machine's speed moves within minutes, its AMX unit's most of all).

With ``--curve 1,8,16,32,64`` it times instead, for each batch size, decode steps of that many
requests (the step's time, tokens a second, the linears' GFLOP/s and their share of the FMA
peak), and with ``--prefill 512,2048`` one prompt chunk of each length alone: how batching pays
on any model (``--model FILE``, e.g. a shaped GGUF from ``shaped_gguf.py``).

    .venv/bin/python benchmarks/step_profile.py --batch 64
    .venv/bin/python benchmarks/step_profile.py --model 1b.gguf --curve 1,8,16,32,64 --prefill 512,2048
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conveyor.config import ACTIVATION_QUANTS, KV_CACHE_DTYPES, EngineConfig  # noqa: E402
from conveyor.engine.engine import LLMEngine  # noqa: E402
from conveyor.model import model as model_module  # noqa: E402
from conveyor.kernels import isa  # noqa: E402
from conveyor.kernels.bindings import DequantRows  # noqa: E402
from conveyor.kernels.library import fma_peak, load_library  # noqa: E402
from conveyor.model.backend import can_prepack  # noqa: E402
from conveyor.sampling_params import SamplingParams  # noqa: E402


class _Clocked:
    """Stands in for a callable attribute: times each call, passes everything else through."""

    def __init__(self, inner, spent: dict[str, float], label: str) -> None:
        self.inner, self.spent, self.label = inner, spent, label

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.spent[self.label] += time.perf_counter() - t

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


STACK = "all decoder layers in one call (decode_stack)"
DENSE_WEIGHTS = ("plain", "prepacked")  # the ways of linear_calls with dense weights


def clock(obj, name: str, spent: dict[str, float], label: str) -> None:
    """Add the wall time of every call of ``obj.name`` to ``spent[label]``."""
    setattr(obj, name, _Clocked(getattr(obj, name), spent, label))


def dense_rows(weight: torch.Tensor, blocks: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A matrix as dense rows of the model dtype: its own weight, or its blocks dequantized (the
    model keeps no dense copy of a matrix it reads from blocks)."""
    if weight.numel():
        return weight.detach()
    rows = DequantRows(load_library(isa.current().tier), dtype)
    return torch.cat([rows(q, torch.arange(q.blocks.shape[0])) for q in blocks])


def linear_calls(model, m: int, dtype: torch.dtype, dense: bool) -> tuple[float, dict[str, list]]:
    """GFLOP in one pass of the model's linears at M=m, and that pass as calls (each on a fixed
    input) done up to three ways: with the model's own linears (its layers' and head, read from
    GGUF blocks where it has them), and, with ``dense``, plain (``F.linear`` on dense weights,
    dequantized where the model has blocks) and prepacked for oneDNN (bfloat16). Taken before
    the step's clocks go in, so timing them does not count as the step's linears."""
    layers = [mod for mod in model.layers.modules() if isinstance(mod, torch.nn.Linear)]
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    shapes = [(mod.out_features, mod.in_features) for mod in layers] + [
        (model.output.out_features if model.output is not None else vocab, hidden)]
    flop = sum(2 * m * n * k for n, k in shapes)
    xs = [torch.randn(m, k, dtype=dtype) for _, k in shapes]
    calls = {"the model's": [partial(mod.forward, x) for mod, x in zip(layers, xs)] + [
        partial(model.compute_logits, xs[-1])]}
    if dense:
        head = ((model.output.weight, model.output.quantized) if model.output is not None
                else (model.tok_embeddings.weight, (model.embedding_blocks,)))
        weights = [dense_rows(mod.weight, mod.quantized, dtype) for mod in layers] + [
            dense_rows(*head, dtype)]
        calls["plain"] = [partial(F.linear, x, w) for x, w in zip(xs, weights)]
        if can_prepack(torch.device("cpu"), dtype):
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
            calls["prepacked"] = [partial(torch.ops.mkldnn._linear_pointwise, x, p, None, "none",
                                          [], "") for x, p in zip(xs, packed)]
    return flop / 1e9, calls


def linear_rates(gflop: float, calls: dict[str, list], repeats: int) -> dict[str, float]:
    """GFLOP/s of each way of the pass, the median of ``repeats`` passes after a warm one."""
    rates = {}
    with torch.inference_mode():
        for name, fns in calls.items():
            times = []
            for _ in range(repeats + 1):
                t = time.perf_counter()
                for fn in fns:
                    fn()
                times.append(time.perf_counter() - t)
            rates[name] = gflop / statistics.median(times[1:])
    return rates


def linear_gflop(config, rows: int) -> float:
    """GFLOP of a step's linears at this many rows (the head once a sampling row)."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_row = c.num_layers * c.hidden_size * (q + 2 * kv + q + 3 * c.intermediate_size)
    return 2 * rows * per_row / 1e9


def decode_step_times(engine: LLMEngine, batch: int, context: int, steps: int,
                      gen: torch.Generator,
                      around: Callable[[], AbstractContextManager] = nullcontext) -> list[float]:
    """The seconds of ``steps`` decode steps of ``batch`` requests (``context`` random prompt
    tokens each, greedy), once all of them decode, the steps inside ``around()`` (a profiler,
    say); the requests are aborted after."""
    vocab = engine.model_config.vocab_size
    ids = [f"{batch}-{i}" for i in range(batch)]
    for rid in ids:
        prompt = torch.randint(100, vocab, (context,), generator=gen).tolist()
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=steps + 8,
                                                       ignore_eos=True))
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    times = []
    with around():
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()  # (it returns the tokens to the host: on a GPU, the step is done)
            times.append(time.perf_counter() - t)
    for rid in ids:
        engine.abort_request(rid)
    return times


def curve(engine: LLMEngine, sizes: list[int], prefills: list[int], context: int,
          steps: int) -> None:
    """Decode steps at each batch size, then each prefill length's chunk alone."""
    vocab, config = engine.model_config.vocab_size, engine.model_config
    gen = torch.Generator().manual_seed(0)
    peak = fma_peak(torch.get_num_threads())
    print(f"{'rows':>6} {'step ms':>9} {'tok/s':>8} {'GFLOP/s':>8}" + (
        f" {'of FMA peak':>12}" if peak else ""))
    for batch in sizes:
        step = statistics.median(decode_step_times(engine, batch, context, steps, gen)[2:])
        rate = linear_gflop(config, batch) / step
        print(f"{batch:>6} {step * 1e3:>9.1f} {batch / step:>8.1f} {rate:>8.0f}"
              + (f" {rate / peak:>12.0%}" if peak else ""))
    for n in prefills:
        times = []
        for i in range(3):
            prompt = torch.randint(100, vocab, (n,), generator=gen).tolist()
            engine.add_request(f"prefill-{n}-{i}", prompt,
                               SamplingParams(temperature=0, max_tokens=1))
            t = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            times.append(time.perf_counter() - t)
        step = statistics.median(times)
        rate = linear_gflop(config, n) / step
        print(f"prefill {n:>5} tokens: {step * 1e3:>9.1f} ms {n / step:>8.1f} tok/s "
              f"{rate:>6.0f} GFLOP/s" + (f" {rate / peak:.0%} of FMA peak" if peak else ""))
    print(f"FMA peak (float32 multiply-adds at tier {isa.current().tier}'s vector width, "
          f"{torch.get_num_threads()} threads): {peak:.0f} GFLOP/s" if peak else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed, in all")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds that alternate a share of the steps with the linears alone, so "
                        "both are timed at the same machine speed (one ratio per round)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--torch-profile", type=int, default=0, metavar="ROWS",
                   help="also print torch.profiler's top ROWS ops by self CPU time (5 steps)")
    p.add_argument("--dense-reference", action="store_true",
                   help="also time the linears with dense weights (dequantized from the "
                        "blocks: 2 bytes a weight in bfloat16, 4 in float32)")
    p.add_argument("--curve", default=None, metavar="B1,B2,...",
                   help="time decode steps at each of these batch sizes instead")
    p.add_argument("--prefill", default=None, metavar="N1,N2,...",
                   help="with --curve: also one prompt chunk of each of these lengths")
    p.add_argument("--activation-quant", default=EngineConfig.activation_quant,
                   choices=ACTIVATION_QUANTS,
                   help="the block linears' activations (EngineConfig.activation_quant)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV cache's storage (EngineConfig.kv_cache_dtype)")
    p.add_argument("--decode-stack-rows", type=int, default=None, metavar="N",
                   help="run decode steps of up to N requests through decode_stack (0: never; "
                        "default: as many as the block linears take)")
    args = p.parse_args()
    if args.curve:
        sizes = [int(b) for b in args.curve.split(",")]
        prefills = [int(n) for n in args.prefill.split(",")] if args.prefill else []
        longest = max([args.context, *prefills])
        engine = LLMEngine(EngineConfig(
            model=args.model, dtype=args.dtype, max_num_seqs=max(sizes),
            max_num_batched_tokens=max([2048, *prefills]), enable_prefix_caching=False,
            threads=args.threads, max_model_len=longest + 16 * 8,
            activation_quant=args.activation_quant, kv_cache_dtype=args.kv_cache_dtype,
            num_kv_blocks=max(sizes) * (-(-args.context // 16) + 8) + -(-longest // 16) + 8))
        curve(engine, sizes, prefills, args.context, args.steps)
        return
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=args.batch,
                                    max_num_batched_tokens=max(2048, args.batch),
                                    enable_prefix_caching=False, threads=args.threads,
                                    activation_quant=args.activation_quant,
                                    kv_cache_dtype=args.kv_cache_dtype,
                                    num_kv_blocks=args.batch * (-(-args.context // 16) + 8),
                                    max_model_len=args.context + 16 * 8))
    model = engine.runner.model
    if args.decode_stack_rows is not None and model.decode_stack is not None:
        model.decode_stack.max_rows = args.decode_stack_rows
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        ids = torch.randint(100, vocab, (args.context,), generator=gen).tolist()
        engine.add_request(str(i), ids, SamplingParams(temperature=0, max_tokens=16 * 8 - 1,
                                                       ignore_eos=True))
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(3):  # warm
        engine.step()

    gflop, calls = linear_calls(model, args.batch, engine.dtype, args.dense_reference)
    spent: dict[str, float] = defaultdict(float)
    runner = engine.runner
    clock(engine.scheduler, "schedule", spent, "schedule")
    clock(runner.planner, "plan", spent, "prepare inputs")
    clock(runner, "_inputs", spent, "prepare inputs")
    clock(model, "compute_logits", spent, "logits (lm_head)")
    clock(runner, "sampler", spent, "sample")
    for mod in model.layers.modules():
        if isinstance(mod, torch.nn.Linear):
            clock(mod, "forward", spent, "linears (layers)")
    clock(model_module, "paged_attention", spent, "attention (attend)")
    if model.decode_stack is not None:
        clock(model, "decode_stack", spent, STACK)
    forward_spent: dict[str, float] = defaultdict(float)
    clock(model, "forward", forward_spent, "network")

    totals, rounds, peaks = [], [], []
    num_rounds = min(args.rounds, args.steps)  # every round times at least one step
    for r in range(num_rounds):
        times = []
        for _ in range(args.steps * (r + 1) // num_rounds - args.steps * r // num_rounds):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        totals += times
        rates = linear_rates(gflop, calls, repeats=5)
        peaks.append(fma_peak(torch.get_num_threads()))  # beside the linears: the same minute
        rounds.append((statistics.median(times), rates))
    step = sum(totals)
    spent["network: norms, rope + KV write, residuals, the rest"] = (
        forward_spent["network"] - spent["linears (layers)"]
        - spent["attention (attend)"] - spent[STACK])
    spent["engine bookkeeping (advance, detokenize, outputs)"] = step - sum(
        spent[k] for k in ("schedule", "prepare inputs", "logits (lm_head)", "sample")) \
        - forward_spent["network"]

    print(f"\ndecode step at batch {args.batch}, context {args.context}+, {args.dtype}, "
          f"threads {torch.get_num_threads()}: median {statistics.median(totals) * 1e3:.1f} ms, "
          f"mean {step / args.steps * 1e3:.1f} ms over {args.steps} steps")
    for label, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        if seconds == 0:  # e.g. the layer-by-layer parts when decode_stack ran the layers
            continue
        print(f"  {label:<52}{seconds / args.steps * 1e3:>8.1f} ms{seconds / step:>7.1%}")
    overhead = sum(spent[k] for k in ("schedule", "prepare inputs", "sample"))
    print(f"  scheduler + input preparation + sampling: {overhead / step:.1%} of the step")
    print(f"linear FLOPs per step {gflop:.1f} GFLOP; each round: the median step, the model's "
          f"linears alone at M={args.batch} right after it, and the step's share of the best")
    shares, dense_shares, peak_shares = [], [], []
    for i, ((median, rates), peak) in enumerate(zip(rounds, peaks)):
        achieved = gflop / median
        shares.append(achieved / max(rates.values()))
        dense = [rates[k] for k in DENSE_WEIGHTS if k in rates]
        if dense:
            dense_shares.append(achieved / max(dense))
        if peak:
            peak_shares.append(rates["the model's"] / peak)
        alone = ", ".join(f"{k} {v:.0f}" for k, v in rates.items())
        print(f"  round {i + 1}: step {median * 1e3:.1f} ms = {achieved:.0f} GFLOP/s; linears "
              f"alone: {alone} GFLOP/s; {shares[-1]:.0%} of the best"
              + (f", {dense_shares[-1]:.0%} of the best with dense weights" if dense else "")
              + (f"; FMA peak {peak:.0f} GFLOP/s" if peak else ""))
    print(f"the whole step reaches {statistics.median(shares):.0%} of the best linear rate"
          + (f", {statistics.median(dense_shares):.0%} of the best with dense {args.dtype} "
             f"weights (plain or prepacked)" if dense_shares else "") + f", medians of {len(shares)} rounds")
    if all(peaks):
        print(f"FMA peak of this machine (tier {isa.current().tier}: float32 multiply-adds at its "
              f"vector width, {torch.get_num_threads()} threads, measured each round): median "
              f"{statistics.median(peaks):.0f} GFLOP/s")
        if peak_shares:
            blocks = statistics.median(r["the model's"] for _, r in rounds)
            print(f"  the model's linears alone at M={args.batch}: {blocks:.0f} GFLOP/s, "
                  f"{statistics.median(peak_shares):.0%} of the round's peak (median of rounds)")
        step_shares = [gflop / median / peak for (median, _), peak in zip(rounds, peaks)]
        print(f"  the whole step's linear FLOPs: {statistics.median(step_shares):.0%} of the "
              f"round's peak")
    if args.torch_profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total",
                                        row_limit=args.torch_profile))


if __name__ == "__main__":
    main()
