"""A model's GGUF-block linears at a decode's row counts, on float activations and on integer
ones (``--activation-quant int16|int8``): every linear of every layer and the head, one after
the other as a step calls them (each weight read from memory once), the modes taking turns so
that each repeat times them at the same machine speed.

    .venv/bin/python benchmarks/int_linears.py --model 1b.gguf --rows 1,2,4,8,32

Prints, per row count, each mode's median time for all the linears, its ratio to ``none`` and
the bytes of blocks it read a second. A mode's calls of more rows than its ``int_rows`` run on
the float kernels (``IntQuantLinear``), so past them the modes time the same kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from conveyor.config import ACTIVATION_QUANTS as MODES
from conveyor.config import EngineConfig
from conveyor.engine.engine import LLMEngine
from conveyor.kernels import isa
from conveyor.kernels.library import kernels_at
from conveyor.model.model import Linear


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    p.add_argument("--rows", default="1,2,4,8,32")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--int-rows", type=int, default=None, metavar="N",
                   help="the integer modes take calls of up to N rows (default: their int_rows)")
    args = p.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=1, num_kv_blocks=8,
                                    max_model_len=64, activation_quant="none"))
    model = engine.runner.model
    calls = [(m.quantized, m.in_features) for m in model.layers.modules()
             if isinstance(m, Linear) and m.quant_linear is not None]
    if not calls:
        raise SystemExit("no linear runs on the CPU kernels here: nothing to compare")
    tier = isa.current().tier
    if model.head_blocks is not None:
        calls.append(((model.head_blocks,), model.config.hidden_size))
    linears = {mode: kernels_at(tier, engine.dtype, model.config.head_dim,
                                mode).quant_linear for mode in MODES}
    for mode in [m for m in MODES if m != "none"] if args.int_rows is not None else ():
        linears[mode].int_rows = args.int_rows
    # each mode's copy of the weights in the format it reads (int8 repacks where its tier does)
    formats = {mode: [(tuple(linear.in_format(w) for w in runs), k) for runs, k in calls]
               for mode, linear in linears.items()}
    weights = sum(w.blocks.numel() for runs, _ in calls for w in runs)
    print(f"{args.model or 'the default model'}: {len(calls)} block linears, "
          f"{weights / 2**20:.0f} MiB of blocks; tier {tier}, {engine.dtype}, "
          f"{torch.get_num_threads()} threads")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k).to(engine.dtype) for k in {k for _, k in calls}}
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode in MODES:
                t = time.perf_counter()
                for runs, k in formats[mode]:
                    linears[mode](inputs[k], runs)
                times[mode].append(time.perf_counter() - t)
        base = statistics.median(times["none"])
        print(f"{rows:>4} rows: " + "   ".join(
            f"{mode} {statistics.median(v) * 1e3:7.1f} ms ({statistics.median(v) / base:.2f}x, "
            f"{weights / statistics.median(v) / 1e9:4.1f} GB/s)" for mode, v in times.items()))
    engine.shutdown()


if __name__ == "__main__":
    main()
