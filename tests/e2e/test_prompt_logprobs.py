"""Prompt log-probabilities (vLLM's ``prompt_logprobs``; OpenAI's ``echo`` with ``logprobs``, what
evaluation harnesses send for log-likelihood tasks) against a teacher-forced transformers run."""

from __future__ import annotations


import httpx
import openai
import pytest
import torch
import transformers
from engine_checks import assert_no_leak
from hf_gguf import hf_of_gguf
from server_process import running_server
from tiny_models import make_tiny_checkpoint

from conveyor import LLM, SamplingParams
from conveyor.model.loader import default_model_path

PROMPT = "The three most useful things to know about continuous batching are that"
TOLERANCE = 1e-3  # float32 both sides


def teacher_forced(model: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row i is the log-distribution of token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def check_against(reference: torch.Tensor, ids: list[int], entries: list, k: int) -> None:
    """entries: per prompt token, None for the first, else {token id: (logprob, rank)}."""
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        row, got = reference[i - 1], entries[i]
        assert abs(got[ids[i]][0] - float(row[ids[i]])) < TOLERANCE, i
        # its rank: one past the tokens above it, give or take those within float32's rounding
        # of it (a 49k vocabulary has tens of values within 1e-4 of a middling one)
        value = float(row[ids[i]])
        above, near = int((row > value + 1e-4).sum()), int((row > value - 1e-4).sum())
        assert above + 1 <= got[ids[i]][1] <= near, i
        top = row.topk(k)
        alternatives = {t: v for t, v in got.items() if v[1] <= k}
        assert len(alternatives) == k, i
        for value, token in zip(top.values.tolist(), top.indices.tolist()):
            # (a near-tie may swap two alternatives)
            assert token in alternatives or value - float(row[top.indices[-1]]) < TOLERANCE
            if token in alternatives:
                assert abs(alternatives[token][0] - value) < TOLERANCE


# -- the engine --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, transformers.PreTrainedModel]:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")
    return path, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.mark.parametrize("kernels", ["on", "off"])
def test_prompt_logprobs_match_transformers_through_chunks_samples_and_cache(
        tiny, kernels, monkeypatch):
    if kernels == "off":
        monkeypatch.setenv("CONVEYOR_CPU_KERNELS", "off")
    path, hf = tiny
    ids = [(37 * i + 11) % 49000 + 100 for i in range(70)]
    reference = teacher_forced(hf, ids)
    # 16 tokens a step: the prompt runs in five chunks
    llm = LLM(model=path, dtype="float32", kv_cache_dtype="float32", num_kv_blocks=64,
              max_model_len=256, max_num_batched_tokens=16, max_num_seqs=4)
    first = llm.generate({"prompt_token_ids": ids},
                         SamplingParams(temperature=0, max_tokens=3, n=2, prompt_logprobs=4),
                         use_tqdm=False)[0]
    assert all(len(s.token_ids) == 3 for s in first.outputs)
    check_against(reference, ids, [None if e is None else {t: (lp.logprob, lp.rank)
                                                          for t, lp in e.items()}
                                   for e in first.prompt_logprobs], 4)
    # The same prompt again: its pages are cached, but this request computes every token.
    again = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                         use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    # (the same bits through the kernels, which are batch invariant; the PyTorch path is not,
    # and one loaded run of the suite saw its last position 2e-6 apart)
    exact = kernels == "on"
    assert again.prompt_logprobs[0] is None and [list(e) for e in again.prompt_logprobs[1:]] == [
        [ids[i]] for i in range(1, len(ids))]
    for i, e in enumerate(again.prompt_logprobs[1:], 1):
        before = first.prompt_logprobs[i][ids[i]].logprob
        assert e[ids[i]].logprob == (before if exact else pytest.approx(before, abs=1e-5)), i
    # without prompt_logprobs, the cache serves it
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert plain[0].prompt_logprobs is None and plain[0].num_cached_tokens > 0
    assert_no_leak(llm)


# -- the server --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    with running_server("--dtype", "float32", "--kv-cache-dtype", "float32") as proc:
        yield proc


@pytest.fixture(scope="module")
def hf_default() -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    return hf_of_gguf(default_model_path())


@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_max_tokens_0_is_the_prompts_log_likelihood(client, model, hf_default,
                                                                  stream):
    hf, tokenizer = hf_default
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    reference = teacher_forced(hf, ids)
    response = client.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=2,
                                         max_tokens=0, stream=stream)
    if stream:
        chunks = list(response)
        text = "".join(c.choices[0].text for c in chunks)
        lp = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
        tokens = [t for part in lp for t in part.tokens]
        logprobs = [v for part in lp for v in part.token_logprobs]
        offsets = [o for part in lp for o in part.text_offset]
        reason = chunks[-1].choices[0].finish_reason
    else:
        choice = response.choices[0]
        text, reason = choice.text, choice.finish_reason
        tokens, logprobs = choice.logprobs.tokens, choice.logprobs.token_logprobs
        offsets = choice.logprobs.text_offset
        assert response.usage.completion_tokens == 0
        assert response.usage.prompt_tokens == len(ids)
        assert choice.logprobs.top_logprobs[0] is None
        assert all(len(top) in (2, 3) for top in choice.logprobs.top_logprobs[1:])
    assert text == PROMPT and reason == "length"
    assert "".join(tokens) == PROMPT and len(tokens) == len(ids)
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(logprobs[i] - float(reference[i - 1, ids[i]])) < TOLERANCE, i


def test_echo_logprobs_with_new_tokens(client, model):
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                      logprobs=1)
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                       logprobs=1, echo=True)
    new, both = plain.choices[0], echoed.choices[0]
    assert both.text == PROMPT + new.text
    n = len(new.logprobs.tokens)
    assert both.logprobs.tokens[-n:] == new.logprobs.tokens
    assert both.logprobs.token_logprobs[-n:] == pytest.approx(new.logprobs.token_logprobs,
                                                              abs=TOLERANCE)
    assert both.logprobs.text_offset[-n:] == [len(PROMPT) + o for o in new.logprobs.text_offset]


def test_vllm_prompt_logprobs_field(server, model, hf_default):
    hf, tokenizer = hf_default
    messages = [{"role": "user", "content": "Hi"}]
    for route, body in (("/v1/completions", {"prompt": PROMPT}),
                        ("/v1/chat/completions", {"messages": messages})):
        r = httpx.post(server.base_url + route, timeout=60, json={
            "model": model, **body, "max_tokens": 1, "prompt_logprobs": 1})
        assert r.status_code == 200, r.text
        data = r.json()
        entries = data["choices"][0]["prompt_logprobs"] if "prompt" in body else (
            data["prompt_logprobs"])
        text = PROMPT if "prompt" in body else tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        reference = teacher_forced(hf, ids)
        check_against(reference, ids, [None if e is None else {
            int(t): (v["logprob"], v["rank"]) for t, v in e.items()} for e in entries], 1)
    # streamed chat: in a chunk of its own, before the content
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", timeout=60, json={
            "model": model, "messages": messages, "max_tokens": 2, "prompt_logprobs": 0,
            "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert sum('"prompt_logprobs"' in line for line in lines) == 1


def test_max_tokens_0_needs_echo(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
