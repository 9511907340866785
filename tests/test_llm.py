"""The Python API on the default model: stops, n, seeds, chat, metrics, bad input, no leaks."""

from __future__ import annotations

import pytest
from engine_checks import assert_no_leak

from conveyor import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "The three primary colours are"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", num_kv_blocks=256, max_model_len=512, max_num_seqs=8)


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_outputs_come_back_in_input_order_with_metrics(llm):
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt == prompt
        assert out.prompt_token_ids == llm.get_tokenizer().encode(prompt)
        assert out.outputs[0].token_ids and out.outputs[0].finish_reason in ("stop", "length")
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert_no_leak(llm)


def test_stop_string_ends_the_request_and_is_excluded(llm):
    full = llm.generate(PROMPTS[1], greedy(32), use_tqdm=False)[0].outputs[0]
    stop = full.text[12:15]
    assert len(stop) == 3 and stop in full.text
    out = llm.generate(PROMPTS[1], greedy(32, stop=[stop, "zzzz-never"]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full.text[:full.text.index(stop)]
    assert len(c.token_ids) < len(full.token_ids)
    assert_no_leak(llm)


def test_stop_token_ids_end_the_request(llm):
    full = llm.generate(PROMPTS[2], greedy(32), use_tqdm=False)[0].outputs[0]
    stop_id = full.token_ids[6]
    first = full.token_ids.index(stop_id)
    c = llm.generate(PROMPTS[2], greedy(32, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id
    assert c.token_ids == full.token_ids[:first + 1]


def test_eos_stops_unless_ignored(llm):
    conversation = [{"role": "user", "content": "Say hello."}]
    c = llm.chat(conversation, greedy(200), use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.token_ids[-1] in llm.engine.eos_token_ids
    c = llm.chat(conversation, greedy(len(c.token_ids) + 5, ignore_eos=True),
                 use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length"


def test_max_tokens_gives_length(llm):
    c = llm.generate(PROMPTS[0], greedy(5, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5


def test_seed_gives_the_same_tokens_whatever_the_batch():
    """Under --batch-invariant, by design; without it a seeded sample can flip where the batch
    moves a logit across the draw's boundary (tests/worker/test_batch_invariance.py)."""
    llm = LLM(batch_invariant=True, num_kv_blocks=256, max_model_len=512, max_num_seqs=8)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=77, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS[3], params, use_tqdm=False)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(PROMPTS + [PROMPTS[3]], [noisy] * 4 + [params], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone


def test_n_samples_and_chat_on_many_conversations(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    conversations = [[{"role": "user", "content": q}] for q in ("Hi!", "What is 2+2?")]
    outs = llm.chat(conversations, greedy(8), use_tqdm=False)
    assert len(outs) == 2 and all(o.outputs[0].token_ids for o in outs)
    assert_no_leak(llm)


def test_logprobs_in_outputs(llm):
    c = llm.generate(PROMPTS[0], greedy(4, logprobs=2), use_tqdm=False)[0].outputs[0]
    assert len(c.logprobs) == 4
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert tok in entry and entry[tok].rank == 1 and entry[tok].logprob <= 0
        assert len(entry) in (2, 3)  # the sampled token plus the top 2 (it may be among them)


@pytest.mark.parametrize("bad, message", [
    ("", "prompt must not be empty"),
    ({"prompt_token_ids": []}, "prompt must not be empty"),
    ("word " * 600, "exceeds max_model_len"),
    ({"prompt_token_ids": [10**9]}, "prompt token ids"),
])
def test_bad_prompts_are_refused_and_lose_no_work(llm, bad, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPTS[0], bad], greedy(4), use_tqdm=False)
    engine = llm.engine
    engine.add_request("good", PROMPTS[0], greedy(4))
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", bad, greedy(4))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outputs] == ["good"]
    assert_no_leak(llm)


@pytest.mark.parametrize("kwargs, name", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"),
    ({"top_k": -5}, "top_k"), ({"min_p": 2}, "min_p"), ({"stop": [""]}, "stop"),
])
def test_bad_sampling_params_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} "):
        SamplingParams(**kwargs)


def test_abort_returns_pages_at_once(llm):
    engine = llm.engine
    engine.add_request("long", PROMPTS[0], greedy(200, ignore_eos=True))
    engine.step()
    assert engine.scheduler.kv.pool.num_used_blocks > 0
    engine.abort_request("long")
    assert_no_leak(llm)


def test_unknown_model_path_and_bad_settings():
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        LLM(model="/nonexistent/does-not-exist.gguf")
    with pytest.raises(ValueError, match="policy"):
        LLM(policy="sometimes")
    with pytest.raises(ValueError, match="max_model_len 4096 does not fit"):
        LLM(num_kv_blocks=8, max_model_len=4096)


def test_contiguous_layout_gives_the_same_tokens_with_fewer_seats(llm):
    """--kv-layout contiguous reserves max_model_len per request: same greedy outputs as paging,
    but the pool only holds pool // max_model_len requests at once."""
    prompts = PROMPTS * 3
    params = greedy(20, ignore_eos=True)
    paged = llm.generate(prompts, params, use_tqdm=False)
    contiguous = LLM(dtype="float32", num_kv_blocks=96, max_model_len=512, max_num_seqs=8,
                     kv_layout="contiguous")
    assert not contiguous.engine.config.enable_prefix_caching
    out = contiguous.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in paged]
    steps = list(contiguous.engine.steps)
    assert max(s.num_running for s in steps) == 96 // (512 // 16)  # three regions of 32 pages
    assert_no_leak(contiguous)
    with pytest.raises(ValueError, match="needs 64 KV pages; the pool has 40"):
        LLM(num_kv_blocks=40, max_model_len=1024, kv_layout="contiguous")
