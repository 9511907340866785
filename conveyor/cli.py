"""The ``conveyor`` command. Bad input ends with one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time

from conveyor.bench.cli import add_bench_parser
from conveyor.config import EngineConfig
from conveyor.logs import configure_logging, show_progress
from conveyor.server.config import ServerConfig
from conveyor.settings import DefaultsHelp, add_arguments, from_namespace


def _torchrun_worker(args: argparse.Namespace) -> bool:
    """Under torchrun every rank runs the command: ranks above 0 serve rank 0's steps."""
    from conveyor.worker.rank import run_worker
    from conveyor.worker.tensor_parallel import launched_by_torchrun

    if args.tensor_parallel_size == 1 or not launched_by_torchrun() or os.environ["RANK"] == "0":
        return False
    run_worker(from_namespace(EngineConfig, args))
    return True


def _generate(args: argparse.Namespace) -> None:
    show_progress()
    _starting(args)
    from conveyor.llm import LLM
    from conveyor.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sample_seed,
                            ignore_eos=args.ignore_eos)
    llm = LLM(**dataclasses.asdict(from_namespace(EngineConfig, args)))
    prompts = args.prompt or ["The three most useful things to know about continuous batching are"]
    t0 = time.monotonic()
    try:
        if len(prompts) == 1:  # to the terminal as it comes
            print(f"--- {prompts[0]!r}")
            outputs = [_streamed(llm, prompts[0], params, args.chat)]
        else:
            outputs = (llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                                use_tqdm=False)
                       if args.chat else llm.generate(prompts, params, use_tqdm=False))
    finally:
        llm.engine.shutdown()
    elapsed = time.monotonic() - t0
    for prompt, out in zip(prompts, outputs):
        c = out.outputs[0]
        text = "" if len(prompts) == 1 else f"--- {prompt!r}\n{c.text}"
        print(f"{text}\n[{len(c.token_ids)} tokens, finish: {c.finish_reason}]")
    total = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"--- {len(outputs)} requests, {total} tokens in {elapsed:.2f} s "
          f"({total / elapsed:.1f} tok/s)")


def _streamed(llm, prompt: str, params, chat: bool):
    """One prompt's output, its text printed as the steps make it (the server's deltas)."""
    from conveyor.server.streaming import TextDeltas

    given = ({"prompt_token_ids": llm.engine.inputs.apply_chat_template(
        [{"role": "user", "content": prompt}])} if chat else prompt)
    llm.engine.add_request("generate", given, params)
    deltas, out = TextDeltas([]), None  # (no stop strings here to hold back)
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            print(deltas.next(out.outputs[0])[0], end="", flush=True)
    return out


def _env(args: argparse.Namespace) -> None:
    """What this machine gets, without loading a model: the CPU tier and why, the dtype
    ``auto`` picks, and whether the kernels build for it."""
    import torch

    from conveyor import __version__
    from conveyor.kernels import build, isa
    from conveyor.kernels.library import cpu_kernels, describe
    from conveyor.model.backend import can_prepack
    from conveyor.model.kv_cache import cache_storage

    config = EngineConfig(dtype=args.dtype, device=args.device)
    device = config.torch_device()
    dtype = config.torch_dtype(None, device)
    choice = isa.current()
    kernels = cpu_kernels(device, dtype, 64, config.activation_quant)
    print(f"conveyor {__version__}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads (fewer while other processes keep cores busy, "
          f"unless --no-adaptive-threads)")
    print(f"cpu tier: {choice.describe()}")
    print(f"device: {device.type}; dtype {str(dtype).removeprefix('torch.')} "
          f"({config.dtype_reason(None, device)})")
    print(f"kernels: {describe(device, dtype, 64, kernels)}; compiler "
          f"{build.compiler() or 'none'}")
    print(f"oneDNN bfloat16 prepacking: {'yes' if can_prepack(device, torch.bfloat16) else 'no'}")
    print("batch invariance: off unless --batch-invariant"
          + ("" if kernels is not None else " (which needs the CPU kernels: not here)"))
    storage = cache_storage(config, dtype, device, 64)
    print(f"KV cache: {str(storage).removeprefix('torch.')} (--kv-cache-dtype "
          f"{config.kv_cache_dtype}{': halves of the float32 model' if storage != dtype else ''})")


# vLLM's serve flags for what Conveyor does its own way: accepted, so that a vLLM launch line
# starts unchanged, each with a line saying what happens instead. Flag: (takes a value, line).
VLLM_ONLY_FLAGS = {
    "--trust-remote-code": (False, "no code from the model's folder runs: Conveyor has its own "
                                   "implementation of each family it serves"),
    "--enable-auto-tool-choice": (False, "tool_choice auto (the default) is always served"),
    "--tool-call-parser": (True, "tool calls are read as the JSON objects the chat template "
                                 "asks for, whatever the parser named"),
    "--disable-log-requests": (False, "requests are not logged unless --enable-log-requests"),
    "--disable-log-stats": (False, "Conveyor logs no periodic stats: /metrics has them"),
    "--gpu-memory-utilization": (True, "the KV pool is sized by --kv-cache-memory or "
                                       "--num-kv-blocks (default: a share of free memory)"),
}


# vLLM's names for Conveyor's settings: (flag, value) -> Conveyor's flags
VLLM_SPELLINGS = {("--runner", "pooling"): ["--task", "embed"],
                  ("--runner", "generate"): ["--task", "generate"], ("--runner", "auto"): []}


def _without_vllm_only_flags(argv: list[str]) -> list[str]:
    """``serve``'s arguments less VLLM_ONLY_FLAGS (``--flag value`` or ``--flag=value``), each
    noted on stderr, and with VLLM_SPELLINGS in Conveyor's words."""
    kept, i = [], 0
    while i < len(argv):
        name, equals, value = argv[i].partition("=")
        if not equals and i + 1 < len(argv):
            value = argv[i + 1]
        if (name, value) in VLLM_SPELLINGS:
            kept += VLLM_SPELLINGS[name, value]
            i += 1 if equals else 2
            continue
        if name not in VLLM_ONLY_FLAGS:
            kept.append(argv[i])
            i += 1
            continue
        takes_value, line = VLLM_ONLY_FLAGS[name]
        print(f"conveyor: {name} (vLLM's) accepted: {line}", file=sys.stderr)
        i += 2 if takes_value and "=" not in argv[i] else 1
    return kept


def _starting(args: argparse.Namespace) -> None:
    """The first line at once: PyTorch, the server and the model take seconds to load, and a
    first start compiles the kernels too."""
    logging.getLogger("conveyor").info("starting: loading PyTorch, then %s",
                                       args.model or "the default model")


def _serve(args: argparse.Namespace) -> None:
    configure_logging()
    _starting(args)
    from conveyor.server.launch import run_server  # uvicorn and FastAPI load only when serving

    run_server(from_namespace(EngineConfig, args), from_namespace(ServerConfig, args))


def build_parser() -> argparse.ArgumentParser:
    from conveyor import __version__

    parser = argparse.ArgumentParser(prog="conveyor")
    parser.add_argument("--version", action="version", version=f"conveyor {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for prompts, offline",
                         formatter_class=DefaultsHelp)
    add_arguments(gen.add_argument_group("engine"), EngineConfig)
    gen.add_argument("prompt", nargs="*", help="prompts (default: one example prompt)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64,
                     help="output tokens a prompt")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0,
                     help="nucleus sampling's share")
    gen.add_argument("--top-k", type=int, default=0,
                     help="sample among the k likeliest (0: all)")
    gen.add_argument("--sample-seed", type=int, default=None,
                     help="the sampler's seed (default: random)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="generate every asked token, past the end of text")
    gen.set_defaults(handler=_generate)
    env = sub.add_parser("env", help="print the CPU tier, dtype and kernels this machine gets")
    add_arguments(env, EngineConfig, only=("dtype", "device"))
    env.set_defaults(handler=_env)
    srv = sub.add_parser("serve", help="serve the OpenAI API over HTTP")
    srv.add_argument("model_tag", nargs="?", metavar="MODEL",
                     help="a .gguf file or a Hugging Face folder, as --model")
    add_arguments(srv.add_argument_group("engine"), EngineConfig)
    add_arguments(srv.add_argument_group("server"), ServerConfig)
    vllm = srv.add_argument_group("vLLM's flags, accepted so that its launch lines start "
                                  "unchanged (each says what happens instead)")
    for flag, (takes_value, line) in VLLM_ONLY_FLAGS.items():
        vllm.add_argument(flag, help=line, **({"metavar": "VALUE"} if takes_value
                                             else {"action": "store_true"}))
    srv.set_defaults(handler=_serve)
    add_bench_parser(sub)
    return parser


def _subcommand(parser: argparse.ArgumentParser,
                args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the subcommand ``args`` were parsed for (``bench serve``'s, say)."""
    while True:
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not nested or getattr(args, nested[0].dest, None) is None:
            return parser
        parser = nested[0].choices[getattr(args, nested[0].dest)]


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        argv = ["serve", *_without_vllm_only_flags(argv[1:])]
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # under the (innermost) subcommand's usage, not the top level's
        _subcommand(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if getattr(args, "model_tag", None) is not None:  # vLLM's `serve MODEL`
            if args.model is not None and args.model != args.model_tag:
                raise ValueError(f"the model is given twice: {args.model_tag} and --model "
                                 f"{args.model}")
            args.model = args.model_tag
        if args.handler in (_generate, _serve) and _torchrun_worker(args):
            return
        args.handler(args)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"conveyor: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
