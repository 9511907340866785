"""What quantizing the linears' inputs (issue 36), or the KV cache (issue 46), does to a model's
next-token distribution.

Teacher-forced over a text (default: ``conveyor/bench/corpus.txt``), transformers in float32:
the reference run, then one run per mode: an activation mode with every linear's input (the
head's too) quantized as the integer kernels quantize it (``conveyor.kernels.activations``), or
``kv-int8`` with every layer's keys (after rope) and values rounded to int8 rows as
``--kv-cache-dtype int8`` stores them (``conveyor.model.kv_cache``), each token's own included,
as the decode kernels read it. Per mode: the share of positions whose top token is the
reference's, and the mean KL(reference || mode).

    .venv/bin/python benchmarks/activation_agreement.py [--model F.gguf | HF-folder] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
from importlib import resources

import torch
import transformers

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from conveyor.kernels.activations import ACTIVATION_MODES, fake_quantize
from conveyor.model.kv_cache import dequantize, quantize
from conveyor.model.loader import default_model_path

KV_MODE = "kv-int8"


def int8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA over keys and values as an int8 cache gives them back."""
    return sdpa_attention_forward(module, query, dequantize(quantize(key), key.dtype),
                                  dequantize(quantize(value), value.dtype), attention_mask,
                                  **kwargs)


AttentionInterface.register(KV_MODE, int8_kv_attention)


def load(path: str) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    if path.endswith(".gguf"):
        kw = dict(pretrained_model_name_or_path=os.path.dirname(path),
                  gguf_file=os.path.basename(path))
    else:
        kw = dict(pretrained_model_name_or_path=path)
    model = transformers.AutoModelForCausalLM.from_pretrained(**kw, dtype=torch.float32)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(**kw)


@torch.inference_mode()
def log_probs(model, windows: list[torch.Tensor], mode: str) -> torch.Tensor:
    """[positions, vocab]: every window's next-token log-distributions, inputs or KV
    quantized."""
    linears = mode not in ("none", KV_MODE)
    hooks = [m.register_forward_pre_hook(lambda _, args: (fake_quantize(args[0], mode),))
             for m in model.modules() if isinstance(m, torch.nn.Linear)] if linears else []
    model.set_attn_implementation(KV_MODE if mode == KV_MODE else "sdpa")
    try:
        return torch.cat([torch.log_softmax(model(w.unsqueeze(0)).logits[0].float(), dim=-1)
                          for w in windows])
    finally:
        for h in hooks:
            h.remove()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file or a Hugging Face folder "
                   "(default: the default model)")
    p.add_argument("--text", default=None, help="a text file (default: bench/corpus.txt)")
    p.add_argument("--window", type=int, default=512, help="tokens a forward pass sees")
    p.add_argument("--modes", nargs="+",
                   default=[m for m in ACTIVATION_MODES if m != "none"] + [KV_MODE])
    p.add_argument("--json", default=None, help="write the figures here too")
    args = p.parse_args()
    path = args.model or default_model_path()
    model, tokenizer = load(path)
    text = (open(args.text).read() if args.text else
            resources.files("conveyor.bench").joinpath("corpus.txt").read_text())
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False))
    windows = list(ids.split(args.window))
    reference = log_probs(model, windows, "none")
    top = reference.argmax(dim=-1)
    print(f"{os.path.basename(path)}: {len(ids)} tokens teacher-forced in windows of "
          f"{args.window}, float32; every linear's input quantized, or the KV cache")
    print(f"{'mode':<12}{'top-1 agreement':>16}{'mean KL':>12}{'max KL':>12}")
    figures = {}
    for mode in args.modes:
        got = log_probs(model, windows, mode)
        kl = (reference.exp() * (reference - got)).sum(dim=-1)
        agree = float((got.argmax(dim=-1) == top).float().mean())
        figures[mode] = {"top1_agreement": agree, "mean_kl": float(kl.mean()),
                         "max_kl": float(kl.max()), "positions": len(kl)}
        print(f"{mode:<12}{100 * agree:>15.2f}%{float(kl.mean()):>12.2e}{float(kl.max()):>12.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": os.path.basename(path), "window": args.window, "tokens": len(ids),
                       "modes": figures}, f, indent=1)


if __name__ == "__main__":
    main()
