"""The GPU path's figures in one run, written to one JSON: a Llama-3.2-1B-shaped random model
(bfloat16, a Hugging Face folder written here) decoding alone and at 8/32/64 rows; the offline
workload of ``offline_throughput.py`` (heavy-tailed outputs) under the continuous and static
policies and transformers' ``generate`` in static batches; ``conveyor serve`` under ``conveyor
bench serve`` at 64 concurrent requests; and a tiny float32 Llama's greedy tokens against
transformers' on the same device, both policies, with preemption forced.

On an H100/H200 it takes a few minutes. ``--device cpu --shape tiny`` runs every part on a tiny
model: a dry run of the script, not a measurement. The JSON is rewritten after each part, with
the seconds each took, so a run cut short keeps what it measured. ``--tokenizer`` names a saved
tokenizer for the written models where the default model's GGUF is not installed (the device
machine: ``benchmarks/gpu_carry.sh``, docs/gpu.md).

    .venv/bin/python benchmarks/gpu.py --out docs/results/gpu/h100.json
    .venv/bin/python benchmarks/gpu.py --device cpu --shape tiny --out /tmp/gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tiny checkpoints' writer, the equivalence runs
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import offline_throughput  # noqa: E402
from equivalence import NEW_TOKENS, TIE, hf_greedy, random_prompts, run_conveyor  # noqa: E402
from step_profile import decode_step_times  # noqa: E402
from tiny_models import LLAMA3_ROPE_SCALING, make_tiny_checkpoint  # noqa: E402

from conveyor.config import EngineConfig  # noqa: E402
from conveyor.engine.engine import LLMEngine  # noqa: E402
from conveyor.kernels import library  # noqa: E402
from conveyor.model import flex_attention  # noqa: E402
from conveyor.process import ConveyorServer  # noqa: E402

# transformers config keys of the published architecture (random weights)
SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                         rope_scaling=LLAMA3_ROPE_SCALING, max_position_embeddings=4096),
    "tiny": {},  # tiny_models' defaults
}


def write_model(shape: str, folder: Path, dtype: torch.dtype, tokenizer: str | None) -> str:
    """The shape's random Llama as a Hugging Face folder (kept and reused), with the tokenizer
    saved in ``tokenizer`` or, where None, SmolLM2's from the default model's GGUF."""
    if not (folder / "config.json").exists():
        import transformers

        make_tiny_checkpoint(folder, "llama", dtype=dtype, **SHAPES[shape], tokenizer=(
            transformers.AutoTokenizer.from_pretrained(tokenizer) if tokenizer else None))
    return str(folder)


def equivalence(folder: str, device: torch.device) -> dict:
    """Greedy tokens of a tiny float32 Llama, Conveyor's against transformers' on the device
    (``tests/equivalence.py``'s runs, preemption forced by a small pool): identical, or parted
    where transformers' own top-2 logits tie (then the rest differs)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32).to(device).eval()
    prompts = random_prompts(model.config.vocab_size)
    refs = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    found = {}
    for policy in ("continuous", "static"):
        outputs = run_conveyor(folder, prompts, policy, device=str(device), num_kv_blocks=12)
        identical = tied = differ = 0
        for o, (ref, gaps) in zip(outputs, refs):
            ours = o.outputs[0].token_ids
            first = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
            if first is None:
                identical += 1
            elif gaps[first] <= TIE:
                tied += 1
            else:
                differ += 1
        found[policy] = dict(identical=identical, parted_at_ties=tied, differ=differ,
                             preemptions=sum(o.metrics.num_preemptions for o in outputs))
    print(f"equivalence: {found}", flush=True)
    return found


def decode_steps(folder: str, device: torch.device, sizes: list[int], context: int,
                 steps: int) -> dict:
    """Median time of a decode step of each size (requests of ``context`` prompt tokens) and,
    on CUDA, the kernels' time in such a step: the rest of the step is the host's, which
    asynchronous scheduling could hide behind the device's work."""
    engine = LLMEngine(EngineConfig(model=folder, device=str(device), dtype="auto",
                                    max_num_seqs=max(sizes), enable_prefix_caching=False))
    gen = torch.Generator().manual_seed(0)
    found = {"kernels": engine.runner.kernel_path}
    for batch in sizes:
        step = statistics.median(decode_step_times(engine, batch, context, steps, gen)[2:])
        found[str(batch)] = {"step_ms": 1e3 * step, "tokens_per_s": batch / step}
        if device.type == "cuda":
            found[str(batch)]["kernels_ms"] = kernel_ms(engine, batch, context, 5, gen)
        print(f"decode {batch:>3} rows: {found[str(batch)]}", flush=True)
    engine.shutdown()
    return found


def kernel_ms(engine: LLMEngine, batch: int, context: int, steps: int,
              gen: torch.Generator) -> float:
    """The device's kernel time a decode step of ``batch`` rows, from torch.profiler (kernels
    replayed from a graph included), summed as its tables' device-time total is."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    decode_step_times(engine, batch, context, steps, gen, around=lambda: prof)
    return sum(e.self_device_time_total for e in prof.events()
               if e.device_type == DeviceType.CUDA and not e.is_user_annotation) / 1e3 / steps


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched but views (on a GPU each is a kernel launch, or a few),
    a FlexAttention call as one (compiled, it is one kernel; unfused, as off CUDA, many)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __enter__(self):
        unfused = flex_attention.flex_attention

        def one_kernel(*args, **kwargs):
            self.count += 1
            with _disable_current_modes():
                return unfused(*args, **kwargs)

        flex_attention.flex_attention = one_kernel
        self._unfused = unfused
        return super().__enter__()

    def __exit__(self, *exc):
        flex_attention.flex_attention = self._unfused
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view  # (a view launches nothing)
        return func(*args, **(kwargs or {}))


def dispatched_ops(folder: str, rows: int) -> dict:
    """ATen ops one eager decode step of ``rows`` rows dispatches, network and sampling, with
    each attention backend: counted on the CPU off its kernels, where the network runs the
    PyTorch ops it runs on CUDA (TORCH_SDPA there is the path CUDA took before FlexAttention).
    A step replayed from a CUDA graph is one launch instead. (A small pool: off CUDA
    FlexAttention runs unfused, its scores over every slot.)"""
    found = {}
    os.environ[library.OFF] = "off"
    for backend in ("TORCH_SDPA", "FLEX_ATTENTION"):
        engine = LLMEngine(EngineConfig(model=folder, device="cpu", dtype="auto",
                                        max_num_seqs=rows, attention_backend=backend,
                                        num_kv_blocks=8 * rows,
                                        enforce_eager=True, enable_prefix_caching=False))
        counter = OpCounter()
        decode_step_times(engine, rows, 64, 1, torch.Generator().manual_seed(0),
                          around=lambda: counter)
        found[backend] = counter.count
        engine.shutdown()
    del os.environ[library.OFF]
    print(f"ops a {rows}-row decode step dispatches: {found}", flush=True)
    return found


def offline(folder: str, device: torch.device, num_prompts: int, batch: int) -> dict:
    args = SimpleNamespace(model=folder, dtype="auto", device=str(device),
                           max_num_seqs=batch, max_num_batched_tokens=2048, threads=None,
                           kv_cache_memory=None)
    requests = offline_throughput.make_requests(num_prompts, 0, vocab=49152)
    found = {policy: offline_throughput.run_conveyor(requests, policy, args)
             for policy in ("continuous", "static")}
    found["transformers"] = offline_throughput.run_transformers(requests, args)
    found["continuous_over_static"] = found["continuous"] / found["static"]
    found["continuous_over_transformers"] = found["continuous"] / found["transformers"]
    return {"requests": num_prompts, "batch": batch, "tokens_per_s": found}


def serve(folder: str, device: torch.device, concurrency: int, num_prompts: int,
          workdir: Path) -> dict:
    """``conveyor serve`` in its own process, ``conveyor bench serve`` against it."""
    with ConveyorServer([folder, "--device", str(device), "--max-num-seqs", str(concurrency)],
                        str(workdir / "server.log")) as server:
        subprocess.run([sys.executable, "-m", "conveyor.cli", "bench", "serve", "--port",
                        str(server.port), "--tokenizer", folder,
                        "--num-prompts", str(num_prompts), "--max-concurrency",
                        str(concurrency), "--random-input-len", "256",
                        "--random-output-len", "256", "--ignore-eos", "--disable-tqdm",
                        "--save-result", "--result-dir", str(workdir),
                        "--result-filename", "serve.json"], check=True)
    return json.loads((workdir / "serve.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    p.add_argument("--workdir", default=None, help="where the models are written (kept)")
    p.add_argument("--sizes", default="1,8,32,64")
    p.add_argument("--num-prompts", type=int, default=128, help="the offline workload's")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--skip", default="", help="comma-separated parts to skip: equivalence, "
                                              "decode, ops, offline, serve")
    p.add_argument("--tokenizer", default=None,
                   help="a saved tokenizer's folder for the written models (default: SmolLM2's, "
                        "read from the default model's GGUF)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device(args.device)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="conveyor-gpu-"))
    skip = set(filter(None, args.skip.split(",")))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
              else platform.processor() or "cpu", "torch": torch.__version__,
              "shape": args.shape, "seconds": {}}
    sizes = [int(s) for s in args.sizes.split(",")]
    parts = {
        "equivalence": lambda: equivalence(
            write_model("tiny", workdir / "tiny", torch.float32, args.tokenizer), device),
        "model": lambda: write_model(args.shape, workdir / args.shape, torch.bfloat16,
                                     args.tokenizer),
        "decode": lambda: decode_steps(folder, device, sizes, context=256, steps=20),
        "ops": lambda: dispatched_ops(folder, rows=32),
        "offline": lambda: offline(folder, device, args.num_prompts, batch=32),
        "serve": lambda: serve(folder, device, args.concurrency, 4 * args.concurrency,
                               workdir),
    }
    for name, part in parts.items():
        if name in skip - {"model"}:  # (the other parts need the model)
            continue
        start = time.monotonic()
        found = part()
        if name == "model":
            folder = found
        else:
            result[name] = found
        result["seconds"][name] = round(time.monotonic() - start, 1)
        out.write_text(json.dumps(result, indent=1))
        print(f"{name}: {result['seconds'][name]} s, wrote {out}", flush=True)


if __name__ == "__main__":
    main()
