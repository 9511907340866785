"""Greedy runs of Conveyor and transformers side by side, for the equivalence tests and for the
tests that compare Conveyor with itself (2 ranks against 1, replicas against one engine)."""

from __future__ import annotations

import copy
import functools
import random

import torch
import transformers

from conveyor import LLM, SamplingParams

from hf_gguf import hf_of_gguf

TIE = 1e-4
BF16_TIE = 0.25    # two bfloat16 steps at |logit| ~16, the top logits' scale for this model
BF16_TOKENS = 12   # "the first tokens": after a few bf16 roundings paths may part at near-ties
NEW_TOKENS = 40
PROMPT_LENGTHS = [5, 9, 14, 20, 27, 33, 41, 50, 58, 66, 77, 90]

TEXT = ("Continuous batching admits and evicts requests at every iteration of the model, so the "
        "batch stays full while short answers finish and long ones keep going. The KV cache lives "
        "in fixed-size pages drawn from a pool and returned the moment a request ends; without "
        "paging, memory would be reserved for the longest possible answer of every request, and "
        "far fewer requests could run at once. Static batching, by contrast, waits for the longest "
        "request of a batch before it admits anyone new, which leaves finished slots idle.")


def text_prompts(tokenizer) -> list[list[int]]:
    ids = tokenizer.encode(TEXT)
    assert len(ids) >= max(PROMPT_LENGTHS)
    return [ids[i % 7:i % 7 + n] for i, n in enumerate(PROMPT_LENGTHS)]


def random_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], new_tokens: int
              ) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy continuations with its KV cache, and the top-2 logit gap at each step.
    The prompts go as one batch, padded on the left (the steps read the weights once for all;
    the gaps move by float32 rounding, far below a tie), except where transformers would count
    the padding in (a sliding window, a rope scaled by length): then one at a time."""
    rope = getattr(model.config, "rope_parameters", None) or {}
    padding_counts = (getattr(model.config, "sliding_window", None) is not None
                      or rope.get("rope_type", "default") not in ("default", "linear", "llama3"))
    if padding_counts and len(prompts) > 1:
        return [hf_greedy(model, [p], new_tokens)[0] for p in prompts]
    width = max(len(p) for p in prompts)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                        device=model.device)
    inputs = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = transformers.DynamicCache()
    tokens, gaps = [[] for _ in prompts], [[] for _ in prompts]
    for _ in range(new_tokens):
        out = model(input_ids=inputs, attention_mask=mask, position_ids=positions,
                    past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1].float()
        top2 = logits.topk(2).values
        for i, (token, gap) in enumerate(zip(logits.argmax(-1).tolist(),
                                             (top2[:, 0] - top2[:, 1]).tolist())):
            tokens[i].append(token)
            gaps[i].append(gap)
        inputs = torch.tensor([[t[-1]] for t in tokens], device=model.device)
        positions = positions[:, -1:] + 1
        mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
    return list(zip(tokens, gaps))


@functools.lru_cache(maxsize=None)
def hf_model(kind: str, path: str) -> transformers.PreTrainedModel:
    """transformers' float32 model of the file or folder, loaded once (a GGUF's dequantizing
    takes seconds); the other dtypes' references cast a copy of it."""
    if kind.endswith("gguf"):
        model = hf_of_gguf(path)[0]
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@functools.lru_cache(maxsize=None)
def reference(kind: str, path: str, dtype: str = "float32", new_tokens: int = NEW_TOKENS
              ) -> tuple[list[list[int]], list[tuple[list[int], list[float]]]]:
    """kind: "gguf" (the default model, text prompts), "tiny-gguf" or "hf" (random prompts)."""
    model = hf_model(kind, path)
    if dtype != "float32":  # the weights cast, the buffers (rope's frequencies) kept, as
        model = copy.deepcopy(model)  # from_pretrained(dtype=...) gives them
        for weight in model.parameters():
            weight.data = weight.data.to(getattr(torch, dtype))
    if kind == "gguf":
        prompts = text_prompts(hf_of_gguf(path)[1])
    else:
        prompts = random_prompts(model.config.vocab_size)
    return prompts, hf_greedy(model, prompts, new_tokens)


def compare(ours: list[int], ref: list[int], gaps: list[float], tie: float = TIE) -> bool:
    """True if identical; False if they part at a tie; fails the test otherwise."""
    for step, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert gaps[step] <= tie, (
                f"token {step} differs ({a} vs transformers' {b}) and transformers' top-2 gap "
                f"{gaps[step]:.3g} is not a tie\nours: {ours}\nref:  {ref}")
            return False
    assert len(ours) == len(ref)
    return True


def run_conveyor(path: str | None, prompts, policy: str, dtype: str = "float32",
                 new_tokens: int = NEW_TOKENS, max_num_seqs: int = 12,
                 tensor_parallel_size: int = 1, check=None, num_kv_blocks: int = 20,
                 **settings):
    """check(llm): called after the run, before the engine shuts down; settings: further
    ``LLM`` keywords. Float activations and a cache of the model dtype unless they say
    otherwise: transformers' float32 numerics token for token (the defaults, int8 on the
    K-quants and a float16 cache of a float32 model, are held to llama.cpp's accuracy instead:
    tests/kernels/test_activations.py)."""
    settings.setdefault("activation_quant", "none")
    settings.setdefault("kv_cache_dtype", dtype)
    llm = LLM(model=path, dtype=dtype, policy=policy, block_size=16, num_kv_blocks=num_kv_blocks,
              max_model_len=160, max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
              tensor_parallel_size=tensor_parallel_size, **settings)
    try:
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        pool = llm.engine.scheduler.kv.pool
        assert pool.num_free_blocks == pool.num_blocks, "KV pages leaked"
        if check is not None:
            check(llm)
    finally:
        llm.engine.shutdown()
    return outputs


def check_model(kind: str, path: str, policy: str, every: int = 1, **settings) -> None:
    """every: take every so many of the prompts (the slow paths take fewer, in a pool of 12
    pages, which they still outgrow); settings: further ``LLM`` keywords."""
    prompts, refs = reference(kind, path)
    prompts, refs = prompts[::every], refs[::every]
    outputs = run_conveyor(None if kind == "gguf" else path, prompts, policy,
                           num_kv_blocks=20 if every == 1 else 12, **settings)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0, "the pool was meant to preempt"
    identical = [compare(o.outputs[0].token_ids, *ref) for o, ref in zip(outputs, refs)]
    assert all(o.prompt_token_ids == p for o, p in zip(outputs, prompts))
    print(f"{kind} {policy}: {sum(identical)}/{len(identical)} identical, rest parted at ties")
