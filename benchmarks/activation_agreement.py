"""What quantizing the linears' inputs (issue 36), or the KV cache (issue 46), does to a model's
next-token distribution.

Teacher-forced over a text (default: ``conveyor/bench/corpus.txt``), transformers in float32:
the reference run, then one run per mode: an activation mode with every linear's input (the
head's too) quantized as the integer kernels quantize it (``conveyor.kernels.activations``;
with a GGUF, ``int8`` takes each linear's kernel numerics from its stored type, Q8_K on the
K-quants and Q8_0 on the others, as llama.cpp does, and ``auto`` is ``--activation-quant
auto``'s: Q8_K on the K-quants, float on the others), or
``kv-int8`` (``kv-float16``) with every layer's keys (after rope) and values rounded to int8
rows (to halves) as ``--kv-cache-dtype int8`` (``float16``) stores them
(``conveyor.model.kv_cache``), each token's own included, as the kernels read them; ``A+K``
both (``auto+kv-float16``: the avx2 tier's defaults). Per mode: the share of positions whose
top token is the reference's, and the mean KL(reference || mode).

    .venv/bin/python benchmarks/activation_agreement.py [--model F.gguf | HF-folder] [--json F]

``--ctx N --chunks C`` takes llama.cpp's ``llama-perplexity --kl-divergence`` positions instead
(the text tokenized whole, BOS first where the tokenizer adds one; chunks of N tokens, each
starting with BOS; the KL of the predictions from position N / 2 on), so that its figures stand
beside llama.cpp's own on the same file and text.
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

import gguf

from conveyor.kernels.activations import ACTIVATION_MODES, K_QUANTS, fake_quantize, kernel_mode
from conveyor.model.kv_cache import as_cached
from conveyor.model.loader import default_model_path

KV_MODES = {"kv-int8": torch.int8, "kv-float16": torch.float16}


def cached_kv_attention(storage: torch.dtype):
    """SDPA over keys and values as a cache of ``storage`` gives them back."""
    def attention(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, as_cached(key, storage),
                                      as_cached(value, storage), attention_mask, **kwargs)
    return attention


for name, storage in KV_MODES.items():
    AttentionInterface.register(name, cached_kv_attention(storage))


def load(path: str) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    if path.endswith(".gguf"):
        kw = dict(pretrained_model_name_or_path=os.path.dirname(path),
                  gguf_file=os.path.basename(path))
    else:
        kw = dict(pretrained_model_name_or_path=path)
    model = transformers.AutoModelForCausalLM.from_pretrained(**kw, dtype=torch.float32)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(**kw)


def stored_types(model: transformers.PreTrainedModel, path: str) -> dict[str, int]:
    """Each linear's GGUF block type, by module name (the head: output, or the tied table)."""
    reader = gguf.GGUFReader(path)
    types = {t.name.removesuffix(".weight"): int(t.tensor_type) for t in reader.tensors}
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items()
                if name == model.config.model_type)
    names = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    found = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name == "lm_head":
            found[name] = types.get("output", types.get("token_embd"))
        elif isinstance(m, torch.nn.Linear):
            found[name] = types[names.get_name(name)]
    return found


def layer_mode(mode: str, ggml_type: int | None) -> str:
    """The quantization a linear of this stored type gets in ``mode`` (None: not a GGUF)."""
    if mode == "auto":
        return "int8-superblock" if ggml_type in K_QUANTS else "none"
    return kernel_mode(mode, ggml_type) if mode == "int8" and ggml_type is not None else mode


@torch.inference_mode()
def log_probs(model, windows: list[torch.Tensor], mode: str, types: dict[str, int],
              first: int = 0) -> torch.Tensor:
    """[positions, vocab]: every window's next-token log-distributions from position
    ``first`` on (the last one's too, or but it where ``first``), inputs or KV quantized."""
    parts = mode.split("+")
    kv = next((p for p in parts if p in KV_MODES), None)
    activations = next((p for p in parts if p not in KV_MODES), "none")
    hooks = []
    for name, m in model.named_modules():
        layer = layer_mode(activations, types.get(name))
        if isinstance(m, torch.nn.Linear) and layer != "none":
            hooks.append(m.register_forward_pre_hook(
                lambda _, args, layer=layer: (fake_quantize(args[0], layer),)))
    model.set_attn_implementation(kv or "sdpa")
    end = -1 if first else None
    try:
        return torch.cat([torch.log_softmax(
            model(w.unsqueeze(0)).logits[0, first:end].float(), dim=-1) for w in windows])
    finally:
        for h in hooks:
            h.remove()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file or a Hugging Face folder "
                   "(default: the default model)")
    p.add_argument("--text", default=None, help="a text file (default: bench/corpus.txt)")
    p.add_argument("--window", type=int, default=512, help="tokens a forward pass sees")
    p.add_argument("--ctx", type=int, default=None,
                   help="llama-perplexity's chunks of this many tokens (with --chunks)")
    p.add_argument("--chunks", type=int, default=None)
    p.add_argument("--modes", nargs="+",
                   default=[m for m in ACTIVATION_MODES if m != "none"] + list(KV_MODES))
    p.add_argument("--json", default=None, help="write the figures here too")
    args = p.parse_args()
    path = args.model or default_model_path()
    model, tokenizer = load(path)
    text = (open(args.text).read() if args.text else
            resources.files("conveyor.bench").joinpath("corpus.txt").read_text())
    types = stored_types(model, path) if path.endswith(".gguf") else {}
    first = 0
    if args.ctx:  # llama-perplexity's chunks, each led by BOS where the tokenizer adds one
        ids = torch.tensor(tokenizer.encode(text))
        windows = [w.clone() for w in ids[:args.ctx * args.chunks].split(args.ctx)]
        windows = [w for w in windows if len(w) == args.ctx]
        if tokenizer.bos_token_id is not None and int(ids[0]) == tokenizer.bos_token_id:
            for w in windows:
                w[0] = tokenizer.bos_token_id
        first = args.ctx // 2
    else:
        ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False))
        windows = list(ids.split(args.window))
    reference = log_probs(model, windows, "none", types, first)
    top = reference.argmax(dim=-1)
    print(f"{os.path.basename(path)}: {len(reference)} positions teacher-forced in "
          f"{len(windows)} windows of {len(windows[0])} tokens, float32; every linear's input "
          f"quantized, or the KV cache")
    print(f"{'mode':<20}{'top-1 agreement':>16}{'mean KL':>12}{'max KL':>12}")
    figures = {}
    for mode in args.modes:
        got = log_probs(model, windows, mode, types, first)
        kl = (reference.exp() * (reference - got)).sum(dim=-1)
        agree = float((got.argmax(dim=-1) == top).float().mean())
        figures[mode] = {"top1_agreement": agree, "mean_kl": float(kl.mean()),
                         "max_kl": float(kl.max()), "positions": len(kl)}
        print(f"{mode:<20}{100 * agree:>15.2f}%{float(kl.mean()):>12.2e}{float(kl.max()):>12.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": os.path.basename(path), "window": len(windows[0]),
                       "first": first, "tokens": len(ids), "modes": figures}, f, indent=1)


if __name__ == "__main__":
    main()
