"""The ``conveyor`` command. Bad input ends with one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from conveyor.bench.cli import add_bench_parser
from conveyor.config import QUANTIZATIONS, EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, spelled as vLLM spells them."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto",
                   choices=["auto", "float32", "float", "bfloat16", "float16", "half"])
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pages in the pool")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV pool size in memory, e.g. 2GiB (default: a share of free memory)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most requests in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's, capped by the pool)")
    g.add_argument("--policy", default="continuous", choices=["continuous", "static"])
    g.add_argument("--kv-layout", default="paged", choices=["paged", "contiguous"],
                   help="contiguous: reserve max_model_len per request at admission, as static "
                        "serving stacks do (to measure what paging saves; no prefix caching)")
    g.add_argument("--enable-prefix-caching", default=True, action=argparse.BooleanOptionalAction,
                   help="reuse the KV pages of shared prompt prefixes (default: on)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="priority: lower `priority` values are admitted first and preempted last")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads for the model")
    g.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="quantize a Hugging Face folder's linears into these GGUF blocks at load")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the layers across this many ranks (torch.distributed: local "
                        "processes, or torchrun's ranks)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="serve with this many engine replicas (conveyor serve)")
    g.add_argument("--distributed-init-method", default=None, metavar="tcp://HOST:PORT",
                   help="where the ranks meet (default: a local port, or env:// under torchrun)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, dtype=args.dtype, block_size=args.block_size,
                        num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, policy=args.policy,
                        kv_layout=args.kv_layout,
                        enable_prefix_caching=args.enable_prefix_caching,
                        scheduling_policy=args.scheduling_policy, seed=args.seed,
                        device=args.device, threads=args.threads,
                        quantization=args.quantization,
                        tensor_parallel_size=args.tensor_parallel_size,
                        data_parallel_size=args.data_parallel_size,
                        distributed_init_method=args.distributed_init_method)


def _torchrun_worker(args: argparse.Namespace) -> bool:
    """Under torchrun every rank runs the command: ranks above 0 serve rank 0's steps."""
    from conveyor.engine.parallel import launched_by_torchrun, run_worker

    if args.tensor_parallel_size == 1 or not launched_by_torchrun() or os.environ["RANK"] == "0":
        return False
    run_worker(engine_config(args))
    return True


def _generate(args: argparse.Namespace) -> None:
    from conveyor.llm import LLM
    from conveyor.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sample_seed,
                            ignore_eos=args.ignore_eos)
    llm = LLM(**dataclasses.asdict(engine_config(args)))
    prompts = args.prompt or ["The three most useful things to know about continuous batching are"]
    t0 = time.monotonic()
    try:
        outputs = (llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                            use_tqdm=False)
                   if args.chat else llm.generate(prompts, params, use_tqdm=False))
    finally:
        llm.engine.shutdown()
    elapsed = time.monotonic() - t0
    for prompt, out in zip(prompts, outputs):
        c = out.outputs[0]
        print(f"--- {prompt!r}\n{c.text}\n[{len(c.token_ids)} tokens, finish: {c.finish_reason}]")
    total = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"--- {len(outputs)} requests, {total} tokens in {elapsed:.2f} s "
          f"({total / elapsed:.1f} tok/s)")


def _env(args: argparse.Namespace) -> None:
    """What this machine gets, without loading a model: the CPU tier and why, the dtype
    ``auto`` picks, and whether the kernels build for it."""
    import torch

    from conveyor import __version__
    from conveyor.kernels import build, isa
    from conveyor.kernels.library import cpu_kernels, describe
    from conveyor.model.model import can_prepack

    config = EngineConfig(dtype=args.dtype, device=args.device)
    device = config.torch_device()
    dtype = config.torch_dtype(None, device)
    choice = isa.current()
    kernels = cpu_kernels(device, dtype, 64)
    print(f"conveyor {__version__}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"cpu tier: {choice.describe()}")
    print(f"device: {device.type}; dtype {str(dtype).removeprefix('torch.')} "
          f"({config.dtype_reason(None, device)})")
    print(f"kernels: {describe(device, dtype, 64, kernels)}; compiler "
          f"{build.compiler() or 'none'}")
    print(f"oneDNN bfloat16 prepacking: {'yes' if can_prepack(device, torch.bfloat16) else 'no'}")


def _serve(args: argparse.Namespace) -> None:
    from conveyor.server.launch import serve  # uvicorn and FastAPI load only when serving

    serve(args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="conveyor")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for prompts, offline")
    add_engine_args(gen)
    gen.add_argument("prompt", nargs="*", help="prompts (default: one example prompt)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sample-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(handler=_generate)
    env = sub.add_parser("env", help="print the CPU tier, dtype and kernels this machine gets")
    env.add_argument("--dtype", default="auto",
                     choices=["auto", "float32", "float", "bfloat16", "float16", "half"])
    env.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    env.set_defaults(handler=_env)
    srv = sub.add_parser("serve", help="serve the OpenAI API over HTTP")
    add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", nargs="+", default=None,
                     help="model name(s) the API answers to (default: the model's own)")
    srv.add_argument("--max-queue-len", type=int, default=None,
                     help="answer 503 when this many requests wait (default: no limit)")
    srv.add_argument("--max-concurrent-requests", type=int, default=None,
                     help="answer 429 when this many HTTP requests are in flight (TGI's; "
                          "default: no limit)")
    srv.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                     help="end a request that runs longer (408); a request's own `timeout` "
                          "may be shorter (default: none)")
    srv.add_argument("--max-body-bytes", type=int, default=None,
                     help="answer 413 to a larger request body (default: 16 MiB)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every route but /health and "
                          "/metrics (or set CONVEYOR_API_KEY, which keeps it out of ps)")
    srv.add_argument("--dashboard-public", action="store_true",
                     help="serve the dashboard (it shows prompts) without a key on a "
                          "non-loopback host")
    srv.set_defaults(handler=_serve)
    add_bench_parser(sub)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # (data parallel: the replicas')
    try:
        if args.handler in (_generate, _serve) and _torchrun_worker(args):
            return
        args.handler(args)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"conveyor: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
