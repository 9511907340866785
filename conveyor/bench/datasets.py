"""Workloads for the serving benchmark: prompts with the output length each should ask for.

``conversation`` is a bundled synthetic workload shaped like chat traffic: prompt and output
lengths are log-normal (heavy right tail), with means taken from the ShareGPT statistics the vLLM
paper reports (Kwon et al., SOSP 2023: ~161 input and ~338 output tokens per request) and a
log-space spread of 1.0, which puts the median near 60% of the mean and the 99th percentile near
10x the median, the long tail of real conversations. The text is drawn from a bundled English passage, so no
dataset is downloaded.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

CONVERSATION_INPUT_MEAN = 161
CONVERSATION_OUTPUT_MEAN = 338
CONVERSATION_SIGMA = 1.0
CONVERSATION_MAX_INPUT = 1024
CONVERSATION_MAX_OUTPUT = 1024

_CORPUS = Path(__file__).with_name("corpus.txt")


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int     # tokens, by the benchmark's tokenizer
    output_len: int     # max_tokens to ask for


def _token_pool(tokenizer) -> list[int]:
    return tokenizer.encode(_CORPUS.read_text(), add_special_tokens=False)


def _prompt_of_length(pool: list[int], n: int, rng: random.Random, tokenizer) -> BenchRequest:
    start = rng.randrange(len(pool))
    ids = [pool[(start + i) % len(pool)] for i in range(n)]
    text = tokenizer.decode(ids)
    return BenchRequest(text, len(tokenizer.encode(text, add_special_tokens=False)), 0)


def _lognormal(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    mu = math.log(mean) - sigma ** 2 / 2
    return int(min(hi, max(lo, round(rng.lognormvariate(mu, sigma)))))


def conversation_dataset(tokenizer, num: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    pool = _token_pool(tokenizer)
    out = []
    for _ in range(num):
        n_in = _lognormal(rng, CONVERSATION_INPUT_MEAN, CONVERSATION_SIGMA, 4, CONVERSATION_MAX_INPUT)
        n_out = _lognormal(rng, CONVERSATION_OUTPUT_MEAN, CONVERSATION_SIGMA, 1,
                           CONVERSATION_MAX_OUTPUT)
        req = _prompt_of_length(pool, n_in, rng, tokenizer)
        req.output_len = n_out
        out.append(req)
    return out


def random_dataset(tokenizer, num: int, seed: int, input_len: int, output_len: int,
                   range_ratio: float) -> list[BenchRequest]:
    """vLLM's ``random``: lengths uniform in [len * (1 - r), len * (1 + r)]."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    out = []
    for _ in range(num):
        n_in = rng.randint(max(1, int(input_len * (1 - range_ratio))),
                           max(1, int(input_len * (1 + range_ratio))))
        n_out = rng.randint(max(1, int(output_len * (1 - range_ratio))),
                            max(1, int(output_len * (1 + range_ratio))))
        ids = [rng.randrange(100, vocab) for _ in range(n_in)]
        text = tokenizer.decode(ids)
        out.append(BenchRequest(text, len(tokenizer.encode(text, add_special_tokens=False)), n_out))
    return out


def uniform_dataset(tokenizer, num: int, seed: int, input_range: tuple[int, int],
                    output_range: tuple[int, int]) -> list[BenchRequest]:
    """English prompts (from the bundled passage) and output lengths uniform in the given ranges,
    both ends included: a workload any server tokenizes the same way."""
    rng = random.Random(seed)
    pool = _token_pool(tokenizer)
    out = []
    for _ in range(num):
        req = _prompt_of_length(pool, rng.randint(*input_range), rng, tokenizer)
        req.output_len = rng.randint(*output_range)
        out.append(req)
    return out


def read_jsonl(path: str, expected: str, parse):
    """``parse(row)`` of each non-blank line's JSON object; a line it cannot parse is one
    ValueError naming the file, the line and ``expected``."""
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                parsed = parse(json.loads(line))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: expected {expected} ({e})") from None
            yield parsed


def jsonl_dataset(tokenizer, path: str, num: int, default_output_len: int) -> list[BenchRequest]:
    """One JSON object per line: {"prompt": str, "output_len": int (optional)}."""
    out = []
    for prompt, n_out in read_jsonl(path, '{"prompt": ..., "output_len": ...}',
                                    lambda row: (row["prompt"], int(row.get(
                                        "output_len", row.get("max_tokens", default_output_len))))):
        out.append(BenchRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)),
                                n_out))
        if len(out) == num:
            break
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out
