"""Conveyor against llama.cpp's ``llama-server`` and vLLM's CPU build on the same model, the same
workload and machine, in one run: ``conveyor bench serve``'s load at each concurrency against
each server in turn.

The peers are benchmark-only, never dependencies: ``../shared/peers/`` builds both into venvs of
their own. llama-server (built natively for this CPU; on an AMX CPU with AMX off) serves the
GGUF: point ``--llama-server`` (or $LLAMA_SERVER) at the binary. vLLM's CPU build reads no GGUF
on the CPU, so it serves a Hugging Face folder made once from the same GGUF with transformers:
``--vllm-python`` (or $VLLM_PYTHON) is its venv's python, ``--vllm-model`` the folder. It starts
in ~5 min, uses one thread unless OMP_NUM_THREADS is set (set here), and its ``vllm serve``
entry point fails in this package (the module's entry point works).

    .venv/bin/python benchmarks/peer.py --llama-server /path/to/llama-server \
        --vllm-python /path/to/vllm/venv/bin/python --vllm-model /path/to/smollm2-hf
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

from conveyor.bench.datasets import uniform_dataset
from conveyor.bench.serve import add_serve_args, benchmark, save_result, served_model
from conveyor.model.loader import default_model_path, load_tokenizer
from conveyor.process import ConveyorServer, ServerProcess

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class VllmServer(ServerProcess):
    def __init__(self, python: str, model: str, flags: list[str], log_path: str) -> None:
        super().__init__(log_path, startup_timeout=1200.0)
        self.python, self.model, self.flags = python, model, flags

    def command(self) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", "127.0.0.1", "--port", str(self.port), *self.flags]

    def environment(self) -> dict[str, str]:
        env = super().environment()
        env.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        return env


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
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"),
                   help="python of vLLM's own venv (no vLLM run without it)")
    p.add_argument("--vllm-model", default=os.environ.get("VLLM_MODEL"),
                   help="the Hugging Face folder vLLM serves, made from the same GGUF")
    p.add_argument("--vllm-flags",
                   default="--dtype float32 --max-model-len 4096 --max-num-seqs 32")
    p.add_argument("--conveyor-flags", default="--max-num-seqs 32")
    p.add_argument("--only", nargs="+", choices=["llama-server", "vllm", "conveyor"],
                   default=None, help="run only these servers")
    args = p.parse_args()
    wanted = set(args.only or ["llama-server", "vllm", "conveyor"])
    if "llama-server" in wanted and not args.llama_server:
        p.error("no llama-server: pass --llama-server PATH or set LLAMA_SERVER (or --only)")
    if "vllm" in wanted and not (args.vllm_python and args.vllm_model):
        if args.only:
            p.error("vllm needs --vllm-python and --vllm-model")
        wanted.discard("vllm")
    gguf = args.gguf or default_model_path()
    args.num_prompts = 64 if args.num_prompts == 100 else args.num_prompts
    args.ignore_eos = args.disable_tqdm = True
    workload = uniform_dataset(load_tokenizer(gguf), args.num_prompts, args.seed,
                               tuple(args.input_range), tuple(args.output_range))
    tmp = tempfile.gettempdir()
    servers = {
        "llama-server": lambda: LlamaServer(args.llama_server, gguf, args.llama_flags.split(),
                                            os.path.join(tmp, "peer-llama-server.log")),
        "vllm": lambda: VllmServer(args.vllm_python, args.vllm_model, args.vllm_flags.split(),
                                   os.path.join(tmp, "peer-vllm.log")),
        "conveyor": lambda: ConveyorServer(["--model", gguf, *args.conveyor_flags.split()],
                                           os.path.join(tmp, "peer-conveyor.log")),
    }
    servers = {k: v for k, v in servers.items() if k in wanted}
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
        for other in ("llama-server", "vllm"):
            mine, peer = by.get(("conveyor", c)), by.get((other, c))
            if mine and peer:
                print(f"concurrency {c}: output tok/s conveyor/{other} = "
                      f"{mine['output_throughput'] / peer['output_throughput']:.2f}x, mean TPOT "
                      f"conveyor/{other} = {mine['mean_tpot_ms'] / peer['mean_tpot_ms']:.2f}x")
    if args.save_result:
        save_result(args, rows, "peer.json")


if __name__ == "__main__":
    main()
